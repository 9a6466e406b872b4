"""GORGO: an additive TTFT cost of network RTT, residual prefill and queue wait."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain


class GorgoParams(PolicyParams):
    w_rtt: float = Field(0.5, ge=0.0, description="weight of RTT in ms (v2 start 0.5, learned 0.276)")
    t_p: float = Field(1.0, ge=0.0, description="cost per uncached prompt token (v2 prefill_rate)")
    w_queue: float = Field(0.1, ge=0.0, description="weight of queued tokens (v2 start 0.1, learned 0.5)")


class Gorgo(Policy):
    """Minimise w_rtt·RTT_ms + t_p·uncached tokens + w_queue·queued tokens.

    Uncached tokens are the prompt minus its longest cached prefix on the endpoint; queued tokens
    are the prompt tokens the router has dispatched there and not yet seen complete (GORGO v2's
    proxy accounting). Weights are static here at v2's starting point; online tuning is the
    (1+1)-ES of GORGO v2, built on top of this scorer. For v1's millisecond form set
    t_p = w_queue = 0.094 (ms per token, 8xA100 Mistral-7B) and w_rtt = 1.
    """

    name = "gorgo"
    source = "GORGO v1 §3 cost; GORGO v2 gorgo/policy/gorgo.py (rtt 0.5, queue 0.1, prefill 1.0)"
    Params = GorgoParams
    params: GorgoParams  # narrows Policy.params: always an instance of Params

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        p = self.params
        matches = view.prefix.match(req.block_hashes)
        tokens, bt = req.prompt_tokens, req.block_tokens
        w_rtt_ms, t_p, w_queue = p.w_rtt * 1000.0, p.t_p, p.w_queue
        get = matches.get
        costs = [w_rtt_ms * e.rtt_s + t_p * (tokens if (m := get(e.id)) is None else max(0, tokens - bt * m))
                 + w_queue * e.inflight_tokens for e in eps]
        ep = argmin(eps, costs, self.rng)
        return Decision.dispatch(ep.id, "min-cost", matches.get(ep.id, 0), explain(eps, costs))
