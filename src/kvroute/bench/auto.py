"""`kvroute bench auto`: the ``auto`` policy against the best preset of every cell.

Cells are bundled scenario × load level. Each scenario's capacity knee is the highest SLO knee
(else stability knee) that ``simulate --sweep``'s search finds for a few reference presets; the
cells are at 50 / 70 / 90 % of it. In every cell each preset runs on 3 seeds; a preset's value is
its mean over the seeds. The table prints auto ÷ best for goodput at the SLO (higher is better:
≥ 0.97 is within 3 %) and best ÷ auto for TTFT p99 (likewise ≥ 0.97), and names the worst cell.
Every run goes to the executor (a local pool on every core by default).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvroute.parallel import Executor, make_executor, worker_count

SCENARIOS = ("chat-1region", "chat-3region-skewed", "tot", "mixed-tree", "mooncake")
PRESETS = ("round_robin", "least_request", "consistent_hash", "sglang_cache_aware", "skywalker", "lmetric",
           "gorgo", "dynamo_kv", "llm_d")
KNEE_PRESETS = ("round_robin", "lmetric", "skywalker")


def run(scenarios=SCENARIOS, presets=PRESETS, seeds: int = 3, requests: int = 800,
        executor: Executor | None = None, progress=None) -> dict:
    """Knees, then every preset and auto in every cell on every seed; ratios per cell and the worst."""
    # imported here: the simulator needs the [sim] extra, and parsing the command line must not
    from kvroute.sim.scenario import load_scenario
    from kvroute.sim.sweep import LEVELS, compare_task, knee_task

    ex = executor or Executor(1)
    labels = ["auto", *[p for p in presets if p != "auto"]]
    base = {}
    for name in scenarios:
        sc = load_scenario(name)
        data = sc.model_dump(exclude_none=True)
        data.setdefault("limits", {})["max_requests"] = requests
        data["policies"] = list(KNEE_PRESETS)
        base[name] = data
    knees = ex.map(knee_task, [(base[n], p) for n in scenarios for p in KNEE_PRESETS])
    out: dict = {"requests_per_run": requests, "seeds": seeds, "presets": labels, "scenarios": {}}
    jobs = []
    for i, name in enumerate(scenarios):
        ks = knees[i * len(KNEE_PRESETS):(i + 1) * len(KNEE_PRESETS)]
        ref = None
        for basis in ("slo", "stability"):
            found = [k[basis]["factor"] for k in ks if k[basis]["factor"] is not None]
            if found:
                ref = {"basis": basis, "factor": max(found)}
                break
        out["scenarios"][name] = {"knee": ref, "cells": {}}
        if ref is None:
            continue
        for level in LEVELS:
            for seed in range(seeds):
                data = dict(base[name], policies=labels, seed=base[name].get("seed", 0) + seed)
                jobs += [((name, level, seed, lbl), (data, lbl, ref["factor"] * level)) for lbl in labels]
    if progress:
        progress(f"knees found; {len(jobs)} runs on {ex.describe()}")
    results = ex.map(compare_task, [j[1] for j in jobs])
    cells: dict = {}
    for (key, _), r in zip(jobs, results):
        name, level, seed, lbl = key
        cells.setdefault((name, level), {}).setdefault(lbl, []).append(r)
    worst = None
    for (name, level), per in cells.items():
        mean = {lbl: {"goodput_rps": statistics.fmean(r["goodput_rps"] for r in rs),
                      "ttft_p99_s": statistics.fmean(r["ttft_p99_s"] for r in rs),
                      "stable": all(r["stable"] for r in rs)} for lbl, rs in per.items()}
        others = {k: v for k, v in mean.items() if k != "auto"}
        best_g = max(others, key=lambda k: others[k]["goodput_rps"])
        best_t = min(others, key=lambda k: others[k]["ttft_p99_s"])
        a = mean["auto"]
        g = a["goodput_rps"] / others[best_g]["goodput_rps"] if others[best_g]["goodput_rps"] else 1.0
        t = others[best_t]["ttft_p99_s"] / a["ttft_p99_s"] if a["ttft_p99_s"] else 1.0
        cell = {"goodput_ratio": round(g, 4), "best_goodput": best_g, "ttft_p99_ratio": round(t, 4),
                "best_ttft_p99": best_t, "auto": a, "presets": others}
        out["scenarios"][name]["cells"][f"{round(level * 100)}%"] = cell
        score = min(g, t)
        if worst is None or score < worst[0]:
            worst = (score, name, f"{round(level * 100)}%")
    out["worst"] = None if worst is None else {"scenario": worst[1], "level": worst[2], "ratio": round(worst[0], 4)}
    return out


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register `kvroute bench auto`."""
    p = bench.add_parser("auto", help="the auto policy ÷ the best preset per scenario × load cell")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="bundled scenarios, comma-separated")
    p.add_argument("--presets", default=",".join(PRESETS), help="presets auto is compared with")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--requests", type=int, default=800, help="requests per run (default 800)")
    p.add_argument("--workers", type=worker_count, help="parallel runs (default: every core)")
    p.add_argument("--ray", metavar="ADDRESS", help="run on a Ray cluster")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    """Print the per-cell table and the worst cell."""
    from rich.table import Table

    from kvroute.parallel import ExecutorError
    from kvroute.policy import ConfigError
    from kvroute.report import console, err, error, write_json
    from kvroute.sim.scenario import ScenarioError

    t0 = time.perf_counter()
    try:
        with make_executor(args.workers, args.ray) as ex:
            result = run(tuple(x for x in args.scenarios.split(",") if x), tuple(x for x in args.presets.split(",")
                                                                               if x),
                         args.seeds, args.requests, ex, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    except (ExecutorError, ScenarioError, ConfigError) as exc:
        return error(str(exc))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    t = Table(title=f"auto ÷ best preset per cell ({result['seeds']} seeds, {result['requests_per_run']} requests "
                    "per run; ≥ 0.97 is within 3 %)")
    for col in ("scenario", "load", "goodput auto÷best", "best goodput", "TTFT p99 best÷auto", "best TTFT p99",
                "auto stable"):
        t.add_column(col, justify="left" if col in ("scenario", "load", "best goodput", "best TTFT p99") else "right")
    for name, s in result["scenarios"].items():
        if not s["knee"]:
            t.add_row(name, "–", "no knee found", "", "", "", "")
            continue
        for level, c in s["cells"].items():
            t.add_row(name, f"{level} of x{s['knee']['factor']:.3g} ({s['knee']['basis']})",
                      _mark(c["goodput_ratio"]), c["best_goodput"], _mark(c["ttft_p99_ratio"]), c["best_ttft_p99"],
                      "yes" if c["auto"]["stable"] else "NO")
    console.print(t)
    w = result["worst"]
    if w:
        console.print(f"worst cell: {w['scenario']} at {w['level']} — {w['ratio']:.3f} of the best "
                      f"({result['wall_s']} s wall)")
    write_json(args.json, result)
    return 0


def _mark(x: float) -> str:
    return f"{x:.3f}" if x >= 0.97 else f"[red]{x:.3f}[/red]"
