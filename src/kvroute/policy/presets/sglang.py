"""SGLang router's cache-aware policy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.builtin.warmup import WARM_UP
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams


@register_preset(
    "sglang_cache_aware", source="SGLang router cache_aware (py CLI defaults: threshold 0.5, abs 32, rel 1.0001)",
    rules=[{"enabled": "$warm_up", "route": "warm_up", "branch": WARM_UP},
           {"when": {"imbalanced": {"abs": "$balance_abs", "rel": "$balance_rel"}},
            "cost": {"inflight": 1}, "branch": Branch.IMBALANCE},
           {"when": {"hit_ratio_above": "$cache_threshold"}, "among": "best_prefix",
            "cost": {"inflight": 1}, "branch": Branch.PREFIX_HIT},
           {"enabled": "$smallest_tree", "cost": {"tree_size": 1}, "branch": Branch.PREFIX_MISS}],
    cost={"inflight": 1}, branch=Branch.PREFIX_MISS)
class CacheAwareParams(PolicyParams):
    """Load imbalance → least loaded; else longest prefix match if its rate clears 0.5.

    Imbalance needs *both* max − min > balance_abs and max > balance_rel × min. On a miss
    SGLang originally took the smallest tree (the endpoint whose approximate tree holds the
    fewest entries; here the fewest indexed blocks), which can overload a replica in a "death
    spiral" (SGLang PR #14305); later versions take the least-loaded endpoint. Both exist as
    ``miss``: ``least_load`` is the default, ``smallest_tree`` is the router SkyWalker's
    evaluation ran against. Load is the router's in-flight count; match rate is in blocks
    rather than characters.
    """

    cache_threshold: float = Field(0.5, ge=0.0, le=1.0, description="match rate to follow the cache")
    balance_abs: int = Field(32, ge=0, description="imbalanced if max − min load exceeds this ...")
    balance_rel: float = Field(1.0001, ge=1.0, description="... and max exceeds rel × min")
    miss: Literal["least_load", "smallest_tree"] = Field(
        "least_load", description="where a cache miss goes: least_load (SGLang today, default) or "
        "smallest_tree (the SGLang router SkyWalker compared against)")
    warm_up: bool = Field(False, description="a replica with a cold cache (added, recovered) takes requests while "
                          "it has fewer in flight than every warm one (policy/builtin/warmup.py; issue 12); off: "
                          "SGLang's cache_aware router has no such rule: a miss goes to the least loaded "
                          "(or smallest-tree) worker")

    @property
    def smallest_tree(self) -> bool:
        """Whether a miss goes to the smallest tree."""
        return self.miss == "smallest_tree"
