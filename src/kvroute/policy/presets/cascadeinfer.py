"""CascadeInfer's length-aware stage routing (004_131677394a4b07f8.txt §3.2, §4.2).

Instances form stages in length order; stage s serves sequence lengths below ``bounds[s]`` (the
last stage serves the rest). A request goes to the earliest stage whose range covers its
initial length (its prompt tokens); within that stage another preset (``inner``, least load by
default) picks the instance. ``context_limit`` tells a runtime where each instance's range ends,
so a sequence that grows past it migrates to the next stage: the simulator moves its KV
(``sim/migration.py``), the gateway continues the stream on the re-routed target.

The plan comes from ``stage_sizes`` and ``bounds`` (instances taken in configuration order), or
— in the simulator, when they are empty — from the partition of §4.2 over the profile's fitted
QoE model and the workload's lengths (``layout``); a runtime may replace it with ``set_plan``
and move boundaries with ``set_bounds`` (range refinement, §4.3). Without a plan every instance
is one stage. The simulator-only settings (layout, refinement, bid-ask, transfers) are read by
``sim/migration.py``; the policy itself only routes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvroute.cascade.partition import stage_of
from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, View
from kvroute.policy.params import PolicyParams


class CascadeParams(PolicyParams):
    """Stage plan, the preset that picks within a stage, and the simulator's migration model."""

    inner: str = Field("least_load", description="preset that picks the instance within a stage")
    inner_params: dict[str, Any] = Field(default_factory=dict, description="params of the inner preset")
    stage_sizes: list[int] = Field(default_factory=list, description="instances per stage in length order, "
                                   "taken in configuration order; empty: planned (simulator) or one stage")
    bounds: list[int] = Field(default_factory=list, description="upper sequence length (tokens, exclusive) "
                              "of every stage but the last; strictly increasing")
    layout: Literal["dp", "heuristic", "chain", "no_pipeline"] = Field(
        "heuristic", description="simulator planning when stage_sizes is empty: exact DP, the two-phase "
        "heuristic (§4.2), one instance per stage, or one stage")
    refinement: Literal["adaptive", "equal_count", "equal_memory", "off"] = Field(
        "adaptive", description="simulator range refinement (§4.3): QoE split, or the naive equal-count / "
        "equal-memory splits, or fixed boundaries")
    refine_interval_s: float = Field(5.0, gt=0, description="simulator: seconds between range refinements")
    bidask: bool = Field(True, description="simulator: bid-ask hand-over and intra-stage rebalancing "
                         "(§4.4); false: hand over to the least loaded successor, no rebalancing")
    rebalance_interval_s: float = Field(1.0, gt=0, description="simulator: seconds between overload checks")
    transfer_gb_s: float = Field(25.0, gt=0, description="simulator: KV transfer bandwidth per migration, GB/s")
    max_transfers: int = Field(3, ge=1, description="simulator: concurrent KV transfers per instance (§5: 3)")

    @model_validator(mode="after")
    def _plan_shape(self) -> CascadeParams:
        if self.stage_sizes:
            if any(k < 1 for k in self.stage_sizes):
                raise ValueError("stage_sizes must be positive")
            if len(self.bounds) != len(self.stage_sizes) - 1:
                raise ValueError(f"bounds needs {len(self.stage_sizes) - 1} values (one per stage but the "
                                 f"last), got {len(self.bounds)}")
        elif self.bounds:
            raise ValueError("bounds without stage_sizes")
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:])) or any(b < 1 for b in self.bounds):
            raise ValueError("bounds must be positive and strictly increasing")
        return self


class CascadeInfer(Policy):
    """Length stages: the earliest stage covering the prompt, then the inner preset picks."""

    name = "cascadeinfer"
    source = "CascadeInfer §3.2 (route to the earliest covering stage), §4.2 (stage partition)"
    Params = CascadeParams
    params: CascadeParams

    def __init__(self, params: PolicyParams | None = None, seed: int = 0):
        super().__init__(params, seed)
        from kvroute.policy.registry import build_policy  # the registry imports this module

        p = self.params
        self.inner = build_policy(p.inner, dict(p.inner_params), seed=seed)
        self.uses_ring = self.inner.uses_ring
        self.listeners = self.inner.listeners
        self.stages: list[list[str]] = []  # endpoint ids per stage, in length order
        self.bounds: list[int] = list(p.bounds)
        self._stage: dict[str, int] = {}

    @property
    def reads_kv_usage(self) -> bool:
        """As the inner preset."""
        return self.inner.reads_kv_usage

    @property
    def reads_prefill_backlog(self) -> bool:
        """As the inner preset."""
        return self.inner.reads_prefill_backlog

    @property
    def planned(self) -> bool:
        """Whether a stage plan is in place (else the first decision makes one from the params)."""
        return bool(self.stages)

    def set_plan(self, stages: list[list[str]], bounds: list[int]) -> None:
        """Replace the plan: endpoint ids per stage in length order, and the stage bounds."""
        if len(bounds) != len(stages) - 1:
            raise ValueError(f"{len(stages)} stages need {len(stages) - 1} bounds, got {len(bounds)}")
        self.stages = [list(s) for s in stages]
        self.bounds = list(bounds)
        self._stage = {eid: i for i, ids in enumerate(self.stages) for eid in ids}

    def set_bounds(self, bounds: list[int]) -> None:
        """Move the stage boundaries (range refinement), keeping the stages' instances."""
        self.set_plan(self.stages, bounds)

    def plan_from_params(self, endpoint_ids: list[str]) -> None:
        """The plan ``stage_sizes``/``bounds`` describe over ``endpoint_ids`` (configuration order);
        one stage when they are empty. Instances beyond the sizes join the last stage."""
        sizes = self.params.stage_sizes or [len(endpoint_ids)]
        stages, i = [], 0
        for k in sizes:
            stages.append(endpoint_ids[i:i + k])
            i += k
        stages[-1].extend(endpoint_ids[i:])
        self.set_plan(stages, list(self.params.bounds))

    def stage(self, endpoint_id: str) -> int | None:
        """The stage ``endpoint_id`` serves in (None: not in the plan)."""
        return self._stage.get(endpoint_id)

    def context_limit(self, endpoint_id: str) -> int | None:
        """The end of the endpoint's stage range; None in the last stage."""
        s = self._stage.get(endpoint_id)
        if s is None or s >= len(self.bounds):
            return None
        return self.bounds[s]

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        """The earliest stage covering the prompt; its admitted instances go to the inner preset.

        When none of that stage's instances is admitted, later stages are tried (they serve
        longer sequences, so the request fits there), then earlier ones.
        """
        if not self.stages:
            self.plan_from_params([e.id for e in view.endpoints])
        want = stage_of(self.bounds, req.prompt_tokens)
        by_stage: dict[int, list[Endpoint]] = {}
        for e in eps:
            s = self._stage.get(e.id)
            if s is not None:
                by_stage.setdefault(s, []).append(e)
        order = [s for s in sorted(by_stage) if s >= want] + [s for s in sorted(by_stage, reverse=True) if s < want]
        if not order:
            return Decision.hold("no instance of any stage admits a request now")
        return self.inner.choose(req, by_stage[order[0]], view)
