"""``uniform_fleet``: holds while the load balancer's fleet is one region of one hardware kind, so ``auto`` may
route by tokens alone.

``auto``'s one-region rule ``auto:least-work`` (docs/auto.md) sends a request, among the replicas
LMetric's score ranks near its best, to the one with the least prefill work ahead of its first
token. Counting tokens is counting time only when every replica prefills a token in the same time:
on a fleet of mixed hardware the learned speeds (:mod:`kvroute.policy.adaptive.replica_speed`)
must decide instead. This condition keeps its own copy of that fit — fed by the same lifecycle
events with the same settings as ``auto``'s incumbent, so it reaches the same judgment at the same
event — and holds until the fit judges the fleet mixed (a judgment that then stands: a replica's
hardware does not change under its id), or from the start when the replicas' declared accelerators
differ by the datasheet rule the incumbent's prior uses (``replica_speed/datasheet.py``). With
``learn: false`` nothing is learned and the fleet is uniform by its hardware, as the incumbent then
treats it.

One region means every replica the load balancer sees (not only the candidates left after
``local_first``) within ``ms`` of each other's probe RTT. A load balancer that may send across
regions meets the other LBs' requests on the replicas it spills to, which it cannot count; there
LMetric's batch term is the safer guide (rag-3region at 70 % of the knee before its LBs shared
dispatches, 9 seeds: TTFT p99 2.83 s with it, 2.98 s with the least work).
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.replica_speed.datasheet import prior_times
from kvroute.policy.adaptive.replica_speed.fit import DEFAULT_HALFLIFE, SpeedFit
from kvroute.policy.adaptive.replica_speed.plugin import SpeedPlugin
from kvroute.policy.catalog import register_plugin
from kvroute.policy.plugins import Condition, DecisionState


@register_plugin
class UniformFleet(Condition, SpeedPlugin):
    """Holds while every replica the load balancer sees is within ``ms`` of probe RTT of the others, their
    declared accelerators (if any) are one kind, and the replica-speed fit (``min_samples``, ``spread``, ``z``
    as ``lmetric_speed``'s) has not judged the fleet mixed (with ``learn: false``: by RTT alone)."""

    name = "uniform_fleet"
    inputs = frozenset()

    def __init__(self, min_samples: int = 16, halflife: int = DEFAULT_HALFLIFE, spread: float = 1.5,
                 z: float = 2.0, learn: bool = True, ms: float = 10.0):
        SpeedPlugin.__init__(self, SpeedFit(min_samples=min_samples, halflife=halflife, spread=spread, z=z))
        if ms < 0:
            raise ValueError(f"ms must be >= 0, got {ms}")
        self.learn, self.ms = learn, ms
        # a pure function of the fleet's declared accelerators, cached: (their key, whether they differ)
        self._declared: tuple[tuple[tuple[str, str], ...], bool] = ((), False)

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True while the whole fleet is one region and the learned prefill and decode times have not both spread
        past ``spread``."""
        if self.learn and self.fit.judged_mixed:
            return False
        eps = st.view.endpoints
        if self.learn:
            key = tuple((e.id, e.accelerator) for e in eps if e.accelerator is not None)
            if key != self._declared[0]:
                self._declared = (key, bool(prior_times(dict(key), self.fit.spread)))
            if self._declared[1]:
                return False  # declared hardware apart: the incumbent's datasheet prior is in use
        rtts = [e.rtt_s for e in eps]
        return not rtts or (max(rtts) - min(rtts)) * 1000.0 <= self.ms

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Learns only with ``learn``."""
        if self.learn:
            SpeedPlugin.on_dispatched(self, req, endpoint, new_prefill_tokens)

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Learns only with ``learn``."""
        if self.learn:
            SpeedPlugin.on_first_token(self, req_id, endpoint_id, ttft_s)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Learns only with ``learn``."""
        if self.learn:
            SpeedPlugin.on_finished(self, req_id, endpoint_id, e2e_s, output_tokens)

    def state(self) -> dict[str, float]:
        """``mixed``: 1 once the learned speeds judged the fleet mixed or while its declared accelerators differ
        (the rule it guards then stands aside)."""
        return {"mixed": float(self.learn and (self.fit.judged_mixed or self._declared[1]))}
