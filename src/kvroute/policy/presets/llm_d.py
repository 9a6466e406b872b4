"""llm-d's predicted-TTFT routing, the simulator-based baseline LMetric compared against."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.adaptive.plugins import PredictionErrorPlugin
from kvroute.policy.adaptive.predictor import TTFTPredictor
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain
from kvroute.sim.profile import ProfileError, available_profiles, load_profile


class LLMDParams(PolicyParams):
    """Which hardware profile the predictor's step-time model is."""

    profile: str = Field("h20-qwen3-30b-a3b", description="hardware profile (name or YAML path) "
                         "whose step-time model predicts TTFT; a mismatched one predicts worse "
                         f"(LMetric Figs. 15-16); bundled: {', '.join(available_profiles())}")

    @field_validator("profile")
    @classmethod
    def _loads(cls, v: str) -> str:
        try:
            load_profile(v)
        except ProfileError as exc:
            raise ValueError(str(exc)) from None
        return v


class LLMD(Policy):
    """Predict each replica's TTFT for this request with a step-time model; pick the minimum.

    LMetric §4.6 (Figure 14): llm-d's latency-based scheduler simulates every instance and
    routes to the lowest estimated TTFT. kvroute's predictor is its own simulator's step-time
    model (:class:`~kvroute.sim.profile.HardwareProfile`, loaded once when the policy is built)
    fed with the probed running batch, the router's queued prefill tokens and decode contexts,
    the RTT and the request's uncached tokens (:mod:`kvroute.policy.adaptive.predictor`). This
    differs from ``weighted`` (llm-d's default scorer profile: prefix 3, queue 2, KV 2 with a
    max-score picker), which combines normalised indicators without predicting time. Its
    prediction error against measured TTFTs is exported as ``predictor.*`` policy state.
    """

    name = "llm_d"
    source = "LMetric §4.6 / Fig. 14 (llm-d's simulator-based TTFT prediction)"
    Params = LLMDParams
    params: LLMDParams

    def __init__(self, params: PolicyParams | None = None, seed: int = 0):
        super().__init__(params, seed)
        self.predictor = TTFTPredictor(load_profile(self.params.profile))
        self.errors = PredictionErrorPlugin()
        self.listeners = (self.errors,)

    @property
    def reads_prefill_backlog(self) -> bool:
        return True

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        matches = view.prefix.match(req.block_hashes)
        p, bt = req.prompt_tokens, req.block_tokens
        predict = self.predictor.predict
        preds = []
        for e in eps:
            cached = min(p, bt * matches.get(e.id, 0))
            preds.append(predict(e, p - cached, cached))
        self.errors.last = (req.id, {e.id: v for e, v in zip(eps, preds)})
        ep = argmin(eps, preds, self.rng)
        return Decision.dispatch(ep.id, "min-predicted-ttft", matches.get(ep.id, 0), explain(eps, preds))
