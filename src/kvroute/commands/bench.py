"""`kvroute bench`: routing, simulator speed, gateway, hostile clients, P/D, fidelity, fleet."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from kvroute.argtypes import non_negative_int, positive_int
from kvroute.report import console, err, error, routing_table, write_json


def cmd_bench_routing(args: argparse.Namespace) -> int:
    """`kvroute bench routing`: decision cost per preset at 8K and 32K-token prompts, and the prefix index's
    memory."""
    from kvroute.bench import routing
    from kvroute.policy import PRESETS

    # No live progress bar: its refresh thread wakes every few ms and lands in the timed
    # decisions (issue 7 measured p99 ~4,100 µs with it, 46–580 µs without). One line per
    # preset, printed between timed loops, is all the process does besides measuring.
    done = iter(range(1, len(PRESETS) + 1))
    result = routing.run(decisions=args.decisions, seed=args.seed,
                         progress=lambda name: err.print(f"[dim]{next(done)}/{len(PRESETS)} {name}[/dim]"))
    console.print(routing_table(result))
    console.print(f"index memory: {result['index_bytes_per_block']:.1f} bytes/block   "
                  f"220 KB chat keyed+hashed+routed: {result['chat_220kb_ms']:.2f} ms (median)")
    write_json(args.json, result)
    return 0


def cmd_bench_kv_events(args: argparse.Namespace) -> int:
    """`kvroute bench kv-events`: routing on engine KV events vs the approximate index; consumer cost."""
    from kvroute.bench import kv_events

    return kv_events.command(args)


def cmd_bench_sim_speed(args: argparse.Namespace) -> int:
    """`kvroute bench sim-speed`: simulated requests per wall second on the Mooncake conversation trace, and
    optionally a million-request run's time and peak RSS."""
    from pathlib import Path

    from kvroute.bench import sim_speed
    from kvroute.sim import tracefiles

    if not Path(tracefiles.resolve_trace(sim_speed.TRACE, "mooncake")).is_file():
        trace = tracefiles.DATA_DIR / sim_speed.TRACE
        return error(f"bench sim-speed replays the Mooncake conversation trace, not found at {trace}: traces "
                     "are looked up under $KVROUTE_TRACES (default: shared/data/traces beside a source checkout); "
                     f"set KVROUTE_TRACES to the folder that holds {sim_speed.TRACE}")
    from kvroute.policy import PRESETS

    presets = tuple(p.strip() for p in args.presets.split(",")) if args.presets else sim_speed.PRESETS
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        return error(f"--presets: unknown preset {unknown[0]!r}; presets: {', '.join(sorted(PRESETS))}")
    result = sim_speed.run(progress=lambda msg: err.print(msg), with_million=not args.skip_million,
                           million_requests=args.million_requests, repeats=args.repeats, presets=presets)
    builds = result["builds"]
    table = Table(title=f"simulator speed: Mooncake conversation trace, 16 replicas, ~70% load; simulated requests "
                        f"per wall second, median of {result['repeats']} (min-max)")
    table.add_column("preset")
    for b in builds:
        table.add_column(b, justify="right")
    if "speedup" in result:
        table.add_column("compiled ÷ pure", justify="right")
    for name in next(iter(builds.values()))["per_preset"]:
        cells = []
        for b in builds:
            r = builds[b]["per_preset"][name]
            cells.append(f"{r['sim_requests_per_s']:,} ({r['min']:,}-{r['max']:,})")
        if "speedup" in result:
            c, p = (builds[b]["per_preset"][name]["sim_requests_per_s"] for b in ("compiled", "pure"))
            cells.append(f"{c / max(1, p):.2f}×")
        table.add_row(name, *cells)
    console.print(table)
    for b, v in builds.items():
        console.print(f"{b}: median over presets {v['sim_requests_per_s']:,} simulated requests per wall second "
                      f"({next(iter(v['per_preset'].values()))['build']})")
    if "speedup" in result:
        sp = result["speedup"]
        console.print(f"compiled ÷ pure: {sp['of_medians']:.2f}× of the medians; paired per repeat median "
                      f"{sp['median']:.2f}× ({sp['min']:.2f}-{sp['max']:.2f}×); results "
                      f"{'identical' if result['identical'] else 'DIFFERENT'} across builds")
    else:
        console.print("compiled build not installed: `make compiled` (README, Compiled build) measures both")
    if "million" in result:
        m = result["million"]
        console.print(f"{m['requests']:,}-request synthetic run ({m['build']} build): {m['wall_s']:.1f} s wall, "
                      f"peak RSS {m['peak_rss_mb']:,.0f} MB ({m['start_rss_mb']:,.0f} MB before it started, "
                      f"{m['bytes_per_request']:,} bytes per simulated request; "
                      f"{'under' if m['under_1gb'] else 'OVER'} 1 GB), {m['sim_requests_per_s']:,}/s")
    write_json(args.json, result)
    return 0 if result["identical"] else 1  # the builds disagreeing is a bug


