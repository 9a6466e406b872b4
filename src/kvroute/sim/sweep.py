"""`kvroute simulate --sweep`: each policy's capacity knee, then a comparison below it.

The knee is the highest offered load at which at least ``slo.target`` (default 90 %) of the
issued requests meet both SLO objectives (failed requests never do). Load is scaled by a
factor *f* on the scenario's own: a trace's ``time_scale`` is divided by *f*, a Poisson
``rate`` multiplied by it, a closed loop's clients multiplied by it. The search brackets the
knee by doubling or halving *f*, then bisects in log space. The policies are then compared at
50 / 70 / 90 % of a reference knee — the highest knee found, so that at 90 % the weaker
policies show what they lose — and every row says whether its run was stable.

Every paper kvroute reproduces compares policies below saturation (LMetric at half of the
maximum load; GORGO v2 sweeps time_scale): this is that procedure, automated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvroute.sim.scenario import Scenario, parse_scenario
from kvroute.sim.simulation import Simulation

LEVELS = (0.5, 0.7, 0.9)


def scaled(sc: Scenario, f: float, policy: str | dict | None = None) -> Scenario:
    """The scenario with its offered load multiplied by ``f`` (and one policy, if given)."""
    data = sc.model_dump(exclude_none=True)
    w = data["workload"]
    if sc.workload.kind in ("chat", "tot", "mixed", "openai"):
        clients = sc.clients()
        w["clients"] = {r: max(1, round(n * f)) for r, n in clients.items()}
    elif sc.workload.rate or sc.workload.kind == "chat-poisson":
        w["rate"] = (sc.workload.rate or 1.0) * f
    else:
        w["time_scale"] = sc.workload.time_scale / f
    if policy is not None:
        data["policies"] = [policy]
    return parse_scenario(data, "sweep")


def _run(sc: Scenario, f: float, entry, preset: str, params, topology: str | None = None) -> dict:
    s = scaled(sc, f, entry)
    return Simulation(s.setup(topology), preset, params, s.make_workload()).run()


def _point(f: float, r: dict) -> dict:
    return {"factor": round(f, 6), "offered_rps": r["load"]["offered_rps"], "served_rps": r["load"]["served_rps"],
            "goodput_rps": r["slo"]["goodput_rps"], "attainment": r["slo"]["attainment"],
            "stable": r["load"]["stable"], "ttft_p50_s": r["ttft_s"]["p50"], "ttft_p99_s": r["ttft_s"]["p99"]}


def find_knee(sc: Scenario, entry, preset: str, params, bisect_steps: int = 4, max_doublings: int = 6,
              progress: Callable[[str], None] | None = None, topology: str | None = None) -> dict:
    """Highest load factor meeting the SLO target for one policy; every run is kept as a point."""
    target = sc.slo.target
    points: list[dict] = []

    def ok(f: float) -> bool:
        r = _run(sc, f, entry, preset, params, topology)
        points.append(_point(f, r))
        if progress:
            progress(f"  x{f:.3g}: {r['load']['offered_rps']:.3g} req/s offered, "
                     f"{r['slo']['attainment']:.0%} within SLO")
        return r["slo"]["attainment"] >= target

    f = 1.0
    lo: float | None
    hi: float | None
    if ok(f):
        lo, hi = f, None
        for _ in range(max_doublings):
            f *= 2
            if not ok(f):
                hi = f
                break
            lo = f
        if hi is None:  # never failed: the knee is beyond the range tried
            return _knee(lo, points, "beyond the range tried (SLO still met)")
    else:
        hi, lo = f, None
        for _ in range(max_doublings):
            f /= 2
            if ok(f):
                lo = f
                break
            hi = f
        if lo is None:
            best = max(points, key=lambda p: p["attainment"])
            return _knee(None, points, f"SLO target not met even at x{f:.3g} of the load "
                                       f"(best {best['attainment']:.0%}): relax --slo-ttft/--slo-tpot")
    assert lo is not None and hi is not None  # bracketed above
    for _ in range(bisect_steps):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return _knee(lo, points, "")


def _knee(f: float | None, points: list[dict], note: str) -> dict:
    points = sorted(points, key=lambda p: p["factor"])
    at = next((p for p in points if f is not None and p["factor"] == round(f, 6)), None)
    return {"factor": round(f, 6) if f is not None else None,
            "offered_rps": at["offered_rps"] if at else None, "note": note, "points": points}


def sweep(sc: Scenario, progress: Callable[[str], None] | None = None) -> dict:
    """Knee per policy, then every policy at 50/70/90 % of the reference (highest) knee."""
    knees = {}
    for label, preset, params, topo in sc.policy_list():
        entry = {"preset": preset, "params": params} if params else preset
        if progress:
            progress(f"knee of {label}")
        knees[label] = find_knee(sc, entry, preset, params, progress=progress, topology=topo)
    found = [k["factor"] for k in knees.values() if k["factor"] is not None]
    out: dict = {"slo": sc.slo.model_dump(), "knees": knees, "compare": {}}
    if not found:
        out["reference"] = None
        return out
    ref_label = max((lbl for lbl, k in knees.items() if k["factor"] is not None), key=lambda lbl: knees[lbl]["factor"])
    ref = knees[ref_label]["factor"]
    out["reference"] = {"policy": ref_label, "factor": ref, "offered_rps": knees[ref_label]["offered_rps"]}
    for level in LEVELS:
        row = {}
        for label, preset, params, topo in sc.policy_list():
            entry = {"preset": preset, "params": params} if params else preset
            r = _run(sc, ref * level, entry, preset, params, topo)
            row[label] = _point(ref * level, r) | {"tpot_p50_s": r["tpot_s"]["p50"],
                                                    "prefix_hit_rate": r["prefix_hit_rate"],
                                                    "failed": sum(r["failed"].values())}
        out["compare"][f"{round(level * 100)}%"] = row
        if progress:
            progress(f"compared at {level:.0%} of the knee")
    return out
