"""SGLang router's cache-aware policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain


class CacheAwareParams(PolicyParams):
    cache_threshold: float = Field(0.5, ge=0.0, le=1.0, description="match rate to follow the cache")
    balance_abs: int = Field(32, ge=0, description="imbalanced if max − min load exceeds this ...")
    balance_rel: float = Field(1.0001, ge=1.0, description="... and max exceeds rel × min")
    miss: Literal["least_load", "smallest_tree"] = Field(
        "least_load", description="where a cache miss goes: least_load (SGLang today, default) or "
        "smallest_tree (the SGLang router SkyWalker compared against)")


class SGLangCacheAware(Policy):
    """Load imbalance → least loaded; else longest prefix match if its rate clears 0.5.

    Imbalance needs *both* max − min > balance_abs and max > balance_rel × min. On a miss
    SGLang originally took the smallest tree (the endpoint whose approximate tree holds the
    fewest entries; here the fewest indexed blocks), which can overload a replica in a "death
    spiral" (SGLang PR #14305); later versions take the least-loaded endpoint. Both exist as
    ``miss``: ``least_load`` is the default, ``smallest_tree`` is the router SkyWalker's
    evaluation ran against. Load is the router's in-flight count; match rate is in blocks
    rather than characters.
    """

    name = "sglang_cache_aware"
    source = "SGLang router cache_aware (py CLI defaults: threshold 0.5, abs 32, rel 1.0001)"
    Params = CacheAwareParams
    params: CacheAwareParams  # narrows Policy.params: always an instance of Params

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        p = self.params
        loads = [e.inflight for e in eps]
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs and hi > p.balance_rel * lo:
            ep = argmin(eps, loads, self.rng)
            return Decision.dispatch(ep.id, "imbalance-fallback", scores=explain(eps, loads))
        matches = view.prefix.match(req.block_hashes)
        if matches:
            values = [matches.get(e.id, 0) for e in eps]
            best = max(values)
            if req.hit_ratio(best) > p.cache_threshold:
                tied = [e for e, v in zip(eps, values) if v == best]
                ep = argmin(tied, [e.inflight for e in tied], self.rng)
                return Decision.dispatch(ep.id, "prefix-hit", best, explain(eps, values))
        if p.miss == "smallest_tree":
            sizes = [view.prefix.blocks(e.id) for e in eps]
            ep = argmin(eps, sizes, self.rng)
            return Decision.dispatch(ep.id, "prefix-miss", matches.get(ep.id, 0), explain(eps, sizes))
        ep = argmin(eps, loads, self.rng)
        return Decision.dispatch(ep.id, "prefix-miss", matches.get(ep.id, 0),
                                 explain(eps, loads))
