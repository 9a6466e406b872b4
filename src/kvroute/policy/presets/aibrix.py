"""AIBrix's prefix-cache router."""

from __future__ import annotations

import statistics

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain


class AIBrixParams(PolicyParams):
    imbalance_range: int = Field(8, ge=0, description="max − min batch size that counts as imbalance")
    std_factor: float = Field(1.0, ge=0.0, description="accept running ≤ mean + factor × σ")


class AIBrixPrefixCache(Policy):
    """Batch-size range > 8 → least loaded; else best prefix match whose load is ≤ mean + σ.

    Candidates holding any prefix are ordered by match percentage (descending) then batch size
    (ascending); the first within mean + 1σ of the pool's batch sizes wins. No candidate →
    least loaded. AIBrix's code uses a range of 8 (its README says 16).
    """

    name = "aibrix_prefix_cache"
    source = "AIBrix gateway prefix-cache router (pkg/plugins/gateway/algorithms/prefix_cache.go)"
    Params = AIBrixParams
    params: AIBrixParams  # narrows Policy.params: always an instance of Params

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        loads = [e.batch_size for e in eps]
        if max(loads) - min(loads) > self.params.imbalance_range:
            ep = argmin(eps, loads, self.rng)
            return Decision.dispatch(ep.id, "imbalance-fallback", scores=explain(eps, loads))
        matches = view.prefix.match(req.block_hashes)
        if matches:
            limit = statistics.fmean(loads) + self.params.std_factor * statistics.pstdev(loads)
            ranked = sorted((e for e in eps if e.id in matches),
                            key=lambda e: (-matches[e.id], e.batch_size))
            for ep in ranked:
                if ep.batch_size <= limit:
                    return Decision.dispatch(ep.id, "prefix-hit", matches[ep.id],
                                             explain(eps, [matches.get(e.id, 0) for e in eps]))
        ep = argmin(eps, loads, self.rng)
        return Decision.dispatch(ep.id, "prefix-miss", matches.get(ep.id, 0), explain(eps, loads))
