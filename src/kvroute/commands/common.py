"""What several commands share: argument types, output checks, running a server, a scenario from flags."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

from kvroute.report import err, error

SWEEP_DEFAULT_REQUESTS = 2000  # per sweep run, unless the scenario or --max-requests says otherwise
OUTPUT_FLAGS = (("json", False), ("md", False), ("plots", True))  # argparse dest, is a folder


def unwritable(path: str, directory: bool) -> str | None:
    """Why ``path`` (a file, or a folder of files) cannot be written, or None. Creates the folders
    it needs, as the writer would, and tries a scratch file there; run before any work."""
    import tempfile
    from pathlib import Path

    p = Path(path)
    folder = p if directory else p.parent
    if not directory and p.is_dir():
        return "it is a directory"
    if directory and p.exists() and not p.is_dir():
        return "it is a file, not a directory"
    for parent in folder.parents if directory else (folder, *folder.parents):
        if parent.exists() and not parent.is_dir():
            return f"{parent} is a file, not a directory"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the folder {folder}: {exc.strerror or exc}"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvroute-write-check-"):
            pass
    except OSError as exc:
        return f"cannot create a file in {folder}: {exc.strerror or exc}"
    return None


def check_outputs(args: argparse.Namespace) -> int | None:
    """Exit 2 with one line when an output named on the command line cannot be written, before
    anything runs (so no run's results are lost to a typo in --json)."""
    for dest, directory in OUTPUT_FLAGS:
        path = getattr(args, dest, None)
        if not isinstance(path, str):
            continue
        why = unwritable(path, directory)
        if why:
            return error(f"--{dest} {path}: cannot write there: {why}; choose another "
                         f"{'folder' if directory else 'path'}")
    return None


def run_async(coro) -> None:
    import asyncio

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def listen(coro, what: str) -> int:
    """Run a server until it stops; a socket that cannot be bound is a one-line error, exit 2."""
    try:
        run_async(coro)
    except OSError as exc:
        return error(f"cannot listen on {what}: {exc.strerror or exc}")
    return 0


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: allowed 0 (any free port) to 65535")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers, e.g. 128,512,2048."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def scenario_from_flags(scenario: str | None, *, workload: str | None = None, replicas: int | None = None,
                        profile: str | None = None, policy: str | None = None, file_presets: list[str] | None = None,
                        time_scale: float | None = None, rate: float | None = None, skip_bad: bool = False,
                        max_requests: int | None = None, seed: int | None = None, slo_ttft: float | None = None,
                        slo_tpot: float | None = None, slo_target: float | None = None, sweep: bool = False):
    """The scenario ``scenario`` names (a file or a bundled name; None: the defaults) with what the
    command's flags override (``simulate`` and ``live`` share this); ScenarioError names the problem."""
    from kvroute.sim.scenario import Scenario, load_scenario, parse_scenario
    from kvroute.sim.tracefiles import workload_flag

    sc = load_scenario(scenario) if scenario else Scenario()
    data = sc.model_dump(exclude_none=True)
    if workload:
        kind, path = workload_flag(workload)
        data["workload"]["kind"] = kind
        if path is not None:
            data["workload"]["path"] = path
    for g in data["replicas"]:
        if replicas is not None:
            g["count"] = replicas
        if profile:
            g["profile"] = profile
    if policy:
        data["policies"] = [p.strip() for p in policy.split(",") if p.strip()]
    data["policies"] += file_presets or []  # registered from --policy-file
    for key, value in (("time_scale", time_scale), ("rate", rate)):
        if value is not None:
            data["workload"][key] = value
    if skip_bad:
        data["workload"]["skip_bad"] = True
    if max_requests is not None:
        data.setdefault("limits", {})["max_requests"] = max_requests
    if seed is not None:
        data["seed"] = seed
    for key, value in (("ttft_s", slo_ttft), ("tpot_s", slo_tpot), ("target", slo_target)):
        if value is not None:
            data.setdefault("slo", {})[key] = value
    if sweep and data.get("limits", {}).get("max_requests") is None:
        data.setdefault("limits", {})["max_requests"] = SWEEP_DEFAULT_REQUESTS
    return parse_scenario(data, scenario or "flags")


@contextlib.contextmanager
def progress_bars(total: int | None, prefix: str = "") -> Iterator[tuple[Callable[[str], None],
                                                                         Callable[[str, int], None]]]:
    """A progress bar per run on stderr: yields (on_start(label), on_progress(label, done)), the
    callbacks the simulator's and the live runner's loops take."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    tasks: dict[str, TaskID] = {}
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=False) as progress:
        def on_start(label: str) -> None:
            tasks[label] = progress.add_task(prefix + label, total=total)

        def on_progress(label: str, n: int) -> None:
            progress.update(tasks[label], completed=n)

        yield on_start, on_progress
