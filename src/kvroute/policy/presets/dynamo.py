"""NVIDIA Dynamo's KV router cost."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain, softmax_pick


class DynamoParams(PolicyParams):
    overlap_weight: float = Field(1.0, ge=0.0, description="weight of prefill blocks in the cost")
    temperature: float = Field(0.0, ge=0.0, description="0: argmin; >0: softmax sampling")


class DynamoKV(Policy):
    """Minimise overlap_weight × prefill blocks + decode blocks (optionally softmax-sampled).

    Prefill blocks: this request's uncached blocks plus the endpoint's queued prefill backlog.
    Decode blocks: blocks of requests active on the endpoint plus this request's. Both are
    router-tracked, as in Dynamo. With temperature > 0 the costs are normalised by the largest
    and sampled with probability ∝ exp(−cost / T).
    """

    name = "dynamo_kv"
    source = "NVIDIA Dynamo KV router (overlap_weight 1.0, temperature 0)"
    Params = DynamoParams
    params: DynamoParams  # narrows Policy.params: always an instance of Params

    @property
    def reads_prefill_backlog(self) -> bool:
        return True

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        bt = req.block_tokens
        w = self.params.overlap_weight
        matches = view.prefix.match(req.block_hashes)
        p = req.prompt_tokens
        get = matches.get
        costs = [(w * ((p if (m := get(e.id)) is None else max(0, p - bt * m)) + e.queued_prefill_tokens)
                  + e.inflight_tokens + p) / bt for e in eps]
        t = self.params.temperature
        if t > 0:
            scale = max(costs) or 1.0
            ep = softmax_pick(eps, [-c / scale for c in costs], t, self.rng)
            branch = "softmax"
        else:
            ep = argmin(eps, costs, self.rng)
            branch = "min-cost"
        return Decision.dispatch(ep.id, branch, matches.get(ep.id, 0), explain(eps, costs))
