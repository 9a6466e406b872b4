"""Pickers: choose one endpoint from the candidates (and their combined values)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.model import Endpoint
from kvroute.policy.base import argmax, argmin, softmax_pick
from kvroute.policy.catalog import register_plugin
from kvroute.policy.plugins import DecisionState, Picker
from kvroute.policy.state import Turns


@register_plugin
class ArgMin(Picker):
    """The smallest value; ties broken at random."""

    name = "argmin"

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """The endpoint with the smallest value, a random one among equals (seeded ``st.rng``)."""
        return argmin(eps, values, st.rng)


@register_plugin
class ArgMax(Picker):
    """The largest value; ties broken at random."""

    name = "argmax"
    minimises = False

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """The endpoint with the largest value, a random one among equals (seeded ``st.rng``)."""
        return argmax(eps, values, st.rng)


def _temperature(t: float) -> float:
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {t}")
    return float(t)


@register_plugin
class Softmax(Picker):
    """Sample with probability ∝ exp(value / ``temperature``) (higher values are likelier)."""

    name = "softmax"
    minimises = False

    def __init__(self, temperature: float = 0.1):
        self.temperature = _temperature(temperature)

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """One endpoint drawn from the softmax of ``values`` at this temperature."""
        return softmax_pick(eps, values, self.temperature, st.rng)


@register_plugin
class SoftmaxCost(Picker):
    """Sample with probability ∝ exp(−cost / max cost / ``temperature``) (Dynamo's sampling)."""

    name = "softmax_cost"

    def __init__(self, temperature: float = 0.1):
        self.temperature = _temperature(temperature)

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """One endpoint drawn from the softmax of the negated costs, scaled by the largest cost."""
        scale = max(values) or 1.0
        return softmax_pick(eps, [-c / scale for c in values], self.temperature, st.rng)


@register_plugin
class PowerOfTwo(Picker):
    """Sample two candidates at random and take the one with the smaller value (the first on a
    tie): Mitzenmacher's power of two choices."""

    name = "power_of_two"

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """The better of two distinct candidates drawn at random (the only one when there is one)."""
        if len(eps) == 1:
            return eps[0]
        i, j = st.rng.sample(range(len(eps)), 2)
        return eps[i] if values[i] <= values[j] else eps[j]


@register_plugin
class RoundRobin(Picker):
    """The candidates in turn (a counter over decisions, modulo the number of candidates)."""

    name = "round_robin"
    needs_values = False

    def __init__(self) -> None:
        self._turns = Turns()  # the counter, compiled (policy/state.py)
        # a rule takes the turn from ``turns`` itself, without calling pick (compose.Rule.apply), unless a
        # subclass has its own pick
        self.turns: Turns | None = self._turns if type(self).pick is RoundRobin.pick else None

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """The next candidate in turn; ``values`` is ignored."""
        return self._turns.pick(st, eps)


@register_plugin
class WeightedRandom(Picker):
    """At random, in proportion to each endpoint's configured weight."""

    name = "weighted_random"
    needs_values = False

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """One candidate drawn in proportion to ``Endpoint.weight``; ``values`` is ignored."""
        return st.rng.choices(eps, weights=[e.weight for e in eps], k=1)[0]


@register_plugin
class Ring(Picker):
    """The owner of the request's routing key on the consistent-hash ring, clockwise past the
    endpoints that are not candidates; declines when the request has no key."""

    name = "ring"
    needs_values = False
    inputs = frozenset({"ring"})
    uses_ring = True

    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """The ring owner of ``routing_key`` among ``eps``; None without a key or when no candidate owns it."""
        key = st.req.routing_key
        if key is None:
            return None
        view = st.view
        allowed = {e.id for e in eps} if len(eps) != len(view.endpoints) else None
        target = view.ring.lookup(key, allowed)
        if target is None:
            return None
        return next(e for e in eps if e.id == target)
