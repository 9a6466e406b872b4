"""NVIDIA Dynamo's KV router cost."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams

COST = {"prefill_blocks": "$overlap_weight", "decode_blocks": 1}


@register_preset(
    "dynamo_kv", source="NVIDIA Dynamo KV router (overlap_weight 1.0, temperature 0)",
    rules=[{"enabled": "$sampled", "cost": COST, "picker": {"softmax_cost": "$temperature"},
            "branch": Branch.SOFTMAX}],
    cost=COST, branch=Branch.MIN_COST)
class DynamoParams(PolicyParams):
    """Minimise overlap_weight × prefill blocks + decode blocks (optionally softmax-sampled).

    Prefill blocks: this request's uncached blocks plus the endpoint's queued prefill backlog.
    Decode blocks: blocks of requests active on the endpoint plus this request's. Both are
    router-tracked, as in Dynamo. With temperature > 0 the costs are normalised by the largest
    and sampled with probability ∝ exp(−cost / T).
    """

    overlap_weight: float = Field(1.0, ge=0.0, description="weight of prefill blocks in the cost")
    temperature: float = Field(0.0, ge=0.0, description="0: argmin; >0: softmax sampling")

    @property
    def sampled(self) -> bool:
        """Whether costs are sampled (temperature > 0) rather than minimised."""
        return self.temperature > 0
