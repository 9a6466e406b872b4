"""Load-only baselines: round robin, random, least request, least load, power of two."""

from __future__ import annotations

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams


@register_preset("round_robin", source="SGLang router `round_robin`; vLLM production-stack `roundrobin`",
                 picker="round_robin", branch=Branch.ROUND_ROBIN)
class RoundRobinParams(PolicyParams):
    """Cycle through the admitted endpoints in order."""


@register_preset("random", source="SGLang router `random`; AIBrix `random`",
                 picker="weighted_random", branch=Branch.RANDOM)
class RandomParams(PolicyParams):
    """Uniformly random endpoint, weighted by the endpoint's configured weight."""


@register_preset("least_request", source="SkyWalker baseline LL; GORGO v2 baseline least-request; "
                 "AIBrix `least-request`", cost={"inflight": 1}, branch=Branch.LEAST_REQUEST)
class LeastRequestParams(PolicyParams):
    """Fewest in-flight requests (router-side count), random tie-break."""


@register_preset("least_load", source="GORGO v2 baseline least-load (queued + running + used tokens); "
                 "SGLang token load", cost={"inflight_tokens": 1, "batch_size": 1e-6}, branch=Branch.LEAST_LOAD)
class LeastLoadParams(PolicyParams):
    """Fewest outstanding tokens: in-flight prompt tokens, the engine's batch as tie-break."""


@register_preset("power_of_two", source="Mitzenmacher, power of two choices; SGLang router `power_of_two`; "
                 "AIBrix `p2c`", cost={"inflight": 1}, picker="power_of_two", branch=Branch.POWER_OF_TWO)
class PowerOfTwoParams(PolicyParams):
    """Sample two endpoints at random, send to the one with fewer in-flight requests."""
