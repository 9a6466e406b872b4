"""`kvroute live`: flags → scenario → live run → the simulator's tables and JSON."""

from __future__ import annotations

import argparse
import asyncio
import time

from kvroute.commands.common import progress_bars, scenario_from_flags
from kvroute.report import breakdown_table, console, error, sim_table, warn, write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    lv = sub.add_parser("live", help="run a scenario for real on 127.0.0.1: emulated replicas, gateways, "
                                     "controller, delayed cross-region links, clients over HTTP")
    lv.add_argument("scenario", help="scenario YAML, or the name of a bundled one (kvroute/scenarios/)")
    lv.add_argument("--policy", help="comma-separated presets (default: the scenario's policies)")
    lv.add_argument("--max-requests", type=int, dest="max_requests", help="per policy (default: the scenario's)")
    lv.add_argument("--duration", type=float, default=120.0, metavar="S",
                    help="stop issuing after S seconds per policy (default 120)")
    lv.add_argument("--drain", type=float, default=60.0, metavar="S",
                    help="after the last request is issued, wait at most S seconds for those in flight "
                         "(default 60; the rest are reported as unfinished)")
    lv.add_argument("--replicas", type=int, help="replicas per replica group (per region)")
    lv.add_argument("--profile", help="hardware profile for every replica")
    lv.add_argument("--seed", type=int)
    lv.add_argument("--kill", action="append", default=[], metavar="KIND:NAME@Ts[+Ds]",
                    help="SIGKILL a gateway:REGION, replica:ID or the controller at T s into each policy's run; "
                         "+D: start it again D s later (repeatable)")
    lv.add_argument("--pause", action="append", default=[], metavar="KIND:NAME@Ts[+Ds]",
                    help="SIGSTOP it at T s, SIGCONT D s later (default: at the end) (repeatable)")
    lv.add_argument("--compare-sim", action=argparse.BooleanOptionalAction, default=True, dest="compare_sim",
                    help="close with the same scenario simulated and sim vs live side by side (default: on)")
    lv.add_argument("--logs", metavar="DIR", help="keep the processes' logs and configs here "
                                                  "(default: a temporary folder, removed after a good run)")
    lv.add_argument("--json", metavar="FILE")
    lv.set_defaults(func=cmd_live)


def cmd_live(args: argparse.Namespace) -> int:
    """Run it; bad input is one line and exit 2."""
    from kvroute.live.faults import parse_fault
    from kvroute.live.run import check_faults
    from kvroute.processes import ProcessError
    from kvroute.sim.scenario import ScenarioError

    try:
        sc = scenario_from_flags(args.scenario, replicas=args.replicas, profile=args.profile, policy=args.policy,
                                 max_requests=args.max_requests, seed=args.seed)
        sc.policy_list()
        sc.setup()
    except ScenarioError as exc:
        return error(str(exc))
    if sc.workload.kind in ("openai",):
        return error(f"{args.scenario}: live runs synthetic and Mooncake/Azure workloads; {sc.workload.kind!r} "
                     "conversations carry text the clients do not replay yet")
    try:
        faults = [parse_fault("kill", f) for f in args.kill] + [parse_fault("pause", f) for f in args.pause]
        check_faults(sc, faults)
    except ValueError as exc:
        return error(str(exc))
    for flag, value in (("duration", args.duration), ("drain", args.drain)):
        if value is not None and value <= 0:
            return error(f"--{flag} must be > 0 seconds, got {value:g}")
    try:
        rep = execute(sc, faults, max_requests=args.max_requests or sc.limits.max_requests,
                      duration_s=args.duration, logs=args.logs, compare_sim=args.compare_sim, drain_s=args.drain)
    except (ValueError, ProcessError) as exc:
        return error(str(exc))
    write_json(args.json, rep)
    return 0


def execute(sc, faults, *, max_requests: int | None, duration_s: float | None, logs: str | None = None,
            compare_sim: bool = False, drain_s: float = 60.0) -> dict:
    """Run live with a progress bar per policy, print the simulator's tables (and sim vs live)."""
    from kvroute.live.run import run_live

    t0 = time.perf_counter()
    with progress_bars(max_requests, prefix="live ") as (on_start, on_progress):
        rep = asyncio.run(run_live(sc, max_requests=max_requests, duration_s=duration_s, faults=faults, logs=logs,
                                   drain_s=drain_s, on_start=on_start, on_progress=on_progress))
    console.print(sim_table(rep))
    groups = breakdown_table(rep)
    if groups is not None:
        console.print(groups)
    for label, r in rep["results"].items():
        live = r["live"]
        if live["errors"]:
            warn(f"{label}: {sum(live['errors'].values())} request(s) failed: "
                 + "; ".join(f"{n}× {k}" for k, n in live["errors"].items()))
        if live["unfinished"]:
            console.print(f"[dim]{label}: {live['unfinished']} request(s) still in flight when the drain time "
                          "ran out (not counted)[/dim]")
        for f in live["faults"]:
            console.print(f"[dim]{label}: {f}[/dim]")
    done = sum(r["requests"] for r in rep["results"].values())
    console.print(f"[dim]{done:,} live requests in {time.perf_counter() - t0:.1f} s wall[/dim]")
    if compare_sim:
        rep["compare"] = compare_with_sim(sc, rep)
        if faults:
            console.print("[dim]faults were injected into the live runs only: the simulation has none[/dim]")
    return rep


def compare_with_sim(sc, live_report: dict) -> dict:
    """Simulate the same scenario (same policies, same request limit) and print both side by side."""
    from kvroute.live.compare import compare, compare_table
    from kvroute.sim.runner import report, run_scenario

    data = sc.model_dump(exclude_none=True)
    issued = max((r["issued"] for r in live_report["results"].values()), default=0)
    data.setdefault("limits", {})["max_requests"] = issued or sc.limits.max_requests
    from kvroute.sim.scenario import parse_scenario

    sim_sc = parse_scenario(data, "compare")
    sim_rep = report(sim_sc, run_scenario(sim_sc))
    cmp = compare(sim_rep, live_report)
    console.print(compare_table(cmp))
    return {"sim": sim_rep, "table": cmp}
