"""`kvroute bench fidelity`: one workload live through the gateway and in simulate."""

from __future__ import annotations

import argparse
import os

from rich.table import Table

from kvroute.argtypes import positive_int
from kvroute.report import console, err, error, write_json


def _fidelity_cell(key: str, value: float) -> str:
    if key == "cached_share":
        return f"{value:.1%}"
    return f"{value:.2f}" if key == "throughput" else f"{value * 1000:.0f} ms"


def _fidelity_spread(key: str, lo: float, hi: float) -> str:
    """A min-max spread in the cell's unit, said once: "(380-460)"."""
    if key == "cached_share":
        return f"({lo:.0%}-{hi:.0%})"
    return f"({lo:.2f}-{hi:.2f})" if key == "throughput" else f"({lo * 1000:.0f}-{hi * 1000:.0f})"


def cmd_bench_fidelity(args: argparse.Namespace) -> int:
    """`kvroute bench fidelity`: the same workload on real engines and in the simulator, metric by metric."""
    import asyncio

    from kvroute.bench.fidelity import Workload, run_fidelity
    from kvroute.bench.fidelity_calibration import calibrate_engines
    from kvroute.calibrate import CalibrationError
    from kvroute.perf.loader import ProfileError, load_profile

    if args.replay:
        return _replay(args)
    if not args.url:
        return error("bench fidelity: give the engines (--url, one per engine) or a stored run (--replay FILE)")
    if args.min_turns > args.max_turns:
        return error(f"bench fidelity: --min-turns {args.min_turns} is above --max-turns {args.max_turns}")
    calibrated = args.profile is None
    if calibrated:  # self-contained: calibrate these engines first, sharing counted
        args.host_cores = args.host_cores or os.cpu_count() or 1
        try:
            args.profile = asyncio.run(calibrate_engines(args.url, args.host_cores, args.max_batched_tokens))
        except (CalibrationError, ValueError) as exc:
            return error(f"bench fidelity: calibrating the engines: {exc}")
        err.print(f"calibrated the engines ({args.host_cores} shared cores): {args.profile}")
    try:
        load_profile(args.profile)
    except ProfileError as exc:
        return error(str(exc))
    w = Workload(args.users, args.groups, args.system_tokens, (args.min_turns, args.max_turns), args.max_tokens,
                 args.seed)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    try:
        out = asyncio.run(run_fidelity(args.url, args.profile, policies, w, log=lambda line: err.print(line),
                                       host_cores=args.host_cores, repeats=args.repeats,
                                       noise=args.engine_noise == "profile",
                                       speed=calibrated and args.speed == "probe"))
    except (RuntimeError, OSError) as exc:
        return error(f"bench fidelity: {exc}")
    return _report(args, out)


def _replay(args: argparse.Namespace) -> int:
    """`--replay FILE`: a stored run's live side against a new simulation with ``--profile``."""
    import json

    from kvroute.bench.fidelity_replay import replay
    from kvroute.perf.loader import ProfileError, load_profile

    if args.profile is None:
        return error("bench fidelity: --replay needs --profile (the profile to simulate with)")
    try:
        load_profile(args.profile)
        stored = json.loads(open(args.replay).read())
        out = replay(stored, args.profile, args.engine_noise == "profile",
                     with_background=args.host_background == "measured", with_speed=args.speed == "probe")
    except ProfileError as exc:
        return error(str(exc))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return error(f"bench fidelity: --replay {args.replay}: not a stored fidelity run ({exc!r})")
    return _report(args, out)


