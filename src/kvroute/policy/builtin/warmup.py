"""Warm-up: a way in for replicas whose cache is cold (added, recovered, restarted).

Cache-following rules never pick a replica that holds nothing: with a shared system prompt
every request matches the warm replicas, and a load rule that waits for an imbalance of 32
requests (SGLang's default) never fires at a few dozen users. Issue 12 saw a replica added
mid-run get 0 of 310 requests in 20 s under ``sglang_cache_aware`` and ``gorgo``.

The rule: an endpoint is *cold* when it is ``warming`` (the Router marks one that joins a fleet
whose index already holds blocks; the gateway marks one it re-admits or sees restart, as it
clears its index) and the prefix index holds fewer than ``fraction`` of the blocks the other
endpoints hold on average (at least ``min_blocks``). Only joining or returning counts: a
replica that holds little because the policy avoids it (a far one under GORGO's RTT term) is
left alone. A cold endpoint takes the request when it has
fewer requests in flight than every warm one — it fills up to the others' load, no further. Each
such request costs one cache miss; once the endpoint holds the shared prefixes, the cache rules
send it their followers, so its share grows by affinity rather than by this rule. Choice
(SGLang's router and SkyWalker are silent on cold replicas): the cold test reads the router's
own prefix index and a flag, not a clock, so the rule stays pure and the same in the simulator
and the gateway; the flag stays set, the index test ends the warm-up.
"""

from __future__ import annotations

from kvroute.model import Decision, Endpoint
from kvroute.policy.catalog import register_plugin
from kvroute.policy.plugins import DecisionState, Route

WARM_UP = "warm-up"  # the branch label


@register_plugin
class WarmUp(Route):
    """A cold endpoint (warming, its index under ``fraction`` of the others' mean, which is at
    least ``min_blocks``) takes the request while it has fewer in flight than every warm one."""

    name = "warm_up"
    inputs = frozenset({"prefix", "load"})

    def __init__(self, fraction: float = 0.25, min_blocks: int = 64):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if min_blocks < 1:
            raise ValueError(f"min_blocks must be at least 1, got {min_blocks}")
        self.fraction, self.min_blocks = fraction, min_blocks

    def route(self, st: DecisionState, eps: list[Endpoint]) -> Decision | None:
        """Dispatch to the least busy cold endpoint while it has fewer in flight than every warm one;
        otherwise None."""
        if len(eps) < 2:
            return None
        blocks = st.view.prefix.blocks
        held = [blocks(e.id) for e in eps]
        total = sum(held)
        n = len(eps)
        cold: Endpoint | None = None
        warm_load = None
        for e, h in zip(eps, held, strict=True):
            others = (total - h) / (n - 1)
            if e.warming and others >= self.min_blocks and h < self.fraction * others:
                if cold is None or e.inflight < cold.inflight:
                    cold = e
            elif warm_load is None or e.inflight < warm_load:
                warm_load = e.inflight
        if cold is None or warm_load is None or cold.inflight >= warm_load:
            return None
        return Decision.dispatch(cold.id, WARM_UP)