def cmd_bench_hostile(args: argparse.Namespace) -> int:
    """`kvroute bench hostile`: what each cheap attack costs the gateway (memory, CPU, /health
    latency for new clients), beside uvicorn and aiohttp; ``--check`` exits 1 when the gateway
    misses a bound."""
    from kvroute.bench import hostile

    attacks = tuple(a for a in args.attacks.split(",") if a)
    unknown = [a for a in attacks if a not in hostile.ATTACKS]
    if unknown:
        err.print(f"--attacks: unknown {', '.join(unknown)}; allowed: {', '.join(hostile.ATTACKS)}", markup=False)
        return 2
    result = hostile.run(attacks=attacks, baseline_src=args.baseline_src, with_references=not args.no_references,
                         progress=lambda m: err.print(m, markup=False))
    lim = hostile.LIMITS
    table = Table(title=f"each attack from {hostile.ATTACKER}, /health probed from 127.0.0.1 on a new connection "
                        f"every 20 ms; bounds: RSS +{lim['rss_mb']:.0f} MB, CPU {lim['cpu_s']:g} s, "
                        f"probe p99 {lim['probe_p99_ms']:.0f} ms, no failed probe")
    for col in ("attack", "server", "RSS +MB peak / after", "CPU s", "probe p99 ms", "probes failed",
                "within", "attacker saw"):
        table.add_column(col, justify="left" if col in ("attack", "server", "within", "attacker saw") else "right")
    missed = []
    for attack in attacks:
        for server, rows in result["servers"].items():
            r = rows[attack]
            ok = all(r["within"].values())
            if server == "gateway" and not ok:
                missed.append(attack)
            mark = "yes" if ok else "no: " + ", ".join(k for k, v in r["within"].items() if not v)
            p99 = r["probe"]["p99_ms"]
            table.add_row(attack, server, f"{r['rss_peak_growth_mb']:+.0f} / {r['rss_after_growth_mb']:+.0f}",
                          f"{r['cpu_s']:.2f}", "-" if p99 is None else f"{p99:.1f}",
                          f"{r['probe']['failed']}/{r['probe']['probes']}", mark, json.dumps(r["attack"]))
    console.print(table)
    write_json(args.json, result)
    if missed:
        err.print(f"the gateway missed a bound on: {', '.join(missed)}", markup=False)
    return 1 if args.check and missed else 0


