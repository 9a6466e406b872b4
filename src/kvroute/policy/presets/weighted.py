"""Weighted scorers and a max-score picker (llm-d's endpoint picker), user-configurable.

Each scorer maps endpoints to [0, 1], higher is better; the combiner is a weighted sum; the
picker takes the maximum (random tie-break) or samples a softmax. Its defaults are llm-d's default
scheduling profile (prefix 3, queue 2, KV 2); a user picks scorers and weights in YAML. (The
``llm_d`` preset is llm-d's latency-predicting scheduler instead: ``presets/llm_d.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator

from kvroute.model import Endpoint, Request
from kvroute.model.decision import Decision
from kvroute.policy.base import Policy, PolicyParams, View, argmax, explain, softmax_pick


def _low_is_good(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


ScorerFn = Callable[[Request, list[Endpoint], dict[str, int]], list[float]]

def _prefix(r: Request, eps: list[Endpoint], m: dict[str, int]) -> list[float]:
    # cached share of the prompt; may pass 1 by less than one block when the last block is
    # partial (Mooncake ids cover it), which changes no ranking
    per_block = r.hit_ratio(1)
    return [m.get(e.id, 0) * per_block for e in eps]


SCORERS: dict[str, ScorerFn] = {
    "prefix": _prefix,
    "queue": lambda r, eps, m: _low_is_good([e.waiting for e in eps]),
    "kv_cache_util": lambda r, eps, m: [1.0 - e.kv_usage for e in eps],  # probes clamp to [0, 1]
    "inflight": lambda r, eps, m: _low_is_good([e.inflight for e in eps]),
    "batch_size": lambda r, eps, m: _low_is_good([e.batch_size for e in eps]),
    "new_prefill": lambda r, eps, m: _low_is_good(
        [r.new_prefill_tokens(m.get(e.id, 0)) + e.queued_prefill_tokens for e in eps]),
    "rtt": lambda r, eps, m: _low_is_good([e.rtt_s for e in eps]),
}


class WeightedParams(PolicyParams):
    scorers: dict[str, float] = Field(
        default_factory=lambda: {"prefix": 3.0, "queue": 2.0, "kv_cache_util": 2.0},
        description=f"scorer name → weight; scorers: {', '.join(SCORERS)}")
    picker: Literal["max", "softmax"] = "max"
    temperature: float = Field(0.1, gt=0.0, description="softmax temperature (picker=softmax)")

    @field_validator("scorers")
    @classmethod
    def _known(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(SCORERS))
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(unknown)}; "
                             f"valid scorers: {', '.join(SCORERS)}")
        if not v:
            raise ValueError("at least one scorer is required")
        return v


class Weighted(Policy):
    """Weighted sum of normalised scorers, then max (or softmax) pick; scorers set in config."""

    name = "weighted"
    source = "llm-d inference scheduler: filter → weighted scorers → picker"
    Params = WeightedParams
    params: WeightedParams  # narrows Policy.params: always an instance of Params

    @property
    def reads_kv_usage(self) -> bool:
        return "kv_cache_util" in self.params.scorers

    @property
    def reads_prefill_backlog(self) -> bool:
        return "new_prefill" in self.params.scorers

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        matches = view.prefix.match(req.block_hashes)
        scorers = iter(self.params.scorers.items())
        name, weight = next(scorers)  # the validator requires at least one scorer
        total = [weight * s for s in SCORERS[name](req, eps, matches)]
        for name, weight in scorers:
            total = [t + weight * s for t, s in zip(total, SCORERS[name](req, eps, matches))]
        if self.params.picker == "softmax":
            ep = softmax_pick(eps, total, self.params.temperature, self.rng)
        else:
            ep = argmax(eps, total, self.rng)
        return Decision.dispatch(ep.id, "weighted", matches.get(ep.id, 0), explain(eps, total))

