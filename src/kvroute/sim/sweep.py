"""`kvroute simulate --sweep`: each policy's capacity knees, then a comparison below them.

Two knees per policy, found by one search over the same runs:

* the **SLO knee** — the highest offered load at which at least ``slo.target`` (default 90 %)
  of the issued requests meet both SLO objectives (failed requests never do). It may not
  exist: when a workload's prompts take longer than the TTFT objective to prefill even on an
  idle replica, or its arrivals come in bursts that scaling the rate does not thin out, no load
  is light enough, and the sweep says so and why;
* the **stability knee** — the highest offered load at which the run is ``stable`` (the
  simulator's verdict: served ≥ 90 % of offered over the arrival window and the backlog not
  growing). It exists for any open-loop workload the replicas can serve at some rate. A closed
  loop is stable by construction (its clients wait for answers), so it has none.

Load is scaled by a factor *f* on the scenario's own: a trace's ``time_scale`` is divided by
*f*, a Poisson ``rate`` multiplied by it, a closed loop's clients multiplied by it. Each knee's
search brackets it by doubling or halving *f* from 1, then bisects in log space; runs are shared
between the two searches (cached by factor). The policies are then compared at 50 / 70 / 90 %
of a reference knee — the highest SLO knee found, or, when no policy has one, the highest
stability knee (``reference.basis`` says which) — so that at 90 % the weaker policies show what
they lose; every row says whether its run was stable.

Every paper kvroute reproduces compares policies below saturation (LMetric at half of the
maximum load; GORGO v2 sweeps time_scale): this is that procedure, automated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from kvroute.parallel import Executor
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
    elif sc.workload.rate or sc.workload.kind in ("chat-poisson", "long-context", "rag"):
        w["rate"] = (sc.workload.rate or 1.0) * f
    else:
        w["time_scale"] = sc.workload.time_scale / f
    if policy is not None:
        data["policies"] = [policy]
    return parse_scenario(data, "sweep")


def _run(sc: Scenario, f: float, entry, preset: str, params, topology: str | None = None,
         tail_share: float = 0.02) -> dict:
    s = scaled(sc, f, entry)
    sim = Simulation(s.setup(topology), preset, params, s.make_workload())
    r = sim.run()
    # which objective the misses broke: not in a run's own result (simulate's JSON stays as is)
    issued = r["issued"]
    ttft = np.frombuffer(sim.recorder.ttft, dtype=np.float64)
    tpot = np.frombuffer(sim.recorder.tpot, dtype=np.float64)
    r["_ttft_attainment"] = round(int(np.count_nonzero(ttft <= sc.slo.ttft_s)) / issued, 6) if issued else 0.0
    r["_tpot_attainment"] = round(int(np.count_nonzero(tpot <= sc.slo.tpot_s)) / issued, 6) if issued else 0.0
    r["_window_goodput"] = window_goodput(sim, sc.slo.ttft_s, sc.slo.tpot_s)
    # the slowest ``tail_share`` of first tokens (+ 1): the pooled p99 of k runs of n requests each needs up to
    # 1 % of k·n from one run, when that run holds the whole tail (bench auto passes 1 % × its seeds)
    r["_served"] = int(ttft.size)
    r["_ttft_tail"] = np.sort(ttft)[::-1][:math.ceil(tail_share * ttft.size) + 1].round(6).tolist()
    return r


def window_goodput(sim: Simulation, ttft_s: float, tpot_s: float) -> float:
    """Requests/s that met both objectives and finished within the arrival window (first to last issue).

    The run's own ``goodput_rps`` divides by the makespan, which ends with the drain after the last
    request is issued: in a closed loop the last few conversations or trees winding down alone
    decide it, so two runs that served the same requests equally well can differ by 20 %. Over the
    arrival window — where ``load.served_rps`` is measured too — the rate is the steady one."""
    rec = sim.recorder
    window = sim.last_issue - max(0.0, sim.first_issue)
    if window <= 0 or not len(rec.done_at):
        return 0.0
    done = np.frombuffer(rec.done_at, dtype=np.float64)
    ttft = np.frombuffer(rec.ttft, dtype=np.float64)
    tpot = np.frombuffer(rec.tpot, dtype=np.float64)
    met = (done <= sim.last_issue) & (ttft <= ttft_s) & (tpot <= tpot_s)
    return round(int(np.count_nonzero(met)) / window, 6)


def _point(f: float, r: dict) -> dict:
    return {"factor": round(f, 6), "offered_rps": r["load"]["offered_rps"], "served_rps": r["load"]["served_rps"],
            "goodput_rps": r["slo"]["goodput_rps"], "attainment": r["slo"]["attainment"],
            "ttft_attainment": r["_ttft_attainment"], "tpot_attainment": r["_tpot_attainment"],
            "failed": sum(r["failed"].values()), "stable": r["load"]["stable"],
            "ttft_p50_s": r["ttft_s"]["p50"], "ttft_p99_s": r["ttft_s"]["p99"]}


def _search(ok: Callable[[float], bool], bisect_steps: int, max_doublings: int
            ) -> tuple[float | None, float | None, float]:
    """Bracket the highest passing factor by doubling/halving from 1, then bisect in log space.

    Returns ``(lo, hi, last)``: the highest factor that passed (None if none did), the lowest
    that failed above it (None if none did), and the last factor tried.
    """
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
        if hi is None:
            return lo, None, f
    else:
        hi, lo = f, None
        for _ in range(max_doublings):
            f /= 2
            if ok(f):
                lo = f
                break
            hi = f
        if lo is None:
            return None, hi, f
    for _ in range(bisect_steps):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi, f


def arrival_bursts(sc: Scenario) -> tuple[int, int, int] | None:
    """An open-loop workload's (requests, distinct arrival instants, most requests at one instant).

    Scaling time spreads instants apart but never splits one: requests a trace stamps with the
    same time arrive together at every load."""
    wl = sc.make_workload()
    if wl.closed_loop:
        return None
    counts: dict[float, int] = {}
    for s in wl.arrivals():
        counts[s.req.arrival_s] = counts.get(s.req.arrival_s, 0) + 1
    if not counts:
        return None
    return sum(counts.values()), len(counts), max(counts.values())


def find_knee(sc: Scenario, entry, preset: str, params, bisect_steps: int = 4, max_doublings: int = 6,
              progress: Callable[[str], None] | None = None, topology: str | None = None,
              stability: bool = True, why_slo: Callable[[list[dict]], str] | None = None) -> dict:
    """One policy's SLO knee and stability knee; every run is kept as a point.

    Returns ``{"slo": knee, "stability": knee, "points": [...]}``, each knee ``{"factor",
    "offered_rps", "note"}`` with ``factor`` None when it does not exist (``note`` says why).
    ``why_slo`` explains a missing SLO knee from the points (the default names the best
    attainment and the objective that broke). ``stability=False`` skips the stability search.
    """
    target = sc.slo.target
    runs: dict[float, dict] = {}

    def point(f: float) -> dict:
        key = round(f, 9)
        if key not in runs:
            r = _run(sc, f, entry, preset, params, topology)
            runs[key] = _point(f, r)
            if progress:
                p = runs[key]
                progress(f"  x{f:.3g}: {p['offered_rps']:.3g} req/s offered, {p['served_rps']:.3g} served "
                         f"({'stable' if p['stable'] else 'UNSTABLE'}), {p['attainment']:.0%} within SLO")
        return runs[key]

    closed = sc.make_workload().closed_loop
    lo, hi, last = _search(lambda f: point(f)["attainment"] >= target, bisect_steps, max_doublings)
    if lo is None:
        pts = list(runs.values())
        note = why_slo(pts) if why_slo else _slo_missing(pts, sc, last)
        slo_knee = _knee(None, runs, note)
    else:
        slo_knee = _knee(lo, runs, "" if hi is not None else "beyond the range tried (SLO still met)")
    if not stability:
        stab_knee = _knee(None, runs, "not searched")
    elif closed:
        stab_knee = _knee(None, runs, "closed loop: stable by construction (clients wait for answers), no "
                                      "stability knee")
    else:
        lo, hi, last = _search(lambda f: point(f)["stable"], bisect_steps, max_doublings)
        if lo is None:
            light = min(runs.values(), key=lambda p: p["factor"])
            failed = min(p["failed"] for p in runs.values())
            why = (f"; {failed:,} requests failed at every load tried (the verdict counts only served ones)"
                   if failed else "")
            stab_knee = _knee(None, runs, f"unstable even at x{last:.3g} of the load "
                                          f"({light['served_rps']:.3g} of {light['offered_rps']:.3g} req/s "
                                          f"served){why}")
        else:
            stab_knee = _knee(lo, runs, "" if hi is not None else "beyond the range tried (still stable)")
    if slo_knee["factor"] is not None and stab_knee["factor"] is not None and slo_knee["factor"] > stab_knee["factor"]:
        issued = sc.limits.max_requests
        slo_knee["note"] = "; ".join(filter(None, [slo_knee["note"], (
            "above the stability knee: the backlog grows at this load, but the run"
            f"{f' ({issued:,} requests)' if issued else ''} ends before the queue pushes TTFT past the SLO; "
            "raise --max-requests for a steady-state knee")]))
    return {"slo": slo_knee, "stability": stab_knee,
            "points": sorted(runs.values(), key=lambda p: p["factor"])}


def _slo_missing(points: list[dict], sc: Scenario, last: float) -> str:
    best = max(points, key=lambda p: p["attainment"])
    broke = []
    if best["ttft_attainment"] < sc.slo.target:
        broke.append(f"{1 - best['ttft_attainment']:.0%} missed TTFT ≤ {sc.slo.ttft_s:g} s")
    if best["tpot_attainment"] < sc.slo.target:
        broke.append(f"{1 - best['tpot_attainment']:.0%} TPOT ≤ {sc.slo.tpot_s * 1000:g} ms")
    detail = f" ({', '.join(broke)})" if broke else ""
    return (f"SLO target not met even at x{last:.3g} of the load: best {best['attainment']:.0%} within SLO"
            f"{detail}; relax --slo-ttft/--slo-tpot")


def _knee(f: float | None, runs: dict[float, dict], note: str) -> dict:
    at = runs.get(round(f, 9)) if f is not None else None
    return {"factor": round(f, 6) if f is not None else None,
            "offered_rps": at["offered_rps"] if at else None, "note": note}


def slo_diagnosis(sc: Scenario) -> tuple[Callable[[list[dict]], str], str]:
    """Why a policy has no SLO knee: ``(per-policy note from its points, shared detail line)``.

    The note names prompts too long for the TTFT objective even on an idle replica (the
    pre-flight estimate: prefill alone, no prefix reuse) and what the lightest load tried still
    missed; the detail line names arrival bursts that no rate scaling thins out, and the fixes.
    """
    from kvroute.sim.overload import preflight

    checks = preflight(sc)
    target = sc.slo.target
    n, slow = checks.get("requests") or 0, checks.get("slo_ttft_unreachable") or 0

    def why(points: list[dict]) -> str:
        best = max(points, key=lambda p: p["attainment"])
        light = min(points, key=lambda p: p["factor"])
        if n and slow / n > 1 - target:
            head = (f"SLO unattainable: {slow / n:.0%} of requests exceed TTFT ≤ {sc.slo.ttft_s:g} s even on an idle "
                    f"replica (prefill alone; the target allows {1 - target:.0%})")
        elif n and slow:
            head = (f"SLO not met at any load tried ({slow / n:.0%} of requests exceed TTFT ≤ {sc.slo.ttft_s:g} s "
                    "even on an idle replica)")
        else:
            head = "SLO not met at any load tried"
        return (f"{head}; best {best['attainment']:.0%} within SLO; at x{light['factor']:.3g} "
                f"({light['offered_rps']:.3g} req/s) {1 - light['ttft_attainment']:.0%} missed TTFT, "
                f"{1 - light['tpot_attainment']:.0%} TPOT, {light['failed']:,} failed")

    parts = []
    bursts = arrival_bursts(sc)
    if bursts and bursts[2] > 1 and bursts[1] < bursts[0]:
        parts.append(f"the workload's {bursts[0]:,} requests arrive at {bursts[1]:,} distinct instants (up to "
                     f"{bursts[2]} at once): bursts that a lower rate spaces apart but never thins out, so the "
                     "lightest loads still queue prefills")
    parts.append(f"relax --slo-ttft (now {sc.slo.ttft_s:g} s) / --slo-tpot (now {sc.slo.tpot_s * 1000:g} ms) "
                 "or --slo-target, or use faster hardware (--profile)")
    return why, "; ".join(parts)


def _entry(sc: Scenario, label: str) -> tuple[str | dict, str, dict | None, str | None]:
    """A policy of ``sc`` by its label: ``(entry, preset, params, topology)``."""
    for lbl, preset, params, topo in sc.policy_list():
        if lbl == label:
            return ({"preset": preset, "params": params} if params else preset), preset, params, topo
    raise KeyError(label)


def knee_task(task: tuple[dict, str]) -> dict:
    """One policy's knees from ``(scenario data, policy label)``: self-contained, for any executor."""
    data, label = task
    sc = parse_scenario(data, "sweep")
    entry, preset, params, topo = _entry(sc, label)
    return find_knee(sc, entry, preset, params, topology=topo, why_slo=slo_diagnosis(sc)[0])


