"""Terminal output shared by the CLI commands and the demo: consoles, tables, JSON files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

# Tables are wide: when output is not a terminal (CI logs, pipes), do not squeeze them to 80.
_width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 160))
console = Console(stderr=False, width=_width)
err = Console(stderr=True)


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        console.print(f"wrote {path}")


def routing_table(result: dict) -> Table:
    table = Table(title=f"decision cost, {result['endpoints']} endpoints, "
                        f"{result['index_blocks']:,} indexed blocks (µs)")
    for col in ("preset", "p50 8K", "p99 8K", "p50 32K", "p99 32K"):
        table.add_column(col, justify="right" if col != "preset" else "left")
    for name, r in result["presets"].items():
        table.add_row(name, f"{r['p50_us_8k']:.1f}", f"{r['p99_us_8k']:.1f}",
                      f"{r['p50_us_32k']:.1f}", f"{r['p99_us_32k']:.1f}")
    return table


def sim_table(report: dict) -> Table:
    table = Table(title=f"{report['scenario']}: {report['replicas']} replicas, workload {report['workload']}")
    cols = ("policy", "done", "TTFT mean", "TTFT p50", "TTFT p99", "TPOT p50", "E2E p50", "E2E p99",
            "req/s", "out tok/s", "prefix hit", "imbal. CV", "LB queue p99", "fwd")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for label, r in report["results"].items():
        failed = sum(r["failed"].values())
        table.add_row(label, f"{r['requests']}" + (f" ({failed} failed)" if failed else ""),
                      f"{r['ttft_s']['mean']:.3f}", f"{r['ttft_s']['p50']:.3f}", f"{r['ttft_s']['p99']:.3f}",
                      f"{r['tpot_s']['p50'] * 1000:.1f}ms", f"{r['e2e_s']['p50']:.2f}", f"{r['e2e_s']['p99']:.2f}",
                      f"{r['throughput_rps']:.2f}", f"{r['output_tps']:.0f}", f"{r['prefix_hit_rate']:.1%}",
                      f"{r['imbalance_cv']:.2f}", f"{r['lb_queue_s']['p99']:.2f}",
                      str(r["cross_region_forwards"]))
    return table


def run_simulation(sc, json_path: str | None = None, plots: str | None = None) -> dict:
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvroute.sim.runner import report, run_scenario

    total = sc.limits.max_requests
    tasks: dict[str, int] = {}
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=False) as progress:
        def on_start(label: str) -> None:
            tasks[label] = progress.add_task(label, total=total)

        def on_progress(label: str, n: int) -> None:
            progress.update(tasks[label], completed=n)

        runs = run_scenario(sc, on_start, on_progress)
    rep = report(sc, runs)
    console.print(sim_table(rep))
    wall = time.perf_counter() - t0
    done = sum(r.result["requests"] for r in runs)
    console.print(f"[dim]{done:,} simulated requests in {wall:.1f} s wall ({done / wall:,.0f}/s)[/dim]")
    write_json(json_path, rep)
    if plots:
        from kvroute.metrics.plots import write_plots

        for p in write_plots(runs, plots, sc.name):
            console.print(f"wrote {p}")
    return rep
