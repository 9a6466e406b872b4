"""Simulated vs live on one scenario: the numbers side by side, and which differ by more than 15 %."""

from __future__ import annotations

from typing import Any

from rich.table import Table

THRESHOLD = 0.15
METRICS = (  # (key, label, how to read it from a result row)
    ("ttft_p50_s", "TTFT p50 (s)", lambda r: r["ttft_s"]["p50"]),
    ("ttft_p99_s", "TTFT p99 (s)", lambda r: r["ttft_s"]["p99"]),
    # completions ÷ makespan: the longest answer (up to 2,048 tokens, minutes) decides the makespan,
    # and live stops waiting for stragglers after its drain time while the simulator never does
    ("throughput_rps", "throughput (req/s)", lambda r: r["throughput_rps"]),
    # completions within the arrival window ÷ its length: the same service rate without that tail
    ("served_rps", "served in arrival window (req/s)", lambda r: (r.get("load") or {}).get("served_rps", 0.0)),
    ("forwards", "forwards (req)", lambda r: r["cross_region_forwards"]),
    ("prefix_hit_rate", "prefix hit (%)", lambda r: r["prefix_hit_rate"] * 100),
)


def _diff(sim: float, live: float) -> float | None:
    """Relative difference of live from sim; None when both are zero (nothing to compare)."""
    if sim == 0:
        return None if live == 0 else float("inf")
    return (live - sim) / abs(sim)


def compare(sim_report: dict[str, Any], live_report: dict[str, Any]) -> dict[str, Any]:
    """Per policy and metric: sim, live, relative difference, and whether it exceeds 15 %."""
    out: dict[str, Any] = {}
    for label, live in live_report["results"].items():
        sim = sim_report["results"].get(label)
        if sim is None:
            continue
        rows = {}
        for key, _, read in METRICS:
            s, v = float(read(sim)), float(read(live))
            d = _diff(s, v)
            rows[key] = {"sim": round(s, 6), "live": round(v, 6),
                         "diff": None if d is None or d == float("inf") else round(d, 4),
                         "over_15pct": d is not None and abs(d) > THRESHOLD}
        rows["requests"] = {"sim": sim["requests"], "live": live["requests"]}
        out[label] = rows
    return out


def compare_table(cmp: dict[str, Any]) -> Table:
    """One row per policy; each cell ``sim → live (±x %)``, differences over 15 % in bold."""
    table = Table(title="simulated → live, same scenario and workload (bold: differs by more than 15 %)")
    table.add_column("policy")
    table.add_column("requests (sim → live)", justify="right")
    for _, label, _ in METRICS:
        table.add_column(label, justify="right")
    for policy, rows in cmp.items():
        cells = []
        for key, _, _ in METRICS:
            r = rows[key]
            d = "" if r["diff"] is None else f" ({r['diff'] * 100:+.0f} %)"
            if r["diff"] is None and r["over_15pct"]:
                d = " (from 0)"
            text = f"{r['sim']:.3g} → {r['live']:.3g}{d}"
            cells.append(f"[bold]{text}[/bold]" if r["over_15pct"] else text)
        table.add_row(policy, f"{rows['requests']['sim']} → {rows['requests']['live']}", *cells)
    return table