def cmd_bench_pd(args: argparse.Namespace) -> int:
    """`kvroute bench pd`: aggregated vs disaggregated vs conditional serving on a chat and a long-prompt
    workload at several rates, in the simulator (goodput at the SLO, TPOT p99, transfer share of TTFT)."""
    from pathlib import Path

    from kvroute.bench import pd
    from kvroute.perf.loader import ProfileError, load_profile

    try:
        load_profile(args.profile)
    except ProfileError as exc:
        return error(str(exc))
    if not 0 < args.scale <= 1:
        return error(f"--scale must be in (0, 1], got {args.scale:g}")
    result = pd.run_bench(args.profile, args.seed, args.threshold, args.scale,
                          progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    table = pd.markdown(result)
    console.print(table, markup=False, highlight=False)
    write_json(args.json, result)
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `bench` and its subcommands."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    br = bench.add_parser("routing", help="decision cost per preset, index memory")
    br.add_argument("--json", metavar="FILE")
    br.add_argument("--decisions", type=positive_int, default=2000, help="decisions per prompt size")
    br.add_argument("--seed", type=int, default=0)
    br.set_defaults(func=cmd_bench_routing)
    bk = bench.add_parser("kv-events", help="routing on engine KV events vs the approximate index; consumer cost")
    bk.add_argument("--presets", default="sglang_cache_aware,skywalker,lmetric",
                    help="cache-aware presets to compare, comma-separated")
    bk.add_argument("--publishers", type=positive_int, default=64,
                    help="engines publishing at once for the ingest part")
    bk.add_argument("--seed", type=int, default=0)
    bk.add_argument("--skip-routing", action="store_true", dest="skip_routing")
    bk.add_argument("--skip-ingest", action="store_true", dest="skip_ingest")
    bk.add_argument("--json", metavar="FILE")
    bk.set_defaults(func=cmd_bench_kv_events)
    bs = bench.add_parser("sim-speed", help="simulated requests per wall second; 1M-request run")
    bs.add_argument("--json", metavar="FILE")
    bs.add_argument("--skip-million", action="store_true", dest="skip_million")
    bs.add_argument("--million-requests", type=positive_int, default=1_000_000, dest="million_requests")
    bs.add_argument("--repeats", type=positive_int, default=3, help="runs per preset and build (interleaved)")
    bs.add_argument("--presets", default="", help="comma-separated presets (default: "
                    "round_robin,sglang_cache_aware,skywalker,lmetric)")
    bs.set_defaults(func=cmd_bench_sim_speed)
    from kvroute.bench.plan import add_parser as add_bench_plan

    add_bench_plan(bench)

    from kvroute.bench.auto import add_parser as add_bench_auto

    add_bench_auto(bench)
    from kvroute.commands.bench_gateway import add_parser as add_bench_gateway

    add_bench_gateway(bench)
    bh = bench.add_parser("hostile", help="what hostile clients cost the gateway, beside uvicorn and aiohttp")
    bh.add_argument("--json", metavar="FILE")
    from kvroute.bench.hostile import ATTACKS  # no I/O: a table of names and coroutines

    bh.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated; default: all of " +
                    ", ".join(ATTACKS))
    bh.add_argument("--baseline-src", metavar="DIR", help="also attack a gateway imported from this source tree")
    bh.add_argument("--no-references", action="store_true", help="skip uvicorn and aiohttp")
    bh.add_argument("--check", action="store_true", help="exit 1 when the gateway misses one of the bounds")
    bh.set_defaults(func=cmd_bench_hostile)
    bp = bench.add_parser("pd", help="aggregated vs disaggregated vs conditional prefill/decode, simulated")
    bp.add_argument("--profile", default="h100-llama3.2-3b", help="hardware profile of the four engines")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--threshold", type=non_negative_int, default=512,
                    help="conditional: split when the decode engine would compute at least this many uncached "
                         "tokens (llm-d's nonCachedTokens)")
    bp.add_argument("--scale", type=float, default=1.0, help="share of each run's requests (quick runs: 0.2)")
    bp.add_argument("--json")
    bp.add_argument("--md", help="also write the table to this Markdown file")
    bp.set_defaults(func=cmd_bench_pd)
    from kvroute.commands import fidelity

    fidelity.add_parser(bench)
    from kvroute.commands import bench_fleet  # several instances per region (kvroute/fleet)

    bench_fleet.register(bench)
