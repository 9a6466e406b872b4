"""vLLM's join-shortest-queue and Bailian's linear KV/load blend (LMetric §3 baselines)."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, PolicyParams, View, argmax, explain
from kvroute.policy.presets.basic import MinLoad


class VLLMJoinShortestQueue(MinLoad):
    """Smallest batch: running + waiting requests (as probed, plus dispatches since the probe)."""

    name = "vllm_jsq"
    source = "LMetric §3 (vLLM policy: Q-BS + R-BS); vLLM production-stack"
    branch = "jsq"

    @staticmethod
    def load(e: Endpoint) -> float:
        return e.batch_size


class BailianParams(PolicyParams):
    lam: float = Field(0.6, ge=0.0, le=1.0, description="weight of KV hit ratio (paper: 0.55–0.7)")


class BailianLinear(Policy):
    """Maximise λ·hit ratio + (1 − λ)·(1 − batch size / largest batch size)."""

    name = "bailian_linear"
    source = "LMetric §3, Figure 6(b): Bailian's KV-aware retrofit of vLLM (λ tuned 0.55–0.7)"
    Params = BailianParams
    params: BailianParams  # narrows Policy.params: always an instance of Params

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        lam = self.params.lam
        matches = view.prefix.match(req.block_hashes)
        top = max(1, max(e.batch_size for e in eps))
        per_block = lam * req.hit_ratio(1)  # λ × the share of the prompt one cached block covers
        load = (1 - lam) / top
        values = [per_block * matches.get(e.id, 0) + (1 - lam) - load * e.batch_size for e in eps]
        ep = argmax(eps, values, self.rng)
        return Decision.dispatch(ep.id, "linear", matches.get(ep.id, 0), explain(eps, values))
