"""`kvroute bench auto`: the ``auto`` policy against the best preset of every cell.

Cells are setup × load level: every bundled scenario (the stress workloads among them) at 50 /
70 / 90 % of its capacity knee — the highest load at which a reference preset both meets the SLO
and stays stable (bench/auto_cells.py says how). In every cell each preset runs on 3 seeds; a
preset's goodput is its mean over the seeds of the goodput at the SLO over the arrival window, its
TTFT p99 that of the seeds' requests pooled. The table prints auto ÷ best for goodput (higher is
better: ≥ 0.97 is within 3 %) and best ÷ auto for TTFT p99 (likewise ≥ 0.97), with the per-seed
range; cells where a compared run was unstable are marked saturated and left out of the worst-cell
verdict. ``auto`` is given the scenario's TPOT objective (``slo_tpot_ms`` = ``slo.tpot_s``, the SLO goodput is
judged on), as a deployment configures it; the presets take no SLO. Every run goes to the executor (a local
pool on every core by default).
"""

from __future__ import annotations

import argparse
import time

from kvroute.argtypes import positive_int
from kvroute.bench.auto_cells import capacity_knee, judge_cell, worst_cell
from kvroute.parallel import Executor, make_executor, worker_count

PRESETS = ("round_robin", "least_request", "consistent_hash", "sglang_cache_aware", "skywalker", "lmetric",
           "gorgo", "dynamo_kv", "llm_d")
KNEE_PRESETS = ("round_robin", "lmetric", "skywalker")