def _report(args: argparse.Namespace, out: dict) -> int:
    """The comparison's table, rankings and counts; the JSON where asked."""
    from kvroute.bench.fidelity import METRICS

    n = out["repeats"]
    table = Table(title=f"fidelity, live vs simulate ({args.profile}): median over {n} repeat(s) (min-max); "
                        "sim/live: of the medians; pooled: the p99 of all repeats' requests")
    table.add_column("policy")
    table.add_column("side")
    columns = [*METRICS[:2], ("ttft_p99_pooled", "TTFT p99 pooled"), *METRICS[2:]]
    for _, label in columns:
        table.add_column(label, justify="right")
    for policy, row in out["policies"].items():
        for side in ("live", "sim"):
            cells = []
            for key, _ in columns:
                if key == "ttft_p99_pooled":
                    cells.append(_fidelity_cell("ttft_p99", row[key][side]))
                    continue
                lo, hi = row[f"{side}_range"][key]
                spread = f" {_fidelity_spread(key, lo, hi)}" if n > 1 else ""
                cells.append(_fidelity_cell(key, row[side][key]) + spread)
            table.add_row(policy if side == "live" else "", side, *cells)
        ratios = [row["ttft_p99_pooled"]["sim_over_live"] if key == "ttft_p99_pooled" else row["sim_over_live"][key]
                  for key, _ in columns]
        table.add_row("", "sim/live", *("-" if r is None else f"×{r:.2f}" for r in ratios), end_section=True)
    console.print(table)
    for name, rank in (("median", out["ranking_ttft_p99"]), ("pooled", out["ranking_ttft_p99_pooled"])):
        console.print(f"TTFT p99 ({name}) ranking, live: {' < '.join(rank['live'])}; sim: {' < '.join(rank['sim'])}"
                      f" ({'same' if rank['live'] == rank['sim'] else 'different'})")
    console.print(f"{out['within_20pct']} of {out['compared']} sim/live ratios of the medians within 20 % "
                  f"({out['within_10pct']} within 10 %); "
                  f"pooled TTFT p99: {out['pooled_p99_within_20pct']} of {out['pooled_p99_compared']}")
    plain = out.get("as_calibrated")
    if plain:
        console.print(f"without the speed probes' factors (the profile as calibrated): {plain['within_20pct']} of "
                      f"{plain['compared']} within 20 % ({plain['within_10pct']} within 10 %); pooled TTFT p99: "
                      f"{plain['pooled_p99_within_20pct']} of {plain['pooled_p99_compared']}")
    # where the misses come from: each repeat's own sim/live (the model's bias against the runs' spread)
    from kvroute.bench.fidelity_spread import convoys
    from kvroute.bench.fidelity_spread import describe as describe_spread
    from kvroute.bench.fidelity_spread import spread as per_run

    out["spread"] = per_run(out["policies"], tuple(k for k, _ in METRICS))
    out["convoys"] = convoys(out["policies"])
    for line in describe_spread(out["spread"], dict(METRICS), out["convoys"]):
        console.print(f"per run, {line}")
    failed = {p: row["errors"] for p, row in out["policies"].items() if any(row["errors"].values())}
    if failed:
        err.print(f"failed requests (summed over the repeats): {failed}")
    if args.json:
        write_json(args.json, out)
    return 0


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register `bench fidelity`."""
    bf = bench.add_parser("fidelity", help="one workload live through the gateway and in simulate, side by side")
    bf.add_argument("--url", action="append", help="an engine's base URL (repeat for each)")
    bf.add_argument("--replay", metavar="FILE", help="re-simulate a stored run (its --json) with --profile against "
                    "its recorded live side; no engines needed (bench/fidelity_replay.py)")
    bf.add_argument("--profile", help="the simulator's profile (from `kvroute calibrate`; default: calibrate the "
                    "engines first with --host-cores)")
    bf.add_argument("--host-cores", type=positive_int, dest="host_cores", metavar="N",
                    help="the engines share one machine with N cores: the simulator slows a step by max(1, "
                         "engines stepping / N) (pair it with a profile from `calibrate --host-cores N`; "
                         "default: this machine's cores when no --profile is given, else unshared)")
    bf.add_argument("--max-batched-tokens", type=positive_int, dest="max_batched_tokens", metavar="N",
                    help="the engines' per-step token budget for the calibration, where they do not say it (vLLM's "
                         "depends on its device: 2048 on CPU; default as `kvroute calibrate`)")
    bf.add_argument("--policies", default="round_robin,sglang_cache_aware,lmetric,skywalker")
    bf.add_argument("--users", type=positive_int, default=12)
    bf.add_argument("--groups", type=positive_int, default=3, help="user groups, each sharing one system prompt")
    bf.add_argument("--system-tokens", type=positive_int, default=1500, dest="system_tokens")
    bf.add_argument("--min-turns", type=positive_int, default=4, dest="min_turns")
    bf.add_argument("--max-turns", type=positive_int, default=6, dest="max_turns")
    bf.add_argument("--max-tokens", type=positive_int, default=16, dest="max_tokens")
    bf.add_argument("--seed", type=int, default=0, help="repeat i uses seed S + i, live and simulated alike")
    bf.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                    help="run every policy N times live (interleaved) and in simulate; report medians, min-max "
                         "and pooled TTFT p99 (default 3)")
    bf.add_argument("--host-background", choices=("measured", "off"), default="measured", dest="host_background",
                    help="with --replay: simulate the engines' shared machine with the background load each live "
                    "run measured (bench/fidelity_cpu.py; older runs: the gateway's and client's CPU) or without")
    bf.add_argument("--engine-noise", choices=("profile", "off"), default="profile", dest="engine_noise",
                    help="simulate with the profile's measured engine noise (timing spread, API-server delay: "
                         "sim/noise.py) or without (default profile; a profile that measured none has none)")
    bf.add_argument("--speed", choices=("probe", "off"), default="off",
                    help="probe: where the bench calibrates the engines itself, probe their speed before and after "
                         "every live run, and simulate each run with the profile's time terms scaled by the probes "
                         "over the profile's own prediction of the probe (calibrate/speed_probe.py); with --replay, "
                         "the probes the stored run took, against --profile's prediction. Default off (as "
                         "calibrated): on two vLLM CPU engines the probe's own spread (a 1,024-token prefill "
                         "166-289 ms between runs) was larger than the drift it was to correct, 6 of 20 ratios "
                         "within 20 %% with them against 14 without (issues 21k, 21o)")
    bf.add_argument("--json", metavar="FILE")
    bf.set_defaults(func=cmd_bench_fidelity)
