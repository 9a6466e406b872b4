"""GORGO: an additive TTFT cost of network RTT, residual prefill and queue wait."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.adaptive.plugins import CalibrationPlugin
from kvroute.policy.adaptive.ttft_fit import TTFTFit
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain


class GorgoParams(PolicyParams):
    """GORGO's weights; ``calibrate`` swaps the constant t_p and w_queue for fitted ones."""

    w_rtt: float = Field(0.5, ge=0.0, description="weight of RTT in ms (v2 start 0.5, learned 0.276)")
    t_p: float = Field(1.0, ge=0.0, description="cost per uncached prompt token (v2 prefill_rate)")
    w_queue: float = Field(0.1, ge=0.0, description="weight of queued tokens (v2 start 0.1, learned 0.5)")
    calibrate: bool = Field(False, description="GORGO v1 calibration: fit TTFT − RTT per replica online "
                            "(intercept + ms per uncached token + ms per queued token, recursive least "
                            "squares on observed first tokens) and use it instead of t_p and w_queue; "
                            "costs are then in ms (set w_rtt 1; t_p and w_queue, in ms per token, "
                            "serve a replica until it has calibration_min_samples observations)")
    calibration_min_samples: int = Field(8, ge=3, description="observations before a replica's fit is used")


class Gorgo(Policy):
    """Minimise w_rtt·RTT_ms + t_p·uncached tokens + w_queue·queued tokens.

    Uncached tokens are the prompt minus its longest cached prefix on the endpoint; queued tokens
    are the prompt tokens the router has dispatched there and not yet seen complete (GORGO v2's
    proxy accounting). Weights are static here at v2's starting point; ``gorgo_tuned`` learns
    them online with v2's (1+1)-ES. For v1's millisecond form set t_p = w_queue = 0.094 (ms per
    token, 8xA100 Mistral-7B) and w_rtt = 1; with ``calibrate`` the per-token costs and a
    per-replica intercept are fitted from observed TTFTs (v1 §4.2's regression, done online).
    """

    name = "gorgo"
    source = "GORGO v1 §3 cost; GORGO v2 gorgo/policy/gorgo.py (rtt 0.5, queue 0.1, prefill 1.0)"
    Params = GorgoParams
    params: GorgoParams  # narrows Policy.params: always an instance of Params

    def __init__(self, params: PolicyParams | None = None, seed: int = 0):
        super().__init__(params, seed)
        self.fit: TTFTFit | None = None
        if self.params.calibrate:
            self.fit = TTFTFit(min_samples=self.params.calibration_min_samples)
            self.listeners = (CalibrationPlugin(self.fit),)

    def weights(self) -> tuple[float, float, float]:
        """(w_rtt, t_p, w_queue) to score with now."""
        p = self.params
        return p.w_rtt, p.t_p, p.w_queue

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        matches = view.prefix.match(req.block_hashes)
        tokens, bt = req.prompt_tokens, req.block_tokens
        w_rtt, t_p, w_queue = self.weights()
        w_rtt_ms = w_rtt * 1000.0
        get = matches.get
        if self.fit is None:
            costs = [w_rtt_ms * e.rtt_s + t_p * (tokens if (m := get(e.id)) is None else max(0, tokens - bt * m))
                     + w_queue * e.inflight_tokens for e in eps]
        else:
            costs = [w_rtt_ms * e.rtt_s + self._fitted_ms(e, max(0, tokens - bt * get(e.id, 0)), t_p, w_queue)
                     for e in eps]
        ep = argmin(eps, costs, self.rng)
        return Decision.dispatch(ep.id, "min-cost", matches.get(ep.id, 0), explain(eps, costs))

    def _fitted_ms(self, e: Endpoint, uncached: int, t_p: float, w_queue: float) -> float:
        model = self.fit.model(e.id) if self.fit is not None else None
        if model is None:  # not calibrated yet: the constants, in ms per token
            return t_p * uncached + w_queue * e.inflight_tokens
        return 1000.0 * model.predict(uncached, e.inflight_tokens)
