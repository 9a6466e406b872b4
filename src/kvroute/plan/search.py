"""The capacity planner's search: the cheapest replicas × hardware × policy × layout that meets an SLO.

A *candidate* is one hardware profile, one policy (with its topology) and one layout — how a
total of *k* replicas spreads over the regions (``even``: as evenly as possible; ``by-clients``:
in proportion to each region's clients, at least ``min_per_region`` each). Cost is ``k × price``.

Per candidate, *k* is searched as the capacity knee is in ``sim/sweep.py``: more replicas never
make an SLO harder to meet (assumed, as every sizing study does), so the smallest passing *k* is
bracketed by doubling from the minimum, then bisected. All candidates advance in
rounds — one probe each per round — and a candidate is dropped as soon as even its cheapest
still-possible *k* costs more than the cheapest deployment already known to pass (it is
dominated on cost). The decisions depend only on finished rounds, so a pool or a Ray cluster
gives the serial search's answer. With several workers the rounds do not wait as a batch: a
worker with no run of the current round left starts a probe a later round is likely to ask for
(``Planner._results``), so both cores stay busy to the end.

A run *passes* when every percentile bound and the goodput share hold, no pinned request was
served outside its residency zone, and the simulator calls the run stable: a saturated run's
percentiles measure a queue that keeps growing, so it is never a result, whatever they say.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.parallel import Executor, Task
from kvroute.plan.spec import PlanSpec, base_scenario, regions_of
from kvroute.sim.scenario import Scenario, parse_scenario
from kvroute.sim.simulation import Simulation
from kvroute.sim.sweep import _search, scaled


@dataclass(frozen=True, eq=False)  # identity: a candidate is a key of the search state
class Candidate:
    """One hardware × policy × layout combination whose replica count the search sizes."""

    hardware: str  # profile: bundled name or YAML file, as the plan gives it
    price: float
    policy: str  # label
    entry: Any  # the scenario `policies` entry
    layout: str

    @property
    def label(self) -> str:
        """``policy on hardware, layout``."""
        return f"{self.policy} on {self.hardware}, {self.layout}"


def allocate(layout: str, k: int, regions: list[str], weights: dict[str, float], minimum: int) -> dict[str, int]:
    """``k`` replicas over ``regions``: ``minimum`` each, the rest evenly or by client weight (largest remainder,
    ties to the region named first)."""
    base = {r: minimum for r in regions}
    rest = k - minimum * len(regions)
    if rest <= 0:
        return base
    w = {r: (weights.get(r, 0.0) if layout == "by-clients" else 1.0) for r in regions}
    total = sum(w.values()) or len(regions)
    exact = {r: rest * (w[r] or (0 if sum(w.values()) else 1)) / total for r in regions}
    floor = {r: int(math.floor(x)) for r, x in exact.items()}
    left = rest - sum(floor.values())
    order = sorted(regions, key=lambda r: (-(exact[r] - floor[r]), regions.index(r)))
    for r in order[:left]:
        floor[r] += 1
    return {r: base[r] + floor[r] for r in regions}


def run_task(task: tuple[dict, dict[str, str]]) -> dict:
    """One simulated deployment from ``(scenario data, residency)``: its measurements (any executor)."""
    data, residency = task
    sc = parse_scenario(data, data.get("name", "plan"))
    entry = sc.policy_list()[0]
    setup = sc.setup(entry.topology)
    setup.residency = dict(residency)
    sim = Simulation(setup, entry.preset, entry.params, sc.make_workload())
    r = sim.run()
    rec = sim.recorder
    outside = 0
    if residency:
        codes = {code: region for region, code in rec.client_regions.items()}
        for c, rep in zip(rec.client, rec.replica):
            zone = residency.get(codes.get(c, ""))
            if zone is not None and rec.replica_regions[rep] != zone:
                outside += 1
    return {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "e2e_s": r["e2e_s"], "requests": r["requests"],
            "issued": r["issued"], "failed": sum(r["failed"].values()), "stable": r["load"]["stable"],
            "offered_rps": r["load"]["offered_rps"], "served_rps": r["load"]["served_rps"],
            "attainment": r["slo"]["attainment"], "goodput_rps": r["slo"]["goodput_rps"],
            "throughput_rps": r["throughput_rps"], "prefix_hit_rate": r["prefix_hit_rate"],
            "residency_violations": outside}


def verdict(spec: PlanSpec, m: dict) -> tuple[bool, float, list[str]]:
    """``(passes, closeness, what broke)``: closeness is the worst measured ÷ bound (≤ 1 passes)."""
    worst, broke = 0.0, []
    for metric, stat, bound in spec.slo.objectives():
        got = m[metric][stat]
        worst = max(worst, got / bound)
        if got > bound:
            broke.append(f"{metric[:-2].upper()} {stat} {got:.3g} s > {bound:g} s")
    g = spec.slo.goodput
    if g is not None:
        worst = max(worst, g.share / max(m["attainment"], 1e-9))
        if m["attainment"] < g.share:
            broke.append(f"goodput {m['attainment']:.0%} < {g.share:.0%} within TTFT ≤ {g.ttft_s:g} s, "
                         f"TPOT ≤ {g.tpot_s * 1000:g} ms")
    elif m["failed"]:
        broke.append(f"{m['failed']} requests failed")
        worst = max(worst, 1.0 + m["failed"] / max(1, m["issued"]))
    if m["residency_violations"]:
        broke.append(f"{m['residency_violations']} requests served outside their residency zone")
        worst = max(worst, 1.0 + m["residency_violations"] / max(1, m["requests"]))
    if not m["stable"]:
        broke.append(f"saturated (served {m['served_rps']:.3g} of {m['offered_rps']:.3g} req/s, backlog growing)")
        worst = max(worst, m["offered_rps"] / max(m["served_rps"], 1e-9))
    return not broke, worst, broke


@dataclass
class _State:
    """One candidate's search: highest failing k, lowest passing k, its points, why it stopped."""

    lo: int  # highest k known to fail (kmin - 1: none yet)
    hi: int | None = None  # lowest k known to pass
    next_k: int | None = None
    done: bool = False
    note: str = ""
    points: dict[int, dict] = field(default_factory=dict)


