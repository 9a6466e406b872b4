"""CascadeInfer's length-aware stage routing (004_131677394a4b07f8.txt §3.2, §4.2).

Instances form stages in length order; stage s serves sequence lengths below ``bounds[s]`` (the
last stage serves the rest). The ``length_stage`` filter keeps the instances of the earliest
stage whose range covers the request's initial length (its prompt tokens); then any rules pick
within the stage — the ``cascadeinfer`` preset uses least load, and a composed policy can put
``length_stage`` in front of any other rules. ``context_limit`` (read through the compiled
policy) tells a runtime where each instance's range ends, so a sequence that grows past it
migrates to the next stage: the simulator moves its KV (``sim/migration.py``), the gateway
continues the stream on the re-routed target.

The plan comes from ``stage_sizes`` and ``bounds`` (instances in configuration order), or — in
the simulator, when they are empty — from the partition of §4.2 over the profile's fitted QoE
model and the workload's lengths (``layout``); a runtime replaces it with ``set_plan`` and moves
boundaries with ``set_bounds`` (range refinement, §4.3). Without a plan every instance is one
stage. The simulator's settings (layout, re-planning, refinement, bid-ask, transfers) are not
policy parameters: they live in ``sim/migration_settings.py``; the plugin itself only routes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvroute.cascade.partition import stage_of
from kvroute.model import Branch, Endpoint
from kvroute.policy.catalog import register_plugin, register_preset
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import DecisionState, Filter


def _check_plan(stage_sizes: list[int], bounds: list[int]) -> None:
    if stage_sizes:
        if any(k < 1 for k in stage_sizes):
            raise ValueError("stage_sizes must be positive")
        if len(bounds) != len(stage_sizes) - 1:
            raise ValueError(f"bounds needs {len(stage_sizes) - 1} values (one per stage but the last), "
                             f"got {len(bounds)}")
    elif bounds:
        raise ValueError("bounds without stage_sizes")
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or any(b < 1 for b in bounds):
        raise ValueError("bounds must be positive and strictly increasing")


@register_plugin
class LengthStage(Filter):
    """The instances of the earliest length stage covering the prompt (CascadeInfer §3.2)."""

    name = "length_stage"

    def __init__(self, stage_sizes: list[int] | None = None, bounds: list[int] | None = None):
        self.stage_sizes = list(stage_sizes or [])
        self.bounds = list(bounds or [])
        _check_plan(self.stage_sizes, self.bounds)
        self.stages: list[list[str]] = []  # endpoint ids per stage, in length order
        self._stage: dict[str, int] = {}
        # a plan made from stage_sizes follows the endpoint set: the ids it was made for, and the
        # endpoint list last checked (the Router replaces the list on every add or remove)
        self._planned_ids: frozenset[str] | None = None
        self._seen: list[Endpoint] | None = None

    def set_plan(self, stages: list[list[str]], bounds: list[int]) -> None:
        """Replace the plan: endpoint ids per stage in length order, and the stage bounds. A plan
        set here is the runtime's: it is kept when endpoints come and go."""
        self._planned_ids = None
        self._set_plan(stages, bounds)

    def _set_plan(self, stages: list[list[str]], bounds: list[int]) -> None:
        if len(bounds) != len(stages) - 1:
            raise ValueError(f"{len(stages)} stages need {len(stages) - 1} bounds, got {len(bounds)}")
        self.stages = [list(s) for s in stages]
        self.bounds = list(bounds)
        self._stage = {eid: i for i, ids in enumerate(self.stages) for eid in ids}

    def set_bounds(self, bounds: list[int]) -> None:
        """Move the stage boundaries (range refinement), keeping the stages' instances."""
        self._set_plan(self.stages, bounds)

    def _sizes_plan(self, endpoint_ids: list[str]) -> tuple[list[list[str]], list[int]]:
        """The stages and bounds ``stage_sizes``/``bounds`` describe over ``endpoint_ids``."""
        sizes = self.stage_sizes or [len(endpoint_ids)]
        stages, i = [], 0
        for k in sizes:
            stages.append(endpoint_ids[i:i + k])
            i += k
        stages[-1].extend(endpoint_ids[i:])
        return stages, list(self.bounds) if self.stage_sizes else []

    def plan_from_sizes(self, endpoint_ids: list[str]) -> None:
        """The plan ``stage_sizes``/``bounds`` describe over ``endpoint_ids`` (configuration
        order); one stage when they are empty. Instances beyond the sizes join the last stage.
        The plan is made again when the endpoint set changes (see ``filter``)."""
        self._set_plan(*self._sizes_plan(endpoint_ids))
        self._planned_ids = frozenset(endpoint_ids)

    def _plan_for(self, st: DecisionState) -> dict[str, int]:
        """The stage of each endpoint id for this decision. The plan is made on first use and again
        when replicas were added or removed since (admin API, reload, failover) — a new replica
        would otherwise have no stage and get no traffic; a new plan is kept when the dispatch is
        committed (``st.defer``: deciding changes nothing). Checking costs one identity test per
        decision while the endpoint list stays the same. Choice: a re-plan starts from
        ``stage_sizes``/``bounds`` again (a runtime that set its own plan with ``set_plan`` keeps it)."""
        endpoints = st.view.endpoints
        if endpoints is self._seen and self.stages:
            return self._stage
        ids = [e.id for e in endpoints]
        if self.stages and (self._planned_ids is None or self._planned_ids == frozenset(ids)):
            st.defer(lambda: setattr(self, "_seen", endpoints))
            return self._stage
        stages, bounds = self._sizes_plan(ids)

        def keep() -> None:
            self._set_plan(stages, bounds)
            self._planned_ids = frozenset(ids)
            self._seen = endpoints
        st.defer(keep)
        return {eid: i for i, group in enumerate(stages) for eid in group}

    def stage(self, endpoint_id: str) -> int | None:
        """The stage ``endpoint_id`` serves in (None: not in the plan)."""
        return self._stage.get(endpoint_id)

    def context_limit(self, endpoint_id: str) -> int | None:
        """The end of the endpoint's stage range; None in the last stage or outside the plan."""
        s = self._stage.get(endpoint_id)
        if s is None or s >= len(self.bounds):
            return None
        return self.bounds[s]

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The candidates of the earliest covering stage; when it has none (unhealthy, not
        admitted), of the next later stage that has some (it serves longer sequences, so the
        request fits), else of the nearest earlier one."""
        get = self._plan_for(st).get
        want = stage_of(self.bounds, st.req.prompt_tokens)  # a new plan keeps these bounds
        best: int | None = None
        for e in eps:
            s = get(e.id)
            if s is None:
                continue
            if s == want:
                best = want
                break
            if best is None or (s > want and (best < want or s < best)) or (best < want and s > best):
                best = s
        if best is None:
            return []
        return [e for e in eps if get(e.id) == best]


def stage_filter(policy: object) -> LengthStage | None:
    """The ``length_stage`` plugin of a compiled policy, if it has one."""
    for p in getattr(policy, "plugins", ()):
        if isinstance(p, LengthStage):
            return p
    return None


@register_preset("cascadeinfer", source="CascadeInfer §3.2 (earliest covering stage), §4.2 (stage partition)",
                 filters=[{"length_stage": {"stage_sizes": "$stage_sizes", "bounds": "$bounds"}}],
                 rules=[{"enabled": "$within_round_robin", "picker": "round_robin", "branch": Branch.ROUND_ROBIN}],
                 cost={"inflight_tokens": 1, "batch_size": 1e-6}, branch=Branch.LEAST_LOAD)
class CascadeParams(PolicyParams):
    """Length stages: the earliest stage covering the prompt, least load (or round robin) within
    it. Planning, migration, range refinement and bid-ask are the simulator's (a scenario policy's
    ``simulator:`` settings, ``sim/migration_settings.py``)."""

    stage_sizes: list[int] = Field(default_factory=list, description="instances per stage in length order, "
                                   "taken in configuration order; empty: planned (simulator) or one stage")
    bounds: list[int] = Field(default_factory=list, description="upper sequence length (tokens, exclusive) "
                              "of every stage but the last; strictly increasing")
    within: Literal["least_load", "round_robin"] = Field("least_load", description="how an instance is "
                                                         "picked within the stage")
    @property
    def within_round_robin(self) -> bool:
        """Whether the round-robin rule is on (``within: round_robin``)."""
        return self.within == "round_robin"

    @model_validator(mode="after")
    def _plan_shape(self) -> CascadeParams:
        _check_plan(self.stage_sizes, self.bounds)
        return self
