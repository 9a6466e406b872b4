"""AIBrix's prefix-cache router."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams


@register_preset(
    "aibrix_prefix_cache", source="AIBrix gateway prefix-cache router (pkg/plugins/gateway/algorithms/prefix_cache.go)",
    rules=[{"when": {"imbalanced": {"abs": "$imbalance_range", "rel": 1.0, "load": "batch_size"}},
            "cost": {"batch_size": 1}, "branch": Branch.IMBALANCE},
           {"among": {"cached_within_spread": "$std_factor"},
            "cost": {"prefix_blocks": -1, "batch_size": 1e-6}, "branch": Branch.PREFIX_HIT}],
    cost={"batch_size": 1}, branch=Branch.PREFIX_MISS)
class AIBrixParams(PolicyParams):
    """Batch-size range > 8 → least loaded; else best prefix match whose load is ≤ mean + σ.

    Candidates holding any prefix are ordered by match (descending) then batch size
    (ascending); the first within mean + 1σ of the pool's batch sizes wins (written as the cost
    −blocks + 10⁻⁶ × batch, so an exact tie is broken at random rather than by list order). No
    candidate → least loaded. AIBrix's code uses a range of 8 (its README says 16).
    """

    imbalance_range: int = Field(8, ge=0, description="max − min batch size that counts as imbalance")
    std_factor: float = Field(1.0, ge=0.0, description="accept running ≤ mean + factor × σ")
