"""`kvroute bench gateway`: the gateway against going direct (per preset), its regression gate
(``--gate``: CPU per request against a baseline build), and ``--peers``: kvroute beside
sglang-router, vllm-router, HAProxy and nginx in one paired, interleaved run (docs/hot-path.md)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from rich.table import Table

from kvroute.argtypes import non_negative_float, positive_int
from kvroute.report import console, err, write_json


def add_parser(bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``bench gateway`` under ``bench``."""
    bg = bench.add_parser("gateway", help="gateway vs direct throughput, added latency and CPU; --gate; --peers")
    bg.add_argument("--json", metavar="FILE")
    bg.add_argument("--requests", type=positive_int, default=20000)
    bg.add_argument("--concurrency", type=positive_int, default=32)
    bg.add_argument("--repeats", type=positive_int, default=3)
    bg.add_argument("--presets", default=None,
                    help="presets to measure (default: round_robin,sglang_cache_aware,skywalker,lmetric; with "
                         "--peers: round_robin)")
    bg.add_argument("--upstream-delay-ms", type=non_negative_float, default=0.0,
                    help="upstream wait before answering (an engine's TTFT); default 0")
    bg.add_argument("--upstream-spread-ms", type=non_negative_float, default=0.0,
                    help="add a seeded uniform draw of up to this many ms to each upstream wait (also with --peers), "
                         "so that requests sent together are not answered together every time; default 0")
    bg.add_argument("--baseline-src", metavar="DIR",
                    help="also measure a gateway imported from this source tree (e.g. a git worktree's src/ of "
                         "an older commit), interleaved in the same run")
    bg.add_argument("--baseline-ref", metavar="REV",
                    help="like --baseline-src, with the src/ of this git revision of the current repository")
    bg.add_argument("--compiled", nargs="?", const="build/compiled", default=None, metavar="DIR",
                    help="also measure kvroute's compiled build (`make compiled` installs it into build/compiled, "
                         "the default DIR) in the same paired run; the plain kvroute row is this install's build "
                         "(pure Python in a development checkout), and the output says which build each row ran")
    bg.add_argument("--gateway-src", metavar="DIR",
                    help="import the measured gateway from this tree instead of this install (e.g. build/compiled, "
                         "so that --gate compares two compiled builds)")
    bg.add_argument("--gate", type=non_negative_float, metavar="TOLERANCE",
                    help="regression gate: exit 1 when the gateway's CPU per request (non-stream or stream, any "
                         "preset) exceeds the baseline's by more than TOLERANCE (0.10 = 10 %%); the baseline is "
                         "--baseline-src/--baseline-ref measured in the same run, or --baseline-json")
    bg.add_argument("--baseline-json", metavar="FILE",
                    help="a stored --json result of this benchmark, taken on the same machine, as the gate's baseline")
    bg.add_argument("--peers", nargs="?", const="sglang-router,vllm-router,haproxy,nginx", default=None,
                    help="measure kvroute beside these routers (default all four), one alive at a time; "
                         "missing ones are skipped with how to install them (make peers)")
    bg.add_argument("--delays", default="0,20", help="with --peers: upstream delays in ms (default 0,20)")
    bg.add_argument("--access-log", choices=("off", "on", "both"), default="off",
                    help="with --peers: kvroute's access_log (default off, like the peers, which log no line per "
                         "request; on: the request-id header and level check paid, lines suppressed at WARNING)")
    bg.add_argument("--busy-share", type=float, default=None,
                    help="with --peers: other jobs' share of the machine above which a run is refused (default 0.15)")
    bg.set_defaults(func=cmd_bench_gateway)


def cmd_bench_gateway(args: argparse.Namespace) -> int:
    """Run the benchmark the arguments ask for; 1 when the gate fails, 3 when --peers refuses a busy run."""
    if args.gate is not None and not (args.baseline_src or args.baseline_ref or args.baseline_json):
        err.print("--gate needs a baseline: --baseline-src DIR, --baseline-ref REV or --baseline-json FILE",
                  markup=False)
        return 2
    stored = None
    if args.baseline_json:
        try:
            stored = json.loads(Path(args.baseline_json).read_text())
        except (OSError, ValueError) as exc:
            err.print(f"--baseline-json {args.baseline_json}: {exc}", markup=False)
            return 2
    if args.compiled is not None and not (Path(args.compiled) / "kvroute" / "buildinfo.py").is_file():
        err.print(f"--compiled {args.compiled}: no kvroute install there; build it with `make compiled`",
                  markup=False)
        return 2
    if args.gateway_src is not None and (args.peers is not None or not (Path(args.gateway_src) / "kvroute").is_dir()):
        err.print(f"--gateway-src {args.gateway_src}: " + ("not with --peers (use --compiled / --baseline-src)"
                  if args.peers is not None else "no kvroute package there"), markup=False)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        src = args.baseline_src
        if args.baseline_ref:
            from kvroute.bench.gateway import export_ref

            src = export_ref(args.baseline_ref, tmp)
        if args.peers is not None:
            return _peers(args, src)
        return _paired(args, src, stored)


def _spread(args: argparse.Namespace) -> str:
    """`` + up to S ms`` in a table's title when the upstream's waits are spread."""
    return f" + up to {args.upstream_spread_ms:g} ms" if args.upstream_spread_ms else ""


