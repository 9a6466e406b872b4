"""llm-d's predicted-TTFT routing, the simulator-based baseline LMetric compared against."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams
from kvroute.policy.profiles import resolve_profile


@register_preset("llm_d", source="LMetric §4.6 / Fig. 14 (llm-d's simulator-based TTFT prediction)",
                 cost={"predictor": {"profile": "$profile"}}, branch=Branch.MIN_PREDICTED_TTFT)
class LLMDParams(PolicyParams):
    """Predict each replica's TTFT for this request with a step-time model; pick the minimum.

    LMetric §4.6 (Figure 14): llm-d's latency-based scheduler simulates every instance and
    routes to the lowest estimated TTFT. kvroute's predictor is its own simulator's step-time
    model (:class:`~kvroute.perf.profile.HardwareProfile`: each replica's own unless ``profile`` names one)
    fed with the probed running batch, the router's queued prefill tokens and decode contexts,
    the RTT and the request's uncached tokens (:mod:`kvroute.policy.adaptive.predictor`). This
    differs from ``weighted`` (llm-d's default scorer profile: prefix 3, queue 2, KV 2 with a
    max-score picker), which combines normalised indicators without predicting time. Its
    prediction error against measured TTFTs is exported as ``predictor.*`` policy state.
    """

    profile: str | None = Field(None, description="hardware profile whose step-time model predicts TTFT: "
                                "unset = each replica's own (the simulator's replicas; h20-qwen3-30b-a3b for "
                                "a replica of unknown hardware), or a bundled name (`src/kvroute/profiles/`) or "
                                "YAML path for all; a mismatched one predicts worse (LMetric Figs. 15-16)")

    @field_validator("profile")
    @classmethod
    def _resolves(cls, v: str | None) -> str | None:
        if v is not None:
            resolve_profile(v)  # an unknown name fails here, at its parameter (ValueError)
        return v
