"""Terminal output shared by the CLI commands and the demo: consoles, tables, JSON files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Tables are wide: when output is not a terminal (CI logs, pipes), do not squeeze them to 80.
_width = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", 160))
console = Console(stderr=False, width=_width)
err = Console(stderr=True, width=None if sys.stderr.isatty() else int(os.environ.get("COLUMNS", 160)))


def write_json(path: str | None, data: dict) -> None:
    """Write ``data`` as indented, key-sorted JSON to ``path`` (nothing when no path is given)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        console.print(f"wrote {path}")


def routing_table(result: dict) -> Table:
    """The `kvroute bench routing` result as a table: decision cost percentiles per preset."""
    table = Table(title=f"decision cost, {result['endpoints']} endpoints, "
                        f"{result['index_blocks']:,} indexed blocks (µs)")
    for col in ("preset", "p50 8K", "p99 8K", "p50 32K", "p99 32K"):
        table.add_column(col, justify="right" if col != "preset" else "left")
    for name, r in result["presets"].items():
        table.add_row(name, f"{r['p50_us_8k']:.1f}", f"{r['p99_us_8k']:.1f}",
                      f"{r['p50_us_32k']:.1f}", f"{r['p99_us_32k']:.1f}")
    return table


def _failures(failed: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in failed.items()) if failed else "0"


def sim_table(report: dict) -> Table:
    """One row per policy; every header carries its unit."""
    slo = report.get("slo") or {}
    title = f"{report['scenario']}: {report['replicas']} replicas, workload {report['workload']}"
    if slo:
        title += f"; goodput = requests/s with TTFT ≤ {slo['ttft_s']:g} s and TPOT ≤ {slo['tpot_s'] * 1000:g} ms"
    table = Table(title=title)
    cols = ("policy", "done (req)", "failed (req)", "offered→served (req/s)", "stable",
            "goodput (req/s, % met)", "TTFT mean (s)", "TTFT p50 / p99 (s)", "TPOT p50 (ms)",
            "E2E p50 / p99 (s)", "out (tok/s)", "prefix hit (%)", "imbal. CV", "LB queue p99 (s)",
            "fwd (req)")
    for col in cols:
        table.add_column(col, justify="left" if col in ("policy", "failed (req)") else "right")
    for label, r in report["results"].items():
        load = r.get("load") or {}
        stable = "" if not load else ("yes" if load["stable"] else "[bold red]NO[/bold red]")
        rate = f"{load['offered_rps']:.2f}→{load['served_rps']:.2f}" if load else ""
        sl = r.get("slo") or {}
        goodput = f"{sl['goodput_rps']:.2f} ({sl['attainment']:.0%})" if sl else ""
        table.add_row(label, f"{r['requests']}", _failures(r["failed"]), rate, stable, goodput,
                      f"{r['ttft_s']['mean']:.3f}", f"{r['ttft_s']['p50']:.3f} / {r['ttft_s']['p99']:.3f}",
                      f"{r['tpot_s']['p50'] * 1000:.1f}", f"{r['e2e_s']['p50']:.2f} / {r['e2e_s']['p99']:.2f}",
                      f"{r['output_tps']:.0f}", f"{r['prefix_hit_rate'] * 100:.1f}",
                      f"{r['imbalance_cv']:.2f}", f"{r['lb_queue_s']['p99']:.2f}",
                      str(r["cross_region_forwards"]))
    return table


