"""`kvroute bench plan`: the same capacity plan on 1 worker and on N, the speedup, and that the answers agree.

The plan is the bundled ``skywalker-cost`` (SkyWalker's Fig. 10 setup, cross-region vs region-local
load balancing) with both layouts: four candidates searched side by side. Each executor is timed
once, without a progress bar, from making the executor (the pool's start-up counts) to the answer,
after one untimed simulation that loads what every run needs. Before them the machine's own
ceiling is measured: copies of one simulation run one after another, then on a warm pool (equal
independent tasks): what two processes on this machine give at best, whatever the search does.

A speedup means something only on a machine the benchmark has to itself: before it starts, the
CPU time other processes take over a second is sampled from /proc/stat and a busy machine is
refused (``--allow-busy`` runs anyway); during each timed run the CPU others took (the machine's
busy time less this process's and its workers') is measured and a run where they took more than a
quarter of a core is flagged, the result marked not valid.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvroute.argtypes import positive_int

BUSY_CORES = 0.25  # others' CPU, in cores, above which a timing is not valid


def _machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has spent so far (/proc/stat; None elsewhere)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the pool's workers, once shut down)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def others_cores(seconds: float = 1.0) -> float | None:
    """Cores' worth of CPU other processes use now, sampled over ``seconds`` (None without /proc)."""
    m0, o0 = _machine_busy_s(), _own_cpu_s()
    time.sleep(seconds)
    m1, o1 = _machine_busy_s(), _own_cpu_s()
    if m0 is None or m1 is None:
        return None
    return max(0.0, (m1 - m0) - (o1 - o0)) / seconds


def ceiling(fn: Callable[[Any], Any], task: Any, workers: int) -> dict:
    """What the machine gives: ``4 × workers`` copies of one simulation, one after another in this
    process, then on a warm pool of ``workers`` (equal tasks, no search to wait on). Its speedup
    bounds any scheduler's on this machine."""
    from kvroute.parallel import make_executor

    items = [task] * (4 * workers)
    t0 = time.perf_counter()
    for x in items:
        fn(x)
    serial = time.perf_counter() - t0
    with make_executor(workers=workers) as ex:
        t0 = time.perf_counter()
        ex.map(fn, items)
        pooled = time.perf_counter() - t0
    return {"tasks": len(items), "workers": workers, "serial_s": round(serial, 3), "pool_s": round(pooled, 3),
            "speedup": round(serial / pooled, 2)}


