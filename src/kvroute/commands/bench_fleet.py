"""``kvroute bench fleet``: its arguments and its table (the work is in ``bench/fleet.py``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def register(bench: argparse._SubParsersAction) -> None:
    """Add ``fleet`` to the ``kvroute bench`` subcommands."""
    from kvroute.bench.fleet import Workload

    d = Workload()
    p = bench.add_parser("fleet", help="1 vs 3 gateway instances behind HAProxy sharing load over NATS")
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas (default 4)")
    p.add_argument("--profile", default="h100-llama3.2-3b", help="the replicas' hardware profile")
    p.add_argument("--policy", default="skywalker", help="the gateways' preset (default skywalker)")
    p.add_argument("--sessions", type=int, default=d.sessions, help=f"chat sessions (default {d.sessions})")
    p.add_argument("--rate", type=float, default=d.rate, help=f"sessions starting per second (default {d.rate:g})")
    p.add_argument("--groups", type=int, default=d.groups, help=f"shared system prompts (default {d.groups})")
    p.add_argument("--system-words", type=int, default=d.system_words, dest="system_words",
                   help=f"words of each system prompt (default {d.system_words})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, dest="max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved (default 3)")
    p.add_argument("--faults", action="store_true", help="also kill an instance, and NATS, mid-run")
    p.add_argument("--no-kv-events", action="store_false", dest="kv_events",
                   help="the replicas publish no KV events: every instance routes on its approximate index")
    p.add_argument("--logs", metavar="DIR", help="keep every process's log and config here")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=cmd_bench_fleet)


def cmd_bench_fleet(args: argparse.Namespace) -> int:
    """Run the fleet benchmark and print its table, criteria and fault lines."""
    from kvroute.bench.fleet import Workload, criteria_line, fault_lines, run, table_rows
    from kvroute.fleet.services import ServiceError, find_binary

    err = Console(stderr=True)
    for name, value in (("--replicas", args.replicas), ("--sessions", args.sessions), ("--repeats", args.repeats),
                        ("--groups", args.groups), ("--system-words", args.system_words),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            err.print(f"kvroute: error: {name} must be at least 1, got {value}")
            return 2
    if args.rate <= 0:
        err.print(f"kvroute: error: --rate must be positive, got {args.rate:g}")
        return 2
    try:
        find_binary("nats-server"), find_binary("haproxy")
    except ServiceError as exc:
        err.print(f"kvroute: error: {exc}")
        return 2
    w = Workload(sessions=args.sessions, rate=args.rate, groups=args.groups, system_words=args.system_words,
                 max_tokens=args.max_tokens, seed=args.seed)
    folder = Path(args.logs) if args.logs else None
    from kvroute.policy import ConfigError, policy_from_config

    try:
        policy_from_config(args.policy)
    except ConfigError as exc:
        err.print(f"kvroute: error: --policy: {exc}")
        return 2
    result = run(w, replicas=args.replicas, profile=args.profile, policy=args.policy, repeats=args.repeats,
                 faults=args.faults, kv_events=args.kv_events,
                 folder=folder, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    index = "KV events" if args.kv_events else "approximate index"
    table = Table(title=f"fleet: {w.sessions} chat sessions at {w.rate:g}/s over {args.replicas} emulated "
                        f"replicas ({args.profile}), {args.policy}, {index}, through HAProxy; median of {args.repeats} "
                        "(min–max)")
    for col in ("configuration", "requests", "errors", "TTFT p50 ms", "TTFT p99 ms", "cached share %",
                "busiest replica / fair", "same index"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for row in table_rows(result):
        table.add_row(*row)
    out = Console(width=max(Console().width, 140))  # eight columns: do not fold them
    out.print(table)
    out.print(criteria_line(result))
    for line in fault_lines(result):
        out.print(line)
    out.print(f"[dim]logs and configs: {result['logs']}[/dim]")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0
