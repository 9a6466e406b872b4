"""What of a fidelity comparison's miss is the model and what is the live side moving (issue 21o).

`kvroute bench fidelity` compares the medians over N repeats; every repeat i replays the same
conversations in the simulator as live, so its own sim/live ratio pairs like with like. Per metric,
over every policy and repeat, this module takes those per-run ratios on a log scale and reports:

- ``bias``: their geometric mean — what the model gets wrong on that metric whatever the run;
- ``spread``: their standard deviation (of the log) — how far one run's ratio moves about it;
- ``by_repeat``: each repeat's geometric mean over the policies — the policies of a repeat run
  back to back, so a repeat that sits apart from the others is the machine's speed moving
  (drift), not a policy;
- ``by_policy``: each policy's geometric mean over the repeats.

A metric whose ``bias`` is within 10 % but whose ``spread`` is ~0.3 misses by noise: the median of
N runs then moves by about 1.25 × spread / √N (the median's standard error), ±20 % at N = 3. Issue
21l's four stored runs (three vLLM, one llama.cpp; replayed, `busy`): TTFT p50 bias ×0.69-1.07 with
spread 0.31-0.47; req/s bias ×0.99-1.24 with spread 0.09-0.19 — the ×1.24 run (6 repeats, every one
×1.21-1.31) was slower live than its calibration throughout. Nothing here changes the comparison; it
says where its misses come from.
"""

from __future__ import annotations

import math
import statistics


def _log_ratios(repeats: list[dict], key: str) -> list[float | None]:
    out: list[float | None] = []
    for r in repeats:
        sim, live = r["sim"].get(key), r["live"].get(key)
        out.append(math.log(sim / live) if sim and live and sim > 0 and live > 0 else None)
    return out


def spread(policies: dict[str, dict], keys: tuple[str, ...]) -> dict[str, dict]:
    """Per metric in ``keys``: ``bias``, ``spread``, ``by_repeat``, ``by_policy`` and ``runs`` (how many
    per-run ratios there were) over ``policies`` (bench/fidelity.py ``summarize``'s rows, each with its
    ``repeats``); a metric with no ratio is left out."""
    out: dict[str, dict] = {}
    for key in keys:
        per_policy = {p: _log_ratios(row["repeats"], key) for p, row in policies.items()}
        every = [x for xs in per_policy.values() for x in xs if x is not None]
        if not every:
            continue
        repeats = max(len(xs) for xs in per_policy.values())
        by_repeat: list[float | None] = []
        for i in range(repeats):
            at = [x for xs in per_policy.values() if i < len(xs) and (x := xs[i]) is not None]
            by_repeat.append(math.exp(statistics.fmean(at)) if at else None)
        by_policy = {p: [x for x in xs if x is not None] for p, xs in per_policy.items()}
        out[key] = {"bias": math.exp(statistics.fmean(every)),
                    "spread": statistics.stdev(every) if len(every) > 1 else 0.0,
                    "by_repeat": by_repeat,
                    "by_policy": {p: math.exp(statistics.fmean(xs)) for p, xs in by_policy.items() if xs},
                    "runs": len(every)}
    return out


def describe(result: dict[str, dict], labels: dict[str, str]) -> list[str]:
    """One line per metric: its bias, spread and per-repeat means (for the bench's report)."""
    lines = []
    for key, s in result.items():
        reps = " ".join("-" if x is None else f"×{x:.2f}" for x in s["by_repeat"])
        lines.append(f"{labels.get(key, key)}: sim/live per run ×{s['bias']:.2f} (geometric mean of {s['runs']}), "
                     f"sd of log {s['spread']:.2f}; by repeat {reps}")
    return lines
