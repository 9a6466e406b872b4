"""`kvroute` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console(stderr=False)
err = Console(stderr=True)


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        console.print(f"wrote {path}")


def cmd_policies(args: argparse.Namespace) -> int:
    from kvroute.policy import PRESETS

    if args.json:
        out = {name: {"description": cls.summary(), "source": cls.source,
                      "params": {k: f.default if not callable(f.default_factory) else f.default_factory()
                                 for k, f in cls.Params.model_fields.items()}}
               for name, cls in PRESETS.items()}
        print(json.dumps(out, indent=2, default=str))
        return 0
    table = Table(title="kvroute policy presets")
    table.add_column("preset", style="bold cyan")
    table.add_column("what it does")
    table.add_column("source", style="dim")
    for name, cls in PRESETS.items():
        table.add_row(name, cls.summary(), cls.source)
    console.print(table)
    return 0


def _routing_table(result: dict) -> Table:
    table = Table(title=f"decision cost, {result['endpoints']} endpoints, "
                        f"{result['index_blocks']:,} indexed blocks (µs)")
    for col in ("preset", "p50 8K", "p99 8K", "p50 32K", "p99 32K"):
        table.add_column(col, justify="right" if col != "preset" else "left")
    for name, r in result["presets"].items():
        table.add_row(name, f"{r['p50_us_8k']:.1f}", f"{r['p99_us_8k']:.1f}",
                      f"{r['p50_us_32k']:.1f}", f"{r['p99_us_32k']:.1f}")
    return table


def cmd_bench_routing(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from kvroute.bench import routing
    from kvroute.policy import PRESETS

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("routing benchmark", total=len(PRESETS))
        result = routing.run(decisions=args.decisions, seed=args.seed,
                             progress=lambda name: progress.advance(task))
    console.print(_routing_table(result))
    console.print(f"index memory: {result['index_bytes_per_block']:.1f} bytes/block   "
                  f"220 KB chat keyed+hashed+routed: {result['chat_220kb_ms']:.2f} ms (median)")
    _write_json(args.json, result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvroute import walkthrough
    from kvroute.bench import routing

    console.rule("[bold]kvroute demo: policy walk-through on sample requests")
    results = walkthrough.run()
    table = Table(title="2 users × 3 chat turns over a shared system prompt, plus one-shot bursts; 4 replicas")
    table.add_column("preset", style="bold cyan")
    table.add_column("alice's turns →")
    table.add_column("branches taken")
    table.add_column("prefix reuse", justify="right")
    table.add_column("requests per replica", justify="right")
    for r in results:
        alice = " ".join(t for rid, t, _ in r.routes if rid.startswith("alice"))
        branches = ", ".join(sorted({b for _, _, b in r.routes}))
        table.add_row(r.preset, alice, branches, f"{r.hit_tokens / max(1, r.prompt_tokens):.0%}",
                      " ".join(map(str, r.spread)))
    console.print(table)
    console.rule("[bold]routing benchmark (short run)")
    result = routing.run(decisions=args.decisions)
    console.print(_routing_table(result))
    console.print(f"index memory: {result['index_bytes_per_block']:.1f} bytes/block   "
                  f"220 KB chat keyed+hashed+routed: {result['chat_220kb_ms']:.2f} ms")
    _write_json(str(Path(args.out) / "bench-routing.json"), result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware load balancer for LLM inference")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("policies", help="list policy presets")
    sp.add_argument("--json", action="store_true", help="machine-readable output with default params")
    sp.set_defaults(func=cmd_policies)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    br = bench.add_parser("routing", help="decision cost per preset, index memory")
    br.add_argument("--json", metavar="FILE")
    br.add_argument("--decisions", type=int, default=2000, help="decisions per prompt size")
    br.add_argument("--seed", type=int, default=0)
    br.set_defaults(func=cmd_bench_routing)

    demo = sub.add_parser("demo", help="the main job: walk-through, benchmark, simulation, gateway")
    demo.add_argument("--out", default="out", help="folder for JSON results and plots")
    demo.add_argument("--decisions", type=int, default=500)
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