class Planner:
    """Runs a plan's search on an executor; :meth:`run` returns the whole answer as a dict."""

    def __init__(self, spec: PlanSpec, executor: Executor | None = None,
                 progress: Callable[[int, int, str], None] | None = None):
        self.spec = spec
        self.ex = executor or Executor(1)
        self.progress = progress  # (runs done, runs expected, what) after every round
        self.sc: Scenario = base_scenario(spec)
        self.regions = regions_of(spec, self.sc)
        self.weights = {r: float(n) for r, n in self.sc.clients().items()}
        self.kmin = spec.min_per_region * len(self.regions)
        self.runs = 0
        self.speculated = 0  # runs started before a round asked for them (more than one worker)
        self._measured: dict[tuple[Candidate, int], dict] = {}  # (candidate, k) → measurements
        self._used: set[tuple[Candidate, int]] = set()  # the ones a round asked for
        self._flight: dict[tuple[Candidate, int], Task] = {}
        self.candidates = [Candidate(hw.profile, hw.price_per_hour, e.label, _entry_of(e), layout)
                           for hw in spec.hardware
                           for e in parse_scenario({**self.sc.model_dump(exclude_none=True),
                                                    "policies": spec.policies}, "plan").policy_list()
                           for layout in spec.layouts]

    def deployment(self, c: Candidate, k: int, factor: float = 1.0) -> dict:
        """The scenario data of candidate ``c`` with ``k`` replicas (load × ``factor``)."""
        counts = allocate(c.layout, k, self.regions, self.weights, self.spec.min_per_region)
        data = self.sc.model_dump(exclude_none=True)
        data["replicas"] = [{"region": r, "count": n, "profile": c.hardware} for r, n in counts.items() if n]
        data["policies"] = [c.entry]
        if factor != 1.0:
            data = scaled(parse_scenario(data, "plan"), factor).model_dump(exclude_none=True)
        return data

    def _point(self, c: Candidate, k: int, m: dict) -> dict:
        ok, closeness, broke = verdict(self.spec, m)
        counts = allocate(c.layout, k, self.regions, self.weights, self.spec.min_per_region)
        return {"candidate": c.label, "policy": c.policy, "hardware": c.hardware, "layout": c.layout, "replicas": k,
                "per_region": counts, "cost_per_hour": round(k * c.price, 4), "passes": ok,
                "closeness": round(closeness, 4), "broke": broke, **m}

    def _expected(self, states: dict[Candidate, _State]) -> int:
        left = 0
        for s in states.values():
            if s.done:
                continue
            top = s.hi if s.hi is not None else self.spec.max_replicas
            left += max(1, math.ceil(math.log2(max(2, top - s.lo)))) + (0 if s.hi is not None else 1)
        return self.runs + left

    def run(self) -> dict:
        """Search every candidate; returns the winner, the Pareto front, every point and the closest miss."""
        states = {c: _State(lo=self.kmin - 1, next_k=self.kmin) for c in self.candidates}
        best_cost = math.inf
        while True:
            probes: list[tuple[Candidate, int]] = []
            for c, s in states.items():
                if s.done:
                    continue
                if self._pruned(c, s.lo, best_cost):
                    s.done, s.note = True, (f"pruned: {s.lo + 1} replicas would already cost "
                                            f"{(s.lo + 1) * c.price:.4g}/h > the best passing {best_cost:.4g}/h")
                    continue
                if s.next_k is not None:
                    probes.append((c, s.next_k))
            if not probes:
                break
            results = self._results(probes, states, best_cost)
            self.runs += len(probes)
            for (c, k), m in zip(probes, results):
                s = states[c]
                p = s.points[k] = self._point(c, k, m)
                if p["passes"]:
                    s.hi = k
                    best_cost = min(best_cost, k * c.price)
                else:
                    s.lo = k
                s.next_k = self._next(s)
                if s.next_k is None:
                    s.done = True
                    if s.hi is None:
                        s.note = f"SLO not met even with {self.spec.max_replicas} replicas (max_replicas)"
            if self.progress:
                self.progress(self.runs, self._expected(states), f"{sum(not s.done for s in states.values())} "
                                                                 "candidates searching")
        self._flight.clear()  # speculative runs still going: their results are not needed
        return self._answer(states)

    def _results(self, probes: list[tuple[Candidate, int]], states: dict[Candidate, _State],
                 best_cost: float) -> list[dict]:
        """The round's measurements, in probe order.

        With more than one worker the round's runs are not handed over as one batch: up to
        ``workers`` runs stay in flight, the round's own first, and a worker that would otherwise
        idle (the round has fewer runs left than workers) runs a probe a later round may ask for —
        the next probe of a candidate whose run of this round is measured (certain unless pruning
        drops it), then each unfinished probe's next k if it fails, then if it passes. A run's measurements depend
        only on its deployment, so a later round that asks for one already measured takes it as
        it is, and the decisions (hence the answer and ``runs``) are the serial search's; a
        speculative run no round asks for is counted in ``speculative_unused``, not in the answer."""
        need = [(c, k) for c, k in probes]
        while any(key not in self._measured for key in need):
            for key in need:
                if key not in self._measured and key not in self._flight:
                    self._launch(key)
            if self.ex.workers > 1:
                for key in self._guesses(need, states, best_cost):
                    if len(self._flight) > self.ex.workers:  # one queued beside the busy workers: no idle round trip
                        break
                    self._launch(key, speculative=True)
            for t in self.ex.wait(list(self._flight.values())):
                key = next(k for k, v in self._flight.items() if v is t)
                del self._flight[key]
                self._measured[key] = t.result
        out = [self._measured[key] for key in need]
        self._used.update(need)
        return out

    def _launch(self, key: tuple[Candidate, int], speculative: bool = False) -> None:
        c, k = key
        self._flight[key] = self.ex.submit(run_task, (self.deployment(c, k), self.spec.residency))
        if speculative:
            self.speculated += 1

    def _guesses(self, need: list[tuple[Candidate, int]], states: dict[Candidate, _State],
                 best_cost: float) -> list[tuple[Candidate, int]]:
        """Probes the next round may ask for, likeliest first, not measured or in flight yet: the
        next k of a candidate whose probe of this round is measured (certain, unless pruning drops
        it), then for each unmeasured probe its next k if it fails, then if it passes."""
        best = best_cost
        for c, k in need:  # passes already known this round lower the cost bound
            m = self._measured.get((c, k))
            if m is not None and verdict(self.spec, m)[0]:
                best = min(best, k * c.price)
        certain, fail, succeed = [], [], []
        for c, k in need:
            s = states[c]
            m = self._measured.get((c, k))
            if m is not None:
                passes = verdict(self.spec, m)[0]
                state = _State(lo=s.lo, hi=k) if passes else _State(lo=k, hi=s.hi)
                nxt = self._next(state)
                if nxt is not None and not self._pruned(c, state.lo, best):
                    certain.append((c, nxt))
                continue
            if_fail = self._next(_State(lo=k, hi=s.hi))
            if if_fail is not None and not self._pruned(c, k, best):
                fail.append((c, if_fail))
            if_pass = self._next(_State(lo=s.lo, hi=k))
            if if_pass is not None:
                succeed.append((c, if_pass))
        return [key for key in certain + fail + succeed if key not in self._measured and key not in self._flight]

    def _pruned(self, c: Candidate, lo: int, best_cost: float) -> bool:
        """Whether a candidate whose highest failing k is ``lo`` is dominated on cost."""
        return self.spec.prune and (lo + 1) * c.price > best_cost + 1e-9

    @property
    def speculative_unused(self) -> int:
        """Speculative runs whose measurements no round asked for (the cost of keeping workers busy)."""
        return sum(1 for key in self._measured if key not in self._used)

    def _next(self, s: _State) -> int | None:
        top = self.spec.max_replicas
        if s.hi is None:  # still bracketing: double
            if s.lo >= top:
                return None
            return min(top, max(s.lo + 1, 2 * max(s.lo, 1)))
        if s.hi - s.lo <= 1:
            return None
        return (s.lo + s.hi) // 2

    def _answer(self, states: dict[Candidate, _State]) -> dict:
        points = [p for s in states.values() for p in s.points.values()]
        passing = [p for p in points if p["passes"]]
        metric, stat = front_axis(self.spec)
        front = pareto(passing, metric, stat)
        winner = min(passing, key=lambda p: (p["cost_per_hour"], p[metric][stat])) if passing else None
        closest = min(points, key=lambda p: (p["closeness"], p["cost_per_hour"])) if points else None
        per_candidate = {c.label: {"min_replicas": s.hi, "cost_per_hour": None if s.hi is None else
                                   round(s.hi * c.price, 4), "runs": len(s.points), "note": s.note}
                         for c, s in states.items()}
        return {"name": self.spec.name, "regions": self.regions, "runs": self.runs,
                "requests_per_run": self.sc.limits.max_requests, "front_axis": f"{metric}.{stat}",
                "winner": winner, "front": front, "closest": None if winner else closest,
                "candidates": per_candidate,
                "points": sorted(points, key=lambda p: (p["candidate"], p["replicas"]))}

    def headroom(self, winner: dict, bisect_steps: int = 3, max_doublings: int = 3) -> dict:
        """How much more load the winner takes before the SLO breaks: the highest passing load factor."""
        c = next(c for c in self.candidates if c.label == winner["candidate"])
        tried: dict[float, bool] = {}

        def ok(f: float) -> bool:
            if f == 1.0:
                return True  # the winner passed at the plan's load
            m = self.ex.map(run_task, [(self.deployment(c, winner["replicas"], f), self.spec.residency)])[0]
            self.runs += 1
            tried[round(f, 4)] = verdict(self.spec, m)[0]
            return tried[round(f, 4)]

        lo, hi, _ = _search(ok, bisect_steps, max_doublings)
        factor = lo or 1.0
        if hi is None:
            note = f"headroom: meets the SLO at {factor:.2f}× the planned load, the most tried"
        elif lo is None or factor <= 1.0:
            note = f"headroom: under {hi - 1:.0%} (the SLO breaks at {hi:.2f}× the planned load)"
        else:
            note = f"headroom: {factor - 1:.0%} more load (the SLO breaks at {hi:.2f}×)"
        return {"factor": round(factor, 3), "breaks_at": None if hi is None else round(hi, 3), "tried": tried,
                "note": note}


def _entry_of(e: Any) -> Any:
    entry: Any = {"preset": e.preset, "params": e.params} if e.params else e.preset
    if e.topology:
        entry = {"preset": e.preset, **({"params": e.params} if e.params else {}), "topology": e.topology}
    return entry


def front_axis(spec: PlanSpec) -> tuple[str, str]:
    """The latency the front trades cost against: the SLO's first percentile bound, else TTFT p99."""
    objs = spec.slo.objectives()
    return (objs[0][0], objs[0][1]) if objs else ("ttft_s", "p99")


def pareto(points: list[dict], metric: str, stat: str) -> list[dict]:
    """Points no other point beats on both cost and latency (cheapest first)."""
    out: list[dict] = []
    for p in sorted(points, key=lambda p: (p["cost_per_hour"], p[metric][stat])):
        if not out or p[metric][stat] < out[-1][metric][stat]:
            out.append(p)
    return out
