"""vLLM's join-shortest-queue and Bailian's linear KV/load blend (LMetric §3 baselines)."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams


@register_preset("vllm_jsq", source="LMetric §3 (vLLM policy: Q-BS + R-BS); vLLM production-stack",
                 cost={"batch_size": 1}, branch=Branch.JSQ)
class JSQParams(PolicyParams):
    """Smallest batch: running + waiting requests (as probed, plus dispatches since the probe)."""


@register_preset("bailian_linear", source="LMetric §3, Figure 6(b): Bailian's KV-aware retrofit of vLLM "
                 "(λ tuned 0.55–0.7)", score={"prefix": "$lam", "batch_headroom": "$load_weight"},
                 branch=Branch.LINEAR)
class BailianParams(PolicyParams):
    """Maximise λ·hit ratio + (1 − λ)·(1 − batch size / largest batch size)."""

    lam: float = Field(0.6, ge=0.0, le=1.0, description="weight of KV hit ratio (paper: 0.55–0.7)")

    @property
    def load_weight(self) -> float:
        """1 − λ: the weight of the load term."""
        return 1.0 - self.lam
