"""Conditions: when a rule applies."""

from __future__ import annotations

from typing import Literal

from kvroute.model import Endpoint
from kvroute.policy.catalog import register_plugin
from kvroute.policy.plugins import Condition, DecisionState


@register_plugin
class Imbalanced(Condition):
    """Load is imbalanced: max − min > ``abs`` and max > ``rel`` × min, over ``load`` (the
    router's in-flight count, or the engine batch size)."""

    name = "imbalanced"
    inputs = frozenset({"load"})

    def __init__(self, abs: float = 32, rel: float = 1.0, load: Literal["inflight", "batch_size"] = "inflight"):
        if load not in ("inflight", "batch_size"):
            raise ValueError(f"load must be 'inflight' or 'batch_size', got {load!r}")
        self.abs, self.rel, self.load = abs, rel, load

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when the most and least loaded candidates differ by more than ``abs`` and the most
        loaded carries more than ``rel`` × the least."""
        if self.load == "inflight":
            loads = [e.inflight for e in eps]
        else:
            loads = [e.running + e.waiting + e.dispatched_since_probe for e in eps]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs and hi > self.rel * lo


@register_plugin
class HitRatioAtLeast(Condition):
    """The best match among the candidates covers at least ``threshold`` of the prompt (and is
    not empty)."""

    name = "hit_ratio_at_least"
    inputs = frozenset({"prefix"})

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when some candidate matched and the best match covers ≥ ``threshold`` of the prompt."""
        best = st.best_match(eps)
        return bool(best) and st.req.hit_ratio(best) >= self.threshold


@register_plugin
class HitRatioAbove(Condition):
    """The best match among the candidates covers more than ``threshold`` of the prompt."""

    name = "hit_ratio_above"
    inputs = frozenset({"prefix"})

    def __init__(self, threshold: float = 0.5):
        self.threshold = threshold

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when the best match among ``eps`` covers more than ``threshold`` of the prompt."""
        return st.hit_ratio(eps) > self.threshold


@register_plugin
class RttSpreadAbove(Condition):
    """The candidates' measured round-trip times differ by more than ``ms`` milliseconds: they sit in
    different regions as seen from this load balancer, so where a request goes costs network time
    (GORGO §3's RTT term matters; within one region it is noise)."""

    name = "rtt_spread_above"
    inputs = frozenset({"rtt"})

    def __init__(self, ms: float = 10.0):
        self.ms = ms

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when max − min of the candidates' probe RTTs exceeds ``ms``."""
        rtts = [e.rtt_s for e in eps]
        return 1000.0 * (max(rtts) - min(rtts)) > self.ms


@register_plugin
class RttSpreadAtMost(RttSpreadAbove):
    """The negation of ``rtt_spread_above``: the candidates' probe RTTs differ by at most ``ms``
    milliseconds — one region as seen from this load balancer (``auto`` trials a different
    challenger there than across regions)."""

    name = "rtt_spread_at_most"

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when max − min of the candidates' probe RTTs is at most ``ms``."""
        return not super().holds(st, eps)