def _paired(args: argparse.Namespace, src: str | None, stored: dict | None) -> int:
    from kvroute.bench import gateway

    presets = tuple((args.presets or ",".join(gateway.PRESETS)).split(","))
    result = gateway.run(requests=args.requests, concurrency=args.concurrency, repeats=args.repeats,
                         presets=presets, upstream_delay_ms=args.upstream_delay_ms,
                         baseline_src=src, compiled_src=args.compiled, progress=lambda m: err.print(m),
                         gateway_src=args.gateway_src, upstream_spread_ms=args.upstream_spread_ms)
    builds = result["builds"]
    variants = [(f"gateway ({builds['gateway']})", result)]
    if args.compiled:
        variants.append((f"compiled {args.compiled} ({builds['compiled']})", result["compiled"]))
    if src:
        variants.append((f"baseline {src}", result["baseline"]))
    for label, rows in variants:
        for mode in ("nonstream", "stream"):
            table = Table(title=f"{label} vs direct, {mode} ({args.requests} requests × {args.repeats}, "
                                f"concurrency {args.concurrency}, upstream delay {args.upstream_delay_ms:g} ms"
                                f"{_spread(args)}, "
                                f"medians)")
            for col in ("preset", "via req/s", "direct req/s", "ratio (spread)", "gateway CPU µs/req (spread)",
                        "added p50 (spread)", "added p99 (spread)"):
                table.add_column(col, justify="left" if col == "preset" else "right")
            for name, r in rows[mode].items():
                lo, hi = r["rps_ratio_spread"]
                clo, chi = r["gateway_cpu_us_per_req_spread"]
                table.add_row(name, f"{r['gateway_rps']:,.0f}", f"{r['direct_rps']:,.0f}",
                              f"{r['rps_ratio']:.2f}x ({lo:.2f}–{hi:.2f})",
                              f"{r['gateway_cpu_us_per_req']:.0f} ({clo:.0f}–{chi:.0f})",
                              gateway.added_text(r, "p50"), gateway.added_text(r, "p99"))
            console.print(table)
    code = 0
    if args.gate is not None:
        baseline = result["baseline"] if src else stored or {}
        lines, failed = gateway.gate(result, baseline, args.gate, paired=bool(src))
        result["gate"] = {"tolerance": args.gate, "lines": lines, "failed": failed}
        for line in lines:
            console.print(f"gate: {line}", markup=False)
        if not lines:
            err.print("gate: the baseline has no preset and mode in common with this run", markup=False)
            code = 2
        elif failed:
            err.print(f"gate FAILED: the hot path got slower than the baseline beyond {args.gate:.0%} on "
                      f"{len(failed)} of {len(lines)}: " + "; ".join(failed), markup=False)
            code = 1
        else:
            console.print(f"gate passed: every CPU per request within +{args.gate:.0%} of the baseline")
    write_json(args.json, result)
    return code


def _peers(args: argparse.Namespace, src: str | None) -> int:
    from kvroute.bench import gateway_peers, peers

    try:
        delays = tuple(float(d) for d in args.delays.split(","))
    except ValueError:
        err.print(f"--delays: expected comma-separated milliseconds, got {args.delays!r}", markup=False)
        return 2
    names = tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in names if p not in peers.PEERS]
    if unknown:
        err.print(f"--peers: unknown {', '.join(unknown)}; allowed: {', '.join(peers.PEERS)}", markup=False)
        return 2
    result = gateway_peers.run(requests=args.requests, concurrency=args.concurrency, repeats=args.repeats,
                               presets=tuple((args.presets or "round_robin").split(",")), delays=delays,
                               peers=names, baseline_src=src,
                               busy_share=peers.BUSY_SHARE if args.busy_share is None else args.busy_share,
                               progress=lambda m: err.print(m, markup=False), compiled_src=args.compiled,
                               access_logs={"off": (False,), "on": (True,), "both": (False, True)}[args.access_log],
                               upstream_spread_ms=args.upstream_spread_ms)
    write_json(args.json, result)
    if result["refused"]:
        err.print("refused: other jobs kept the machine busy during the run, so these numbers are not reported "
                  "(run it on a quiet machine): " + "; ".join(result["disturbed"][:6]), markup=False)
        return 3
    for delay, rows in result["delays"].items():
        for mode, by_name in rows.items():
            table = Table(title=f"routers vs direct, {mode}, upstream delay {delay} ms{_spread(args)} "
                                f"({args.requests} requests × {args.repeats}, concurrency {args.concurrency}, medians, "
                                f"one router alive at a time)")
            for col in ("router", "CPU s per 1,000 req (spread)", "req/s", "ratio vs direct (spread)",
                        "added p50 ms (spread)", "added p99 ms", "errors"):
                table.add_column(col, justify="left" if col == "router" else "right")
            for name, r in by_name.items():
                clo, chi = r["gateway_cpu_us_per_req_spread"]
                lo, hi = r["rps_ratio_spread"]
                plo, phi = r["added_p50_ms_spread"]
                table.add_row(name, f"{r['cpu_s_per_1000']:.3f} ({clo / 1000:.3f}–{chi / 1000:.3f})",
                              f"{r['gateway_rps']:,.0f}", f"{r['rps_ratio']:.2f}x ({lo:.2f}–{hi:.2f})",
                              f"{r['added_p50_ms']:.2f} ({plo:.2f}–{phi:.2f})", f"{r['added_p99_ms']:.2f}",
                              str(r["errors"]))
            console.print(table)
    for name, build in result["builds"].items():
        console.print(f"build of {name}: {build}", markup=False)
    for line in result["skipped"] + result["verdict"]:
        console.print(line, markup=False)
    return 0
