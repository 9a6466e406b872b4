"""The arithmetic of `kvroute bench auto`: a setup's capacity knee and one cell's verdict.

**Capacity knee.** A preset's capacity on a setup is the highest offered load that is both within
the SLO and stable: its SLO knee, capped by its stability knee on open-loop workloads (a load past
the stability knee is a queue that grows for as long as the run lasts; a short run can still meet
the SLO there, and comparing policies on it ranks how fast their queues grow, not how well they
route). A closed loop is stable by construction, so its SLO knee is its capacity. The setup's knee
is the highest capacity among the reference presets; when none meets the SLO at any load, the
highest stability knee (``basis: stability``) — the SLO cannot be met there at all.

**A cell's verdict.** Every policy runs on the same seeds (the same requests for every policy of a
seed). Its goodput is the mean over the seeds of the goodput over the arrival window (requests/s
that met the SLO and finished between the first and the last issue: sim/sweep.py
``window_goodput`` says why the makespan rate is too noisy); its TTFT p99 is the p99 of all its
seeds' requests pooled (3 × the sample of one run's p99). ``auto`` is compared with the best of
the other presets per metric. A cell is *saturated* when a run of ``auto`` or of a preset it is compared
with was unstable: its numbers measure a growing queue, so it is shown, marked and left out of the
worst-cell verdict. The per-seed ratios (``auto`` ÷ that preset on the same requests) show the noise.
"""

from __future__ import annotations

import statistics


def preset_capacity(knee: dict, closed_loop: bool) -> tuple[float, str] | None:
    """``(factor, basis)`` of one preset's capacity from its knees, or None when it has none."""
    slo, stab = knee["slo"]["factor"], knee["stability"]["factor"]
    if slo is None:
        return None
    if closed_loop:
        return slo, "slo"
    if stab is None:
        return None  # unstable at every load tried
    return (slo, "slo") if slo <= stab else (stab, "stability-capped")


def capacity_knee(knees: dict[str, dict], closed_loop: bool) -> dict | None:
    """The setup's capacity knee from the reference presets' knees (see the module docstring)."""
    caps = {p: c for p, k in knees.items() if (c := preset_capacity(k, closed_loop)) is not None}
    if caps:
        ref = max(caps, key=lambda p: caps[p][0])
        f, basis = caps[ref]
        return {"factor": f, "basis": basis, "policy": ref, "slo_met": True}
    stab = {p: k["stability"]["factor"] for p, k in knees.items() if k["stability"]["factor"] is not None}
    if stab:
        ref = max(stab, key=lambda p: stab[p])
        return {"factor": stab[ref], "basis": "stability", "policy": ref, "slo_met": False}
    return None


def pooled_p99(rows: list[dict]) -> float:
    """The p99 TTFT of every request of ``rows`` (runs) together, from each run's slowest first tokens
    (``ttft_tail``, nearest rank as kvroute.stats); the mean of the runs' p99s when a row has no tail.

    Exact only while no run holds more of the pooled tail than its ``ttft_tail`` lists: one run may hold all of it
    (on mixed-hardware at 50 % of the knee one seed of three held 18 of the pooled 25 slowest), so a run's tail
    must list up to 1 % of every run's requests together (``bench auto`` keeps 1 % × its seeds). ValueError when a
    truncated tail ends above the pooled p99 (a request missing from it might rank above)."""
    if not all("ttft_tail" in r for r in rows):
        return statistics.fmean(r["ttft_p99_s"] for r in rows)
    n = sum(r["served"] for r in rows)
    if n == 0:
        return 0.0
    tail = sorted((t for r in rows for t in r["ttft_tail"]), reverse=True)
    p99 = tail[min(len(tail) - 1, (n - 1) - round(0.99 * (n - 1)))]
    if any(len(r["ttft_tail"]) < r["served"] and r["ttft_tail"][-1] > p99 for r in rows):
        raise ValueError(f"pooled TTFT p99 of {len(rows)} runs not exact: a run's ttft_tail is too short "
                         f"(keep at least 1 % of {n} requests per run)")
    return p99


def _goodput(r: dict) -> float:
    return r.get("window_goodput_rps", r["goodput_rps"])


def judge_cell(per: dict[str, list[dict]], target: float = 0.97) -> dict:
    """One cell from each policy's per-seed rows (``auto`` among them): ratios, winners, saturation."""
    mean = {lbl: {"goodput_rps": statistics.fmean(_goodput(r) for r in rs),
                  "makespan_goodput_rps": statistics.fmean(r["goodput_rps"] for r in rs),
                  "ttft_p99_s": pooled_p99(rs),
                  "stable": all(r["stable"] for r in rs)} for lbl, rs in per.items()}
    others = {k: v for k, v in mean.items() if k != "auto"}
    best_g = max(others, key=lambda k: others[k]["goodput_rps"])
    best_t = min(others, key=lambda k: others[k]["ttft_p99_s"])
    a = mean["auto"]
    g = a["goodput_rps"] / others[best_g]["goodput_rps"] if others[best_g]["goodput_rps"] else 1.0
    t = others[best_t]["ttft_p99_s"] / a["ttft_p99_s"] if a["ttft_p99_s"] else 1.0
    seeds_g = [_ratio(_goodput(x), _goodput(y)) for x, y in zip(per["auto"], per[best_g])]
    seeds_t = [_ratio(y["ttft_p99_s"], x["ttft_p99_s"]) for x, y in zip(per["auto"], per[best_t])]
    best_m = max(others, key=lambda k: others[k]["makespan_goodput_rps"])
    makespan = _ratio(a["makespan_goodput_rps"], others[best_m]["makespan_goodput_rps"])
    unstable = sorted(lbl for lbl, m in mean.items() if not m["stable"])
    saturated = bool({"auto", best_g, best_t} & set(unstable))
    return {"goodput_ratio": round(g, 4), "best_goodput": best_g, "ttft_p99_ratio": round(t, 4),
            "best_ttft_p99": best_t, "goodput_ratio_seeds": [round(min(seeds_g), 4), round(max(seeds_g), 4)],
            "ttft_p99_ratio_seeds": [round(min(seeds_t), 4), round(max(seeds_t), 4)],
            "makespan_goodput_ratio": round(makespan, 4), "unstable": unstable, "saturated": saturated,
            "meets": min(g, t) >= target,
            "auto": a, "presets": others}


def _ratio(num: float, den: float) -> float:
    return num / den if den else 1.0


def worst_cell(cells: dict[str, dict[str, dict]]) -> tuple[dict | None, int, int, int]:
    """``(worst non-saturated cell, cells judged, cells meeting the target, saturated cells)``."""
    worst, judged, met, sat = None, 0, 0, 0
    for name, per_level in cells.items():
        for level, c in per_level.items():
            if c["saturated"]:
                sat += 1
                continue
            judged += 1
            met += c["meets"]
            score = min(c["goodput_ratio"], c["ttft_p99_ratio"])
            if worst is None or score < worst["ratio"]:
                metric = "goodput" if c["goodput_ratio"] <= c["ttft_p99_ratio"] else "TTFT p99"
                worst = {"scenario": name, "level": level, "ratio": round(score, 4), "metric": metric}
    return worst, judged, met, sat
