"""Weighted scorers and a max-score picker (llm-d's endpoint picker), user-configurable.

Each scorer's output is normalised to [0, 1], higher is better; the combination is a weighted
sum; the picker takes the maximum (random tie-break) or samples a softmax. Its defaults are
llm-d's default scheduling profile (prefix 3, queue 2, KV 2); a user picks scorers and weights in
YAML. (The ``llm_d`` preset is llm-d's latency-predicting scheduler instead: ``presets/llm_d.py``.)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvroute.model import Branch
from kvroute.policy.catalog import PLUGINS, register_preset
from kvroute.policy.params import PolicyParams

WEIGHTED = {
    "rules": [{"enabled": "$sampled", "score": "$scorers", "picker": {"softmax": "$temperature"},
               "branch": Branch.WEIGHTED}],
    "score": "$scorers", "picker": "argmax", "branch": Branch.WEIGHTED,
}


class WeightedParams(PolicyParams):
    """Weighted sum of normalised scorers, then max (or softmax) pick; scorers set in config."""

    scorers: dict[str, float] = Field(
        default_factory=lambda: {"prefix": 3.0, "queue": 2.0, "kv_cache_util": 2.0},
        description="scorer name → weight (`kvroute policies --json` lists the scorers)")
    picker: Literal["max", "softmax"] = Field("max", description="max: the best score; softmax: sample")
    temperature: float = Field(0.1, gt=0.0, description="softmax temperature (picker=softmax)")

    @field_validator("scorers")
    @classmethod
    def _known(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(PLUGINS["scorer"]))
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(unknown)}; "
                             f"valid scorers: {', '.join(PLUGINS['scorer'])}")
        if not v:
            raise ValueError("at least one scorer is required")
        return v

    @property
    def sampled(self) -> bool:
        """Whether the picker samples a softmax rather than taking the maximum."""
        return self.picker == "softmax"


register_preset("weighted", source="llm-d inference scheduler: filter → weighted scorers → picker",
                **WEIGHTED)(WeightedParams)
