"""`kvroute simulate`: compare policies in the discrete-event simulator."""

from __future__ import annotations

import argparse

from kvroute.commands.common import (
    progress_bars,
    scenario_from_flags,
)
from kvroute.parallel import add_arguments as add_parallel
from kvroute.report import (
    breakdown_table,
    console,
    err,
    error,
    sim_table,
    sweep_tables,
    warn,
    write_json,
)


def run_simulation(sc, json_path: str | None = None, plots: str | None = None) -> dict:
    """Run a scenario's policies with a progress display on stderr; print the comparison, write JSON and plots."""
    import time

    from kvroute.sim.overload import preflight, topology_warnings, warnings
    from kvroute.sim.runner import report, run_scenario

    checks = preflight(sc)
    checks["messages"] += topology_warnings(sc)
    for line in checks["messages"]:
        warn(line)
    t0 = time.perf_counter()
    with progress_bars(sc.limits.max_requests) as (on_start, on_progress):
        runs = run_scenario(sc, on_start, on_progress)
    rep = report(sc, runs)
    rep["preflight"] = {k: v for k, v in checks.items() if k != "messages"}
    rep["preflight"]["warnings"] = checks["messages"]
    console.print(sim_table(rep))
    groups = breakdown_table(rep)
    if groups is not None:
        console.print(groups)
    for r in runs:
        for line in warnings(r.label, r.result, sc):
            warn(line)
    wall = time.perf_counter() - t0
    done = sum(r.result["requests"] for r in runs)
    console.print(f"[dim]{done:,} simulated requests in {wall:.1f} s wall ({done / wall:,.0f}/s)[/dim]")
    write_json(json_path, rep)
    if plots:
        from kvroute.metrics.plots import write_plots

        for p in write_plots(runs, plots, sc.name):
            console.print(f"wrote {p}")
    return rep


def run_sweep(sc, json_path: str | None = None, plots: str | None = None, executor=None) -> dict:
    """``simulate --sweep``: knees, comparison, goodput-vs-load plot; the runs go to ``executor``."""
    from kvroute.sim.overload import preflight
    from kvroute.sim.sweep import sweep

    checks = preflight(sc)
    for line in checks["messages"]:
        if any(k in line for k in ("never run", "idle replica", "not sorted", "no requests in this trace")):
            warn(line)
    if executor is not None:
        err.print(f"[dim]sweep runs on {executor.describe()}[/dim]", highlight=False)
    result = sweep(sc, progress=lambda m: err.print(f"[dim]{m}[/dim]", highlight=False), executor=executor)
    for t in sweep_tables(sc, result):
        console.print(t)
    if result.get("slo_unmet"):
        warn(result["slo_unmet"])
    ref = result.get("reference")
    if ref and ref["basis"] == "stability":
        warn("the comparison above is at 50/70/90 % of the stability knee, since no policy has an SLO knee")
    out = {"scenario": sc.name, "seed": sc.seed, "workload": sc.workload.kind,
           "replicas": sum(g.count for g in sc.replicas), "max_requests": sc.limits.max_requests,
           "sweep": result}
    write_json(json_path, out)
    if plots:
        from kvroute.metrics.plots import write_sweep_plot

        console.print(f"wrote {write_sweep_plot(result, plots, sc.name)}")
    return out


def cmd_simulate(args: argparse.Namespace) -> int:
    """`kvroute simulate`: run a scenario's policies (or a --sweep of loads) in the simulator and print, write
    and plot the comparison."""
    from kvroute.errors import ConfigError
    from kvroute.policyfiles import register_preset_file
    from kvroute.sim.scenario import ScenarioError
    from kvroute.workload.traces import TraceError

    try:
        args.file_presets = [register_preset_file(f) for f in args.policy_file or ()]
        for f in args.policy_file or ():  # the sweep's workers register them too
            from pathlib import Path

            from kvroute.parallel import add_prelude

            add_prelude("kvroute.policyfiles:register_preset_file_text", f, Path(f).read_text())
        sc = scenario_from_flags(args.scenario, workload=args.workload, replicas=args.replicas,
                                 profile=args.profile, policy=args.policy, file_presets=args.file_presets,
                                 time_scale=args.time_scale, rate=args.rate, skip_bad=args.skip_bad,
                                 max_requests=args.max_requests, seed=args.seed, slo_ttft=args.slo_ttft,
                                 slo_tpot=args.slo_tpot, slo_target=args.slo_target, sweep=args.sweep)
        sc.policy_list()
        sc.setup()
    except (ScenarioError, ConfigError) as exc:
        return error(str(exc))
    try:
        if args.sweep:
            from kvroute.parallel import ExecutorError, make_executor

            try:
                executor = make_executor(args.workers, args.ray)
            except ExecutorError as exc:
                return error(str(exc))
            from kvroute.parallel import clear_prelude

            try:
                with executor:
                    run_sweep(sc, args.json, args.plots, executor)
            finally:
                clear_prelude()
        else:
            run_simulation(sc, args.json, args.plots)
    except (ScenarioError, TraceError) as exc:  # a bad trace line found while replaying
        return error(str(exc))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    sim = sub.add_parser("simulate", help="compare policies in the discrete-event simulator")
    sim.add_argument("scenario", nargs="?", help="scenario YAML, or the name of a bundled one (kvroute/scenarios/)")
    sim.add_argument("--workload", help="chat, tot, mixed, chat-poisson, mooncake, azure, openai, or a trace file")
    sim.add_argument("--replicas", type=int, help="replicas per replica group (per region)")
    sim.add_argument("--profile",
                     help="hardware profile for every replica: a YAML file or a bundled name (kvroute/profiles/)")
    sim.add_argument("--policy", help="comma-separated presets, e.g. round_robin,skywalker,lmetric")
    sim.add_argument("--policy-file", action="append", metavar="FILE", dest="policy_file",
                     help="a preset YAML file (name + filters/rules/cost/score, see docs/policies.md): "
                     "registered and added to the policies compared; repeatable")
    sim.add_argument("--time-scale", type=float, dest="time_scale", help="stretch trace inter-arrival times")
    sim.add_argument("--rate", type=float, help="Poisson arrival rate (requests/s) instead of trace times")
    sim.add_argument("--max-requests", type=int, dest="max_requests")
    sim.add_argument("--seed", type=int)
    sim.add_argument("--skip-bad", action="store_true", dest="skip_bad", help="skip and count malformed trace lines")
    sim.add_argument("--slo-ttft", type=float, dest="slo_ttft", metavar="S",
                     help="goodput SLO: time to first token ≤ S seconds (default 5)")
    sim.add_argument("--slo-tpot", type=float, dest="slo_tpot", metavar="S",
                     help="goodput SLO: time per output token ≤ S seconds (default 0.1)")
    sim.add_argument("--slo-target", type=float, dest="slo_target", metavar="F",
                     help="share of requests that must meet the SLO below the knee (default 0.9)")
    sim.add_argument("--sweep", action="store_true",
                     help="find each policy's capacity knee, then compare at 50/70/90%% of it")
    sim.add_argument("--json", metavar="FILE")
    sim.add_argument("--plots", metavar="DIR", help="write CDF, throughput, load-over-time and per-replica PNGs")
    add_parallel(sim)
    sim.set_defaults(func=cmd_simulate)
