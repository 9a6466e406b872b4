"""``uniform_fleet``: the trust region (``near_best``) while the load balancer's fleet is one region of one
hardware kind, and no candidate otherwise — so ``auto`` routes by tokens alone only where tokens are time.

``auto``'s one-region rule ``auto:least-work`` (docs/auto.md) sends a request, among the replicas
LMetric's score ranks near its best, to the one with the least prefill work ahead of its first
token. Counting tokens is counting time only when every replica prefills a token in the same time:
on a fleet of mixed hardware the learned speeds (:mod:`kvroute.policy.adaptive.replica_speed`)
must decide instead. The trust region's own scorer (``lmetric_speed``, with the incumbent's settings
and fed the same lifecycle events, so it reaches the same judgment at the same event) already learns
them; this filter reads its judgment rather than keeping another copy of the fit (a fit is refreshed
at every first token and completion). It keeps no candidate — the rule declines and the next one
routes — once the fit judges the fleet mixed (a judgment that then stands: a replica's hardware does
not change under its id), or from the start when the replicas' declared accelerators differ by the
datasheet rule of the incumbent's prior (``replica_speed/datasheet.py``). With ``learn: false``
nothing is learned and the fleet is uniform by its hardware, as the incumbent then treats it.

One region means every replica the load balancer sees (not only the candidates left after
``local_first``) within ``ms`` of each other's probe RTT. A load balancer that may send across
regions meets the other LBs' requests on the replicas it spills to, which it cannot count; there
LMetric's batch term is the safer guide (rag-3region at 70 % of the knee before its LBs shared
dispatches, 9 seeds: TTFT p99 2.83 s with it, 2.98 s with the least work).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.replica_speed.plugin import SpeedLMetric
from kvroute.policy.catalog import PLUGINS, register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Filter


@register_plugin
class UniformFleet(Filter, Lifecycle):
    """``near_best`` while every replica the load balancer sees is within ``ms`` of probe RTT of the others
    and its scorer (``lmetric_speed``) neither learned nor was told (declared accelerators) that the fleet is
    mixed; no candidate otherwise."""

    name = "uniform_fleet"
    inputs = frozenset({"prefix", "prefill_backlog", "load", "rtt"})

    def __init__(self, scorer: str | Mapping[str, Mapping[str, Any] | None] = "lmetric_speed", factor: float = 2.0,
                 ms: float = 10.0):
        if ms < 0:
            raise ValueError(f"ms must be >= 0, got {ms}")
        # near_best from the registry (builtin/ is not imported from adaptive/: the packages stay acyclic)
        near_best: Any = PLUGINS["filter"]["near_best"]
        self.near: Any = near_best(scorer=scorer, factor=factor)
        self.scorer, self.factor, self.ms = self.near.scorer, factor, ms
        self._speed = self.scorer if isinstance(self.scorer, SpeedLMetric) else None
        self.mixed = False  # the last decision found the fleet mixed (state)

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Forwarded to the trust region (its scorer learns)."""
        self.near.on_dispatched(req, endpoint, new_prefill_tokens)

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Forwarded to the trust region."""
        self.near.on_first_token(req_id, endpoint_id, ttft_s)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Forwarded to the trust region."""
        self.near.on_finished(req_id, endpoint_id, e2e_s, output_tokens)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """Forwarded to the trust region."""
        self.near.on_failed(req_id, endpoint_id)

    def uniform(self, st: DecisionState) -> bool:
        """True while the whole fleet is one region and one hardware kind (learned and declared)."""
        eps = st.view.endpoints
        sp = self._speed
        mixed = sp is not None and sp.learn and (sp.fit.judged_mixed or bool(sp.prior(eps)))
        if mixed != self.mixed:
            st.defer(lambda: setattr(self, "mixed", mixed))
        if mixed:
            return False
        rtts = [e.rtt_s for e in eps]
        return not rtts or (max(rtts) - min(rtts)) * 1000.0 <= self.ms

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The near-best of ``eps`` on a uniform fleet, else none (the rule declines)."""
        return self.near.filter(st, eps) if self.uniform(st) else []

    def state(self) -> dict[str, float]:
        """``mixed``: 1 once a decision found the fleet mixed, learned or declared (the rule then stands aside)."""
        return {"mixed": float(self.mixed)}
