"""`kvroute reproduce`: a paper's claims beside kvroute's simulated numbers."""

from __future__ import annotations

import argparse

from rich.table import Table

from kvroute.argtypes import odd_positive_int
from kvroute.parallel import add_arguments as add_parallel
from kvroute.report import console, err, error, write_json

DEFAULT_SEEDS = 3  # full runs: the median of three seeds' verdicts (issue 21u: one seed flipped two rows)


def cmd_reproduce(args: argparse.Namespace) -> int:
    """`kvroute reproduce PAPER`: the paper's claims next to what kvroute measures, with whether each agrees
    and why not."""
    from pathlib import Path

    from kvroute.parallel import ExecutorError, make_executor
    from kvroute.reproduce import markdown, reproduce
    from kvroute.reproduce.seeds import agrees_cell, kvroute_cell, seed_span
    from kvroute.sim.scenario import ScenarioError

    seeds = args.seeds or (1 if args.quick else DEFAULT_SEEDS)
    try:
        with make_executor(args.workers, args.ray) as executor:
            result = reproduce(args.paper, quick=args.quick, executor=executor, seeds=seeds,
                               progress=lambda m: err.print(f"[dim]{m}[/dim]", highlight=False))
    except (ScenarioError, ExecutorError) as exc:
        return error(str(exc))
    judged = "" if seeds == 1 else f", {seed_span(list(range(1, seeds + 1)))}: median verdict"
    table = Table(title=f"{result['title']}: paper vs kvroute" + (" (--quick)" if args.quick else "") + judged)
    for col in ("claim", "paper", "kvroute", "agrees?", "why not"):
        table.add_column(col, overflow="fold")
    colour = {"yes": "green", "direction only": "yellow", "no": "red"}
    for r in result["rows"]:
        c = colour.get(r["agrees"])
        cell = agrees_cell(r)
        table.add_row(r["claim"], r["paper"], kvroute_cell(r), f"[{c}]{cell}[/{c}]" if c else cell, r["why_not"])
    console.print(table)
    console.print(f"[dim]{result['wall_s']} s wall[/dim]")
    write_json(args.json, result)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(markdown(result))
        console.print(f"wrote {args.md}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    rp = sub.add_parser("reproduce", help="a paper's claims beside kvroute's simulated numbers")
    rp.add_argument("paper", choices=["skywalker", "gorgo-v1", "gorgo-v2", "lmetric", "cascadeinfer"])
    rp.add_argument("--quick", action="store_true", help="fewer requests per run (≤ 3 minutes per paper)")
    rp.add_argument("--seeds", type=odd_positive_int, metavar="N",
                    help=f"run every scenario at seeds 1..N (odd) and judge each row by the median of its per-seed "
                         f"verdicts (default: {DEFAULT_SEEDS}; 1 with --quick)")
    rp.add_argument("--json", metavar="FILE")
    rp.add_argument("--md", metavar="FILE", help="write the table as Markdown")
    add_parallel(rp)
    rp.set_defaults(func=cmd_reproduce)
