"""`kvroute reproduce PAPER`: each paper's headline claims beside kvroute's simulated numbers.

What each paper reports and the setups come from ``shared/design/reproduction.md``; the
setups are readable scenario files under ``kvroute/scenarios/reproduce/``. Output rows: claim | paper |
kvroute | agrees? | why not. With ``seeds`` > 1 every row is built at seeds 1..N and judged by the
median of its per-seed verdicts (common.py, seeds.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvroute.parallel import Executor
from kvroute.reproduce import cascadeinfer, gorgo, lmetric, skywalker
from kvroute.reproduce.common import Lab, Row
from kvroute.reproduce.seeds import agrees_cell, combine, kvroute_cell, run_seeds, seed_span

# each paper by its title, as a reader looks it up (the seed files in shared/seeds/ are the same papers)
PAPERS: dict[str, tuple[str, Callable[[Lab], list[Row]]]] = {
    "skywalker": ("SkyWalker: A Locality-Aware Cross-Region Load Balancer for LLM Inference (EuroSys '26)",
                  skywalker.rows),
    "gorgo-v1": ("GORGO: Maximizing KV-Cache Reuse While Minimizing Network Latency in Cross-Region LLM Load "
                 "Balancing (GORGO v1)", gorgo.rows_v1),
    "gorgo-v2": ("GORGO: Online Tuning for Cross-Region Network-Aware LLM Serving (GORGO v2)", gorgo.rows_v2),
    "lmetric": ("LMetric: Simple is Better – Multiplication May Be All You Need for LLM Request Scheduling",
                lmetric.rows),
    "cascadeinfer": ("CascadeInfer: Low-Latency and Load-Balanced LLM Serving via Length-Aware Scheduling",
                     cascadeinfer.rows),
}


def reproduce(paper: str, quick: bool = False, progress: Callable[[str], None] | None = None,
              executor: Executor | None = None, seeds: int = 1) -> dict:
    """Run one paper's reproduction at seeds 1..``seeds`` (odd); returns rows (each judged by the median of
    its per-seed verdicts, with every seed's row) plus what ran (scenario, seed, requests, wall time). Each
    experiment's policies, and with several seeds each seed's experiments, run as tasks of ``executor``
    (default: serial)."""
    if seeds < 1 or seeds % 2 == 0:
        raise ValueError(f"seeds must be an odd positive count, got {seeds}")
    title, fn = PAPERS[paper]
    t0 = time.perf_counter()
    labs = run_seeds(fn, list(range(1, seeds + 1)), quick, executor or Executor(1), progress)
    runs = {(key if s == 1 else f"{key}@seed{s}"): {**m, "seed": s} for s, lab in labs.items()
            for key, m in lab.meta.items()}
    return {"paper": paper, "title": title, "quick": quick, "seeds": seeds,
            "wall_s": round(time.perf_counter() - t0, 1),
            "rows": combine({s: lab.rows for s, lab in labs.items()}), "runs": runs}


def markdown(result: dict) -> str:
    """The rows as a Markdown table."""
    lines = [f"### {result['title']}" + (" (--quick)" if result["quick"] else ""), "",
             "| claim | paper | kvroute | agrees? | why not |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [r["claim"], r["paper"], kvroute_cell(r), agrees_cell(r), r["why_not"]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    scenarios = sorted({m["scenario"] for m in result["runs"].values()})
    n = result.get("seeds", 1)
    judged = "" if n == 1 else (f"{seed_span(list(range(1, n + 1)))}, each row judged by the median of its "
                                "per-seed verdicts; ")
    lines += ["", f"Scenarios: {', '.join(f'`{x}`' for x in scenarios) or '–'}; {judged}{result['wall_s']} s wall "
                  "on this machine."]
    return "\n".join(lines) + "\n"
