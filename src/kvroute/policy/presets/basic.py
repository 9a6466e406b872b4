"""Load-only baselines: round robin, random, least request, least load, power of two."""

from __future__ import annotations

from abc import abstractmethod

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain


class RoundRobin(Policy):
    """Cycle through the admitted endpoints in order."""

    name = "round_robin"
    source = "SGLang router `round_robin`; vLLM production-stack `roundrobin`"

    def __init__(self, params: PolicyParams | None = None, seed: int = 0) -> None:
        super().__init__(params, seed)
        self._next = 0

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        ep = eps[self._next % len(eps)]
        self._next += 1
        return Decision.dispatch(ep.id, "rr")


class RandomPolicy(Policy):
    """Uniformly random endpoint, weighted by the endpoint's configured weight."""

    name = "random"
    source = "SGLang router `random`; AIBrix `random`"

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        ep = self.rng.choices(eps, weights=[e.weight for e in eps], k=1)[0]
        return Decision.dispatch(ep.id, "random")


class MinLoad(Policy):
    """Base of the load-only arg-min presets: the endpoint with the smallest ``load``."""

    branch = ""

    @staticmethod
    @abstractmethod
    def load(e: Endpoint) -> float:
        """The quantity to minimise."""

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        values = list(map(self.load, eps))
        ep = argmin(eps, values, self.rng)
        return Decision.dispatch(ep.id, self.branch, scores=explain(eps, values))


class LeastRequest(MinLoad):
    """Fewest in-flight requests (router-side count), random tie-break."""

    name = "least_request"
    source = "SkyWalker baseline LL; GORGO v2 baseline least-request; AIBrix `least-request`"
    branch = "least-request"

    @staticmethod
    def load(e: Endpoint) -> float:
        return e.inflight


class LeastLoad(MinLoad):
    """Fewest outstanding tokens: in-flight prompt tokens plus the engine's batch as tie-break."""

    name = "least_load"
    source = "GORGO v2 baseline least-load (queued + running + used tokens); SGLang token load"
    branch = "least-load"

    @staticmethod
    def load(e: Endpoint) -> float:
        return e.inflight_tokens + e.batch_size * 1e-6


class PowerOfTwo(Policy):
    """Sample two endpoints at random, send to the one with fewer in-flight requests."""

    name = "power_of_two"
    source = "Mitzenmacher, power of two choices; SGLang router `power_of_two`; AIBrix `p2c`"

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        if len(eps) == 1:
            return Decision.dispatch(eps[0].id, "p2c")
        a, b = self.rng.sample(eps, 2)
        ep = a if a.inflight <= b.inflight else b
        return Decision.dispatch(ep.id, "p2c", scores=explain([a, b], [a.inflight, b.inflight]))
