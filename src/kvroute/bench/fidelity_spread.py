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

Convoys (:func:`convoys`): closed-loop users whose turns finish in one engine step send their next
turns together, and those prefill together in one step and finish together again, so a run's users
fall into groups that keep their step; how large the groups come out depends on the first seconds of
the run. The mean number of requests that got their first token in the same step of one engine
(request-weighted) is such a run's convoy size. Over issue 21l's 48 vLLM runs the simulated convoys were
as large as the live ones on average (×0.95) but not run by run (sd of the log ratio 0.31), and the
run's TTFT p50 ratio followed its convoy ratio (correlation 0.79; llama.cpp's 32 runs: ×1.00, 0.29,
0.72): one repeat's TTFT p50 miss is mostly which convoys its users happened to form on either side.
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


def describe(result: dict[str, dict], labels: dict[str, str], convoy: dict | None = None) -> list[str]:
    """One line per metric: its bias, spread and per-repeat means (for the bench's report); and one for
    the convoys where given (:func:`convoys`)."""
    lines = []
    if convoy is not None:
        corr = "-" if convoy["corr_ttft_p50"] is None else f"{convoy['corr_ttft_p50']:.2f}"
        lines.append(f"convoys (requests per first-token step of an engine): sim/live ×{convoy['ratio']:.2f} "
                     f"(geometric mean of {convoy['runs']}), sd of log {convoy['spread']:.2f}, correlation with "
                     f"the run's TTFT p50 ratio {corr}")
    for key, s in result.items():
        reps = " ".join("-" if x is None else f"×{x:.2f}" for x in s["by_repeat"])
        lines.append(f"{labels.get(key, key)}: sim/live per run ×{s['bias']:.2f} (geometric mean of {s['runs']}), "
                     f"sd of log {s['spread']:.2f}; by repeat {reps}")
    return lines


def convoy_size(rows: list[list], replica: int, within_s: float = 0.003) -> float:
    """The request-weighted mean number of requests of one engine whose first token came within
    ``within_s`` of the one before it (one step), from a side's ``per_request`` rows ([sent, TTFT, ...];
    the engine in column ``replica``); 0 with no rows."""
    by: dict[object, list[float]] = {}
    for r in rows:
        by.setdefault(r[replica], []).append(r[0] + r[1])
    sizes: list[int] = []
    for times in by.values():
        times.sort()
        group = 1
        for a, b in zip(times, times[1:], strict=False):
            if b - a <= within_s:
                group += 1
            else:
                sizes += [group] * group
                group = 1
        sizes += [group] * group
    return statistics.fmean(sizes) if sizes else 0.0


def convoys(policies: dict[str, dict]) -> dict | None:
    """Every run's convoy size live and simulated (module docstring; live rows name the engine in column 7,
    simulated ones in column 5), their geometric-mean ratio, the sd of its log and its correlation with the
    run's TTFT p50 ratio (None where there are too few runs or no spread); None without per-request rows."""
    ratios, ttft = [], []
    for row in policies.values():
        for r in row["repeats"]:
            live, sim = r["live"].get("per_request"), r["sim"].get("per_request")
            if not live or not sim or not r["live"].get("ttft_p50") or not r["sim"].get("ttft_p50"):
                continue
            ratios.append(math.log(convoy_size(sim, 5) / convoy_size(live, 7)))
            ttft.append(math.log(r["sim"]["ttft_p50"] / r["live"]["ttft_p50"]))
    if not ratios:
        return None
    spread_ = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    corr = statistics.correlation(ratios, ttft) if len(ratios) > 2 and spread_ and statistics.stdev(ttft) else None
    return {"ratio": math.exp(statistics.fmean(ratios)), "spread": spread_, "corr_ttft_p50": corr, "runs": len(ratios)}
