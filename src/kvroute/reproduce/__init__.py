"""`kvroute reproduce PAPER`: each paper's headline claims beside kvroute's simulated numbers.

What each paper reports and the setups come from ``shared/design/reproduction.md``; the
setups are readable scenario files under ``kvroute/scenarios/reproduce/``. Output rows: claim | paper |
kvroute | agrees? | why not.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvroute.parallel import Executor
from kvroute.reproduce import cascadeinfer, gorgo, lmetric, skywalker
from kvroute.reproduce.common import Lab, Row

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
              executor: Executor | None = None) -> dict:
    """Run one paper's reproduction; returns rows plus what ran (scenario, requests, wall time). Each
    experiment's policies run as tasks of ``executor`` (default: serial)."""
    title, fn = PAPERS[paper]
    lab = Lab(quick=quick, progress=progress, executor=executor or Executor(1))
    t0 = time.perf_counter()
    rows = fn(lab)
    return {"paper": paper, "title": title, "quick": quick, "wall_s": round(time.perf_counter() - t0, 1),
            "rows": [r.as_dict() for r in rows], "runs": lab.meta}


def markdown(result: dict) -> str:
    """The rows as a Markdown table."""
    lines = [f"### {result['title']}" + (" (--quick)" if result["quick"] else ""), "",
             "| claim | paper | kvroute | agrees? | why not |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [r["claim"], r["paper"], r["kvroute"], r["agrees"], r["why_not"]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    scenarios = sorted({m["scenario"] for m in result["runs"].values()})
    lines += ["", f"Scenarios: {', '.join(f'`{x}`' for x in scenarios) or '–'}; {result['wall_s']} s wall "
                  "on this machine."]
    return "\n".join(lines) + "\n"
