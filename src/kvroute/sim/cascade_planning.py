"""CascadeInfer's pipeline planning in the simulator (004_131677394a4b07f8.txt §4.2).

"Pipeline planning runs at initialization and periodically thereafter. CascadeInfer collects
request statistics over the period (input and output lengths) and generates pipeline settings
for the next period." (§4.2). So:

* **What a plan is made on**: "the pipeline planning problem is to find optimal pipeline settings
  ... given E instances and a set of requests", its quality "the total QoE of all instances
  processing all requests" (§4.2): the set is one period's requests, each once
  (``partition.period_set``), so Eq. (1) weighs a stage by all the work a period brings it.
  (Not a snapshot of the sequences in flight, which kvroute used before: nothing in §4.2 speaks
  of concurrency, and ~70 sequences against a period's ~2,400 requests at 40 req/s left Eq. (1)'s
  load terms small beside its constant and the cut costs.)
* **At start-up** the plan comes from "historical workload statistics" (§4): one period's worth of
  the workload's length sample (rate × period requests; *choice*: the period is
  ``replan_interval_s``, or ``PLAN_PERIOD_S`` without re-planning).
* **Every** ``replan_interval_s`` (when set) it plans again from the period's own statistics:
  the input and output lengths of the requests that finished in the period (what a running
  system knows of them; *choice*: long requests still running are not in it yet); not once the
  workload has stopped issuing. A new plan replaces the stages and bounds; sequences now past
  their instance's range move at its next step (the hand-over path), those below it stay.
  *Choice*: the paper gives no period; the bundled reproduction names its own.
* Where a request's moment is drawn, its prefill counts in decode steps of the step time at the
  sequences in flight: by Little's law at start-up, observed (the mean over the period's
  rebalancing rounds) at a re-plan.
* **Envelope** (``max_stage_instances``, ``stages``): the plan may be kept within a shape — the
  reproduction uses §6.1's "pipelines of 4 to 6 stages ..., with each stage comprising 1 to 4
  instances".

Every plan's shape (sizes, bounds, what it was planned on) is kept for the run's summary.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvroute.cascade import partition
from kvroute.cascade.qoe import QoEModel
from kvroute.perf.profile import HardwareProfile
from kvroute.policy.presets.cascadeinfer import LengthStage
from kvroute.sim.events import EventLoop
from kvroute.sim.migration_settings import MigrationSettings
from kvroute.sim.qoe_profiling import QoEFit

PLAN_PERIOD_S = 60.0  # the start-up plan's period without re-planning (choice; the paper gives none)
PLAN_SAMPLE = 2000  # start-up requests for a workload without a rate


def _step_s(profile: HardwareProfile, batch: float, mean_ctx: float) -> float:
    """The profile's decode step for a per-instance batch at the requests' mean context."""
    b = max(1.0, batch)
    return profile.step_time(decode=int(math.ceil(b)), decode_ctx=b * mean_ctx)


def _mean_context(stats: Sequence[tuple[int, int]]) -> float:
    """Mean context over decode steps (length-biased: a request counts once per output token)."""
    return sum(o * (i + o / 2) for i, o in stats) / max(1, sum(o for _, o in stats))


def in_flight_by_littles_law(profile: HardwareProfile, rate: float, sample: Sequence[tuple[int, int]],
                             instances: int) -> float:
    """Sequences in flight at ``rate`` by Little's law on the profile's decode step."""
    mean_out = sum(o for _, o in sample) / len(sample)
    ctx = _mean_context(sample)
    return partition.concurrency(rate, mean_out, lambda b: _step_s(profile, b, ctx), instances,
                                 instances * profile.max_running)


def planning_costs(profile: HardwareProfile, model: QoEModel, stats: Sequence[tuple[int, int]],
                   in_flight: float, instances: int, tokens_per_s: float, seed: int) -> partition.StageCosts:
    """Stage and cut costs of §4.2 over one period's requests (``stats``: input, output lengths):
    each request once (``partition.period_set``), its prefill counted in decode steps at the step
    time of ``in_flight`` sequences spread over the instances; length tiers two per doubling from
    64 tokens up to the longest request; a cut moves KV at ``tokens_per_s``."""
    step = _step_s(profile, in_flight / instances, _mean_context(stats))
    running = partition.period_set(list(stats), seed=seed, prefill_tokens=lambda i: profile.prefill_time(i) / step)
    cuts = partition.cut_points(max(i + o for i, o in stats), 64, per_octave=2)
    return partition.StageCosts(model, running, cuts, 1.0 / tokens_per_s)


class PlanHost(Protocol):
    """What the planner reads of the migrator it serves (``sim/migration.py``)."""

    @property
    def order(self) -> list[str]: ...

    @property
    def profile(self) -> HardwareProfile: ...

    @property
    def params(self) -> MigrationSettings: ...

    @property
    def stage_filters(self) -> list[LengthStage]: ...

    @property
    def tokens_per_s(self) -> float: ...

    @property
    def loop(self) -> EventLoop: ...

    def fit(self) -> QoEFit: ...

    def in_flight(self) -> int: ...

    def replanned(self) -> None: ...

    def ongoing(self) -> bool: ...

    def issuing(self) -> bool: ...


class StagePlanner:
    """Plans the stages at start-up and, with ``replan_interval_s``, again every period."""

    def __init__(self, host: PlanHost, workload: object, seed: int):
        self.host = host
        self.workload = workload
        self.seed = seed
        self.plan_s = 0.0  # wall time of the start-up plan's partition
        self.note = ""
        self.shapes: list[dict[str, Any]] = []  # every plan made: when, sizes, bounds, planned on
        self._finished: list[tuple[int, int]] = []  # (input, output) of the period's finished requests
        self._in_flight: list[int] = []  # sequences in flight at each of the period's rounds

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> None:
        """The start-up plan, and the first re-plan scheduled when re-planning is on."""
        h, p = self.host, self.host.params
        c = h.stage_filters[0]
        if c.stage_sizes:
            for f in h.stage_filters:
                f.plan_from_sizes(h.order)
            self.note = "from the preset's stage_sizes and bounds"
            return
        sample_of: Callable[[int], list[tuple[int, int]]] | None = getattr(self.workload, "length_sample", None)
        if sample_of is None or p.layout == "no_pipeline":
            for f in h.stage_filters:
                f.plan_from_sizes(h.order)
            self.note = ("one stage (layout no_pipeline)" if p.layout == "no_pipeline" else
                         "one stage: the workload offers no length sample to plan on")
            return
        rate = float(getattr(self.workload, "rate", 0.0) or 0.0)
        period = p.replan_interval_s or PLAN_PERIOD_S
        size = max(len(h.order), int(round(rate * period))) if rate > 0 else PLAN_SAMPLE
        sample = sample_of(size)
        t0 = time.perf_counter()
        n = in_flight_by_littles_law(h.profile, rate or 1.0, sample, len(h.order))
        self._apply(sample, n, f"start-up: {len(sample)} requests of the workload's statistics "
                               f"(one {period:g} s period), {n:.0f} in flight by Little's law")
        self.plan_s = time.perf_counter() - t0
        if p.replan_interval_s is not None:
            h.loop.at(h.loop.now + p.replan_interval_s, self._replan)

    # -- the period's statistics ---------------------------------------------------------------------
    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request finished: its lengths join the period's statistics."""
        self._finished.append((prompt_tokens, output_tokens))

    def observe(self) -> None:
        """One round's count of sequences in flight (every rebalancing round)."""
        self._in_flight.append(self.host.in_flight())

    def _replan(self, _: object = None) -> None:
        h = self.host
        stats, counts = self._finished, self._in_flight
        self._finished, self._in_flight = [], []
        # a plan is for the next period: none once the workload stops issuing (the drain); too few
        # requests say little about lengths (§4.3's rule of five)
        if h.issuing() and len(stats) >= 5 and counts:
            n = sum(counts) / len(counts)
            self._apply(stats, n, f"t={h.loop.now:.0f}s: {len(stats)} requests finished in the period, "
                                  f"{n:.0f} in flight observed")
        if h.ongoing():
            h.loop.at(h.loop.now + h.params.replan_interval_s, self._replan)  # type: ignore[operator]

    # -- planning --------------------------------------------------------------------------------------
    def _apply(self, stats: Sequence[tuple[int, int]], n: float, planned_on: str) -> None:
        h, p = self.host, self.host.params
        mean_out = sum(o for _, o in stats) / len(stats)
        costs = planning_costs(h.profile, h.fit().model, stats, n, len(h.order), h.tokens_per_s, self.seed)
        if p.layout == "chain":
            plan = partition.chain(costs, len(h.order))
        else:
            solve = partition.exact if p.layout == "dp" else partition.heuristic
            plan = solve(costs, len(h.order), p.max_stage_instances, p.stages)
        stages, i = [], 0
        for k in plan.sizes:
            stages.append(h.order[i:i + k])
            i += k
        for f in h.stage_filters:
            f.set_plan(stages, plan.bounds)
        self.shapes.append({"at_s": round(h.loop.now, 1), "sizes": plan.sizes, "bounds": plan.bounds,
                            "planned_on": planned_on, "mean_output": round(mean_out, 1)})
        self.note = f"{p.layout}: sizes {plan.sizes}, bounds {plan.bounds} ({planned_on})"
        if len(self.shapes) > 1:
            h.replanned()