def bundled_scenarios() -> tuple[str, ...]:
    """Every bundled scenario (``kvroute simulate NAME``), the stress workloads included."""
    from kvroute.sim.scenario import SCENARIO_DIR

    return tuple(sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml")))


def run(scenarios: tuple[str, ...] | None = None, presets=PRESETS, seeds: int = 3, requests: int = 800,
        executor: Executor | None = None, progress=None) -> dict:
    """Knees, then every preset and auto in every cell on every seed; ratios per cell and the worst."""
    # imported here: the simulator needs the [sim] extra, and parsing the command line must not
    from kvroute.sim.scenario import ScenarioError, load_scenario, parse_scenario
    from kvroute.sim.sweep import LEVELS, compare_task, knee_task

    named = scenarios is not None
    scenarios = scenarios or bundled_scenarios()
    ex = executor or Executor(1)
    labels = ["auto", *[p for p in presets if p != "auto"]]
    base, closed, skipped, auto_entry = {}, {}, {}, {}
    for name in scenarios:
        sc = load_scenario(name)
        # auto as a user runs it: told the objective goodput is judged on (the presets take none)
        auto_entry[name] = {"preset": "auto", "params": {"slo_tpot_ms": sc.slo.tpot_s * 1000.0}}
        try:
            closed[name] = sc.make_workload().closed_loop
        except ScenarioError as exc:  # a bundled trace-based scenario on a machine without the trace
            if named:
                raise
            skipped[name] = str(exc)
            continue
        data = sc.model_dump(exclude_none=True)
        data.setdefault("limits", {})["max_requests"] = requests
        data["policies"] = list(KNEE_PRESETS)
        base[name] = data
    scenarios = tuple(n for n in scenarios if n not in skipped)
    knees = ex.map(knee_task, [(base[n], p) for n in scenarios for p in KNEE_PRESETS])
    out: dict = {"requests_per_run": requests, "seeds": seeds, "presets": labels, "scenarios": {},
                 "skipped": skipped}
    jobs = []
    tail = 0.01 * seeds + 0.01  # each run's slowest first tokens: enough for the seeds' pooled p99 (auto_cells)
    for i, name in enumerate(scenarios):
        ks = dict(zip(KNEE_PRESETS, knees[i * len(KNEE_PRESETS):(i + 1) * len(KNEE_PRESETS)]))
        ref = capacity_knee(ks, closed[name])
        out["scenarios"][name] = {"knee": ref, "closed_loop": closed[name], "cells": {},
                                  "knees": {p: {"slo": k["slo"]["factor"], "stability": k["stability"]["factor"]}
                                            for p, k in ks.items()}}
        if ref is None:
            continue
        policies = [auto_entry[name] if lbl == "auto" else lbl for lbl in labels]
        entries = [e.label for e in parse_scenario(dict(base[name], policies=policies), name).policy_list()]
        for level in LEVELS:
            for seed in range(seeds):
                data = dict(base[name], policies=policies, seed=base[name].get("seed", 0) + seed)
                jobs += [((name, level, lbl), (data, entry, ref["factor"] * level, tail))
                         for lbl, entry in zip(labels, entries)]
    if progress:
        progress(f"knees found; {len(jobs)} runs on {ex.describe()}")
    results = ex.map(compare_task, [j[1] for j in jobs])
    per_cell: dict = {}
    for ((name, level, lbl), _), r in zip(jobs, results):
        per_cell.setdefault((name, level), {}).setdefault(lbl, []).append(r)
    for (name, level), per in per_cell.items():
        out["scenarios"][name]["cells"][f"{round(level * 100)}%"] = judge_cell(per)
    worst, judged, met, sat = worst_cell({n: s["cells"] for n, s in out["scenarios"].items()})
    out.update(worst=worst, cells_judged=judged, cells_within_3pct=met, cells_saturated=sat)
    return out


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register `kvroute bench auto`."""
    p = bench.add_parser("auto", help="the auto policy ÷ the best preset per scenario × load cell")
    p.add_argument("--scenarios", help="bundled scenarios, comma-separated (default: every bundled scenario)")
    p.add_argument("--presets", default=",".join(PRESETS), help="presets auto is compared with")
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds per cell (default 3)")
    p.add_argument("--requests", type=positive_int, default=800, help="requests per run (default 800)")
    p.add_argument("--workers", type=worker_count, help="parallel runs (default: every core)")
    p.add_argument("--ray", metavar="ADDRESS", help="run on a Ray cluster")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown (docs/auto.md's)")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    """Print the per-cell table and the worst cell."""
    from kvroute.parallel import ExecutorError
    from kvroute.policy import ConfigError
    from kvroute.report import console, err, error, write_json
    from kvroute.sim.scenario import ScenarioError

    t0 = time.perf_counter()
    names = tuple(x for x in args.scenarios.split(",") if x) if args.scenarios else None
    try:
        with make_executor(args.workers, args.ray) as ex:
            result = run(names, tuple(x for x in args.presets.split(",") if x), args.seeds, args.requests, ex,
                         progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    except (ExecutorError, ScenarioError, ConfigError) as exc:
        return error(str(exc))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    console.print(table(result))
    for line in verdict_lines(result):
        console.print(line)
    write_json(args.json, result)
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(markdown(result), encoding="utf-8")
    return 0


def markdown(result: dict) -> str:
    """The per-cell table and the verdict lines as Markdown."""
    rows = ["| scenario | load (of the knee) | goodput auto÷best [seeds] | best goodput | TTFT p99 best÷auto [seeds] "
            "| best TTFT p99 | unstable runs |", "|---|---|---|---|---|---|---|"]
    for name, s in result["scenarios"].items():
        if not s["knee"]:
            rows.append(f"| {name} | – | no knee found | | | | |")
            continue
        k = s["knee"]
        for level, c in s["cells"].items():
            g, t = c["goodput_ratio_seeds"], c["ttft_p99_ratio_seeds"]
            sat = ("**saturated**: " if c["saturated"] else "") + (", ".join(c["unstable"]) or "none")
            rows.append(f"| {name} | {level} of x{k['factor']:.3g} ({k['basis']}) | {_md(c['goodput_ratio'])} "
                        f"[{g[0]:.2f}–{g[1]:.2f}] | {c['best_goodput']} | {_md(c['ttft_p99_ratio'])} "
                        f"[{t[0]:.2f}–{t[1]:.2f}] | {c['best_ttft_p99']} | {sat} |")
    return "\n".join(rows + [""] + [f"{line}  " for line in verdict_lines(result)]) + "\n"


def _md(x: float) -> str:
    return f"{x:.3f}" if x >= 0.97 else f"**{x:.3f}**"


def table(result: dict):
    """The per-cell table (rich)."""
    from rich.table import Table

    t = Table(title=f"auto ÷ best preset per cell ({result['seeds']} seeds, {result['requests_per_run']} requests "
                    "per run; goodput over the arrival window, TTFT p99 of the seeds pooled; ≥ 0.97 is within 3 %; "
                    "per-seed range in brackets)")
    for col in ("scenario", "load (of the knee)", "goodput auto÷best", "best goodput", "TTFT p99 best÷auto",
                "best TTFT p99", "unstable runs"):
        t.add_column(col, justify="right" if "÷" in col else "left")
    for name, s in result["scenarios"].items():
        if not s["knee"]:
            t.add_row(name, "–", "no knee found", "", "", "", "")
            continue
        k = s["knee"]
        for level, c in s["cells"].items():
            t.add_row(name, f"{level} of x{k['factor']:.3g} ({k['basis']})",
                      _mark(c["goodput_ratio"], c["goodput_ratio_seeds"]), c["best_goodput"],
                      _mark(c["ttft_p99_ratio"], c["ttft_p99_ratio_seeds"]), c["best_ttft_p99"],
                      ("SATURATED: " if c["saturated"] else "") + (", ".join(c["unstable"]) or "none"))
    return t


def verdict_lines(result: dict) -> list[str]:
    """The worst cell and the counts, in words."""
    w = result["worst"]
    lines = [f"skipped {name}: {why}" for name, why in result.get("skipped", {}).items()]
    lines += [f"{result['cells_within_3pct']} of {result['cells_judged']} cells within 3 % on both metrics; "
             f"{result['cells_saturated']} saturated cells left out ({result.get('wall_s', '?')} s wall)"]
    if w:
        lines.append(f"worst cell: {w['scenario']} at {w['level']} — {w['ratio']:.3f} of the best ({w['metric']})")
    return lines


def _mark(x: float, seeds: list[float]) -> str:
    s = f"{x:.3f} [{seeds[0]:.2f}–{seeds[1]:.2f}]"
    return s if x >= 0.97 else f"[red]{s}[/red]"
