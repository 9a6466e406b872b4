"""LMetric: new prefill tokens × batch size, no hyper-parameters."""

from __future__ import annotations

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, View, argmin, explain


class LMetric(Policy):
    """Minimise (queued prefill + this request's new prefill tokens) × (batch size + 1).

    New prefill tokens are the prompt minus its cached prefix on the endpoint; queued prefill is
    the router's backlog of dispatched-but-not-prefilled tokens there; batch size is running +
    waiting (LMetric §4, Figure 17). The +1 keeps idle endpoints comparable by their P-tokens
    (blitz-router's lmetric.rs does the same).
    """

    name = "lmetric"
    source = "LMetric §4 (P-tokens × BS); blitz-serving/blitz-router policies/lmetric.rs"

    @property
    def reads_prefill_backlog(self) -> bool:
        return True

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        matches = view.prefix.match(req.block_hashes)
        p, bt = req.prompt_tokens, req.block_tokens
        get = matches.get
        # (e.batch_size inlined: this line runs per endpoint per decision)
        scores = [(e.queued_prefill_tokens + (p if (m := get(e.id)) is None else max(0, p - bt * m)))
                  * (e.running + e.waiting + e.dispatched_since_probe + 1) for e in eps]
        ep = argmin(eps, scores, self.rng)
        return Decision.dispatch(ep.id, "min-score", matches.get(ep.id, 0), explain(eps, scores))