def compare_task(task: tuple[dict, str, float] | tuple[dict, str, float, float]) -> dict:
    """One policy at one load factor from ``(scenario data, policy label, factor[, tail share])``, as a comparison
    row; ``ttft_tail`` holds the slowest ``tail share`` (default 2 %) of its first tokens, + 1."""
    data, label, f = task[:3]
    sc = parse_scenario(data, "sweep")
    entry, preset, params, topo = _entry(sc, label)
    r = _run(sc, f, entry, preset, params, topo, *task[3:])
    return _point(f, r) | {"tpot_p50_s": r["tpot_s"]["p50"], "prefix_hit_rate": r["prefix_hit_rate"],
                           "window_goodput_rps": r["_window_goodput"], "served": r["_served"],
                           "ttft_tail": r["_ttft_tail"]}


def sweep(sc: Scenario, progress: Callable[[str], None] | None = None, executor: Executor | None = None) -> dict:
    """Both knees per policy, then every policy at 50/70/90 % of the reference knee.

    Each policy's knee search is one task and each comparison run another, handed to ``executor``
    (default: serial in this process); the searches themselves stay sequential, since every
    bisection step depends on the one before. The result does not depend on the executor.
    """
    ex = executor or Executor(1)
    data = sc.model_dump(exclude_none=True)
    labels = [p.label for p in sc.policy_list()]
    _, detail = slo_diagnosis(sc)

    def knee_done(i: int, k: dict) -> None:
        if progress:
            s = k["slo"]["factor"]
            progress(f"knees of {labels[i]}: SLO x{s:.3g}" if s is not None else f"knees of {labels[i]}: no SLO knee")
    found = ex.map(knee_task, [(data, lbl) for lbl in labels], knee_done)
    knees = dict(zip(labels, found))
    out: dict = {"slo": sc.slo.model_dump(), "knees": knees, "compare": {}, "reference": None,
                 "slo_unmet": None}
    missing = [lbl for lbl, k in knees.items() if k["slo"]["factor"] is None]
    if missing:
        out["slo_unmet"] = f"no SLO knee for {', '.join(missing)}: {detail}"
    for basis in ("slo", "stability"):
        have = [lbl for lbl, k in knees.items() if k[basis]["factor"] is not None]
        if have:
            ref_label = max(have, key=lambda lbl: knees[lbl][basis]["factor"])
            ref_knee = knees[ref_label][basis]
            out["reference"] = {"basis": basis, "policy": ref_label, "factor": ref_knee["factor"],
                                "offered_rps": ref_knee["offered_rps"]}
            break
    if out["reference"] is None:
        return out
    ref = out["reference"]["factor"]
    cells = [(level, lbl) for level in LEVELS for lbl in labels]
    rows = ex.map(compare_task, [(data, lbl, ref * level) for level, lbl in cells])
    for (level, lbl), row in zip(cells, rows):
        out["compare"].setdefault(f"{round(level * 100)}%", {})[lbl] = row
    if progress:
        progress(f"compared at 50/70/90 % of the {out['reference']['basis']} knee")
    return out