def run(workers: tuple[int, ...] = (1, 2), requests: int = 800, ray: str | None = None) -> dict:
    """Plan once per worker count (and on ``ray`` if given); wall times, speedups over 1 worker, answers equal."""
    # imported here: the simulator needs the [sim] extra, and parsing the command line must not
    from kvroute.parallel import make_executor
    from kvroute.plan.command import resolve
    from kvroute.plan.search import Planner, run_task
    from kvroute.plan.spec import load_plan

    spec = load_plan(resolve("skywalker-cost")).model_copy(update={"requests": requests,
                                                                   "layouts": ["even", "by-clients"]})
    out: dict = {"plan": "skywalker-cost", "requests_per_run": requests, "cpu_count": os.cpu_count(),
                 "load_before": [round(x, 2) for x in os.getloadavg()], "runs": {}}
    # one untimed run first: imports, bundled profiles and caches a first simulation loads would
    # otherwise count against whichever executor is timed first (forked workers inherit them)
    warm = Planner(spec)
    run_task((warm.deployment(warm.candidates[0], warm.kmin), spec.residency))
    if max(workers) > 1:
        out["ceiling"] = ceiling(run_task, (warm.deployment(warm.candidates[0], 2 * warm.kmin), spec.residency),
                                 max(workers))
    answers = {}
    for label, kw in [(f"{n} worker{'s' if n > 1 else ''}", {"workers": n}) for n in workers] + (
            [(f"ray {ray}", {"ray": ray})] if ray else []):
        m0, o0 = _machine_busy_s(), _own_cpu_s()
        t0 = time.perf_counter()
        with make_executor(**kw) as ex:
            planner = Planner(spec, ex)
            answer = planner.run()
            wall = time.perf_counter() - t0
        total = time.perf_counter() - t0  # with the pool's shut-down (a speculative run may finish first)
        m1, o1 = _machine_busy_s(), _own_cpu_s()
        others = None if m0 is None or m1 is None else round(max(0.0, (m1 - m0) - (o1 - o0)) / total, 2)
        answers[label] = json.dumps(answer, sort_keys=True)
        out["runs"][label] = {"wall_s": round(wall, 2), "with_shutdown_s": round(total, 2),
                              "simulations": answer["runs"], "speculative_unused": planner.speculative_unused,
                              "executor": ex.describe(), "others_cores": others,
                              "winner": answer["winner"]["candidate"] if answer["winner"] else None}
    base = out["runs"][next(iter(out["runs"]))]["wall_s"]
    for r in out["runs"].values():
        r["speedup"] = round(base / r["wall_s"], 2)
    out["answers_identical"] = len(set(answers.values())) == 1
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    busy = [label for label, r in out["runs"].items()
            if r["others_cores"] is not None and r["others_cores"] > BUSY_CORES]
    out["valid"] = not busy and all(r["others_cores"] is not None for r in out["runs"].values())
    out["busy_runs"] = busy
    return out


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register `kvroute bench plan`."""
    p = bench.add_parser("plan", help="capacity-plan wall time on 1 vs N workers (and a Ray cluster)")
    p.add_argument("--workers", default="1,2", help="worker counts to time, comma-separated (default 1,2)")
    p.add_argument("--requests", type=positive_int, default=800, help="requests per simulated run (default 800)")
    p.add_argument("--ray", metavar="ADDRESS", help="also time the plan on this Ray cluster")
    p.add_argument("--allow-busy", action="store_true", dest="allow_busy",
                   help="run even when other processes use the CPU (the speedup is then marked not valid)")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    """Print the timing table; exit 2 for a bad worker list or an unreachable Ray address."""
    from rich.table import Table

    from kvroute.parallel import ExecutorError
    from kvroute.report import console, error, write_json

    try:
        workers = tuple(int(x) for x in args.workers.split(","))
        if not workers or min(workers) < 1:
            raise ValueError
    except ValueError:
        return error(f"--workers {args.workers!r}: expected positive integers, comma-separated (e.g. 1,2)")
    busy = others_cores()
    if busy is not None and busy > BUSY_CORES and not args.allow_busy:
        return error(f"other processes are using {busy:.2f} cores of {os.cpu_count()}: a speedup measured now "
                     "means nothing; run on a quiet machine (or --allow-busy to run anyway, marked not valid)")
    try:
        result = run(workers, args.requests, args.ray)
    except ExecutorError as exc:
        return error(str(exc))
    t = Table(title=f"kvroute plan skywalker-cost ({result['requests_per_run']} requests per run), "
                    f"{result['cpu_count']} cores; load average before {result['load_before'][0]}, "
                    f"after {result['load_after'][0]}")
    for col in ("executor", "simulations", "unused speculative", "wall to answer (s)", "speedup",
                "others' CPU (cores)"):
        t.add_column(col, justify="left" if col == "executor" else "right")
    for r in result["runs"].values():
        t.add_row(r["executor"], str(r["simulations"]), str(r["speculative_unused"]), f"{r['wall_s']:.2f}",
                  f"{r['speedup']:.2f}×", "?" if r["others_cores"] is None else f"{r['others_cores']:.2f}")
    console.print(t)
    if "ceiling" in result:
        c = result["ceiling"]
        console.print(f"the machine's ceiling: {c['tasks']} copies of one simulation took {c['serial_s']:.2f} s "
                      f"in one process and {c['pool_s']:.2f} s on a warm pool of {c['workers']}: "
                      f"{c['speedup']:.2f}× (no scheduler does better here)")
    if not result["valid"]:
        console.print("[red]NOT VALID: other processes took CPU during "
                      f"{', '.join(result['busy_runs']) or 'the runs (not measurable here)'}; "
                      "the speedup is not a measurement of kvroute[/red]")
    console.print("answers identical on every executor" if result["answers_identical"]
                  else "[red]answers DIFFER between executors[/red]")
    write_json(args.json, result)
    return 0 if result["answers_identical"] and result["valid"] else 1