def breakdown_table(report: dict) -> Table | None:
    """Per client region and per path (local / remote / forwarded), when there is more than one."""
    rows = []
    for label, r in report["results"].items():
        regions = r.get("by_client_region") or {}
        paths = r.get("by_path") or {}
        if len(regions) < 2 and set(paths) <= {"local"}:
            continue
        rows += [(label, f"client {k}", v) for k, v in regions.items()]
        rows += [(label, f"path {k}", v) for k, v in paths.items()]
    if not rows:
        return None
    table = Table(title="by client region and by path (local: served in the client's region; remote: "
                        "another region, by the client's LB; forwarded: via a peer LB)")
    for col in ("policy", "group", "requests", "TTFT mean (s)", "TTFT p50 / p99 (s)", "E2E p50 (s)",
                "prefix hit (%)"):
        table.add_column(col, justify="left" if col in ("policy", "group") else "right")
    for label, group, v in rows:
        table.add_row(label, group, str(v["requests"]), f"{v['ttft_s']['mean']:.3f}",
                      f"{v['ttft_s']['p50']:.3f} / {v['ttft_s']['p99']:.3f}", f"{v['e2e_s']['p50']:.2f}",
                      f"{v['prefix_hit_rate'] * 100:.1f}")
    return table


def warn(line: str) -> None:
    """A warning line on stderr, plain enough to grep (never wrapped, never read as markup)."""
    err.print(f"[bold yellow]warning:[/bold yellow] {escape(line)}", highlight=False, soft_wrap=True)


def error(line: str, code: int = 2) -> int:
    """An error line on stderr (one line per problem, never wrapped); returns the exit code
    (2: bad input)."""
    err.print(f"[red]error:[/red] {escape(line)}", highlight=False, soft_wrap=True)
    return code


def sweep_tables(sc, result: dict) -> list[Table]:
    """Both knees per policy, and the comparison at 50/70/90 % of the reference knee."""
    slo = result["slo"]
    knees = Table(title=f"capacity knees — SLO: highest load with ≥ {slo['target']:.0%} of requests within "
                        f"TTFT ≤ {slo['ttft_s']:g} s and TPOT ≤ {slo['tpot_s'] * 1000:g} ms; stability: highest "
                        "load served ≥ 90 % of offered with the backlog not growing")
    for col in ("policy", "SLO knee (× scenario load)", "offered at SLO knee (req/s)",
                "stability knee (× scenario load)", "offered at stability knee (req/s)", "runs", "note"):
        knees.add_column(col, justify="left" if col in ("policy", "note") else "right")

    def cells(k: dict) -> tuple[str, str]:
        return ("none" if k["factor"] is None else f"{k['factor']:.3g}",
                "–" if k["offered_rps"] is None else f"{k['offered_rps']:.3g}")

    for label, k in result["knees"].items():
        notes = [k[key]["note"] for key in ("slo", "stability") if k[key]["note"]]
        knees.add_row(label, *cells(k["slo"]), *cells(k["stability"]), str(len(k["points"])), "\n".join(notes))
    tables = [knees]
    ref = result.get("reference")
    if ref:
        basis = ("the highest SLO knee" if ref["basis"] == "slo"
                 else "the highest stability knee (no policy has an SLO knee)")
        cmp = Table(title=f"policies at 50/70/90 % of {basis} ({ref['policy']}, {ref['offered_rps']:.3g} req/s)")
        for col in ("load", "policy", "offered→served (req/s)", "stable", "goodput (req/s)", "within SLO (%)",
                    "within TTFT SLO (%)", "TTFT p50 / p99 (s)", "TPOT p50 (ms)", "prefix hit (%)", "failed (req)"):
            cmp.add_column(col, justify="left" if col in ("load", "policy") else "right")
        for level, rows in result["compare"].items():
            for label, r in rows.items():
                cmp.add_row(level, label, f"{r['offered_rps']:.3g}→{r['served_rps']:.3g}",
                            "yes" if r["stable"] else "[bold red]NO[/bold red]", f"{r['goodput_rps']:.3g}",
                            f"{r['attainment'] * 100:.1f}", f"{r['ttft_attainment'] * 100:.1f}",
                            f"{r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f}",
                            f"{r['tpot_p50_s'] * 1000:.1f}", f"{r['prefix_hit_rate'] * 100:.1f}", str(r["failed"]))
        tables.append(cmp)
    return tables
