"""GORGO v2 with its online tuner: the GORGO cost, weights learned by a (1+1)-ES on p95 TTFT."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvroute.model import Branch
from kvroute.policy.adaptive.es_tuner import GORGO_RANGES
from kvroute.policy.builtin.warmup import WARM_UP
from kvroute.policy.catalog import register_preset
from kvroute.policy.presets.gorgo import GORGO_TERMS, GorgoParams


@register_preset(
    "gorgo_tuned", source="GORGO v2 §2.2 and §4: (1+1)-ES, rolling 128 window hop 32, 1/5 rule, ranges",
    rules=[{"enabled": "$warm_up", "route": "warm_up", "branch": WARM_UP}],
    cost={"es": {"terms": GORGO_TERMS, "start": {"w_rtt": "$w_rtt", "t_p": "$t_p", "w_queue": "$w_queue"},
                 "ranges": {"w_rtt": "$w_rtt_range", "w_queue": "$w_queue_range"},
                 "window": "$window", "hop": "$hop", "sigma0": "$sigma0", "sigma_min": "$sigma_min",
                 "frozen": "$frozen", "judge": "$judge"}},
    branch=Branch.MIN_COST)
class GorgoTunedParams(GorgoParams):
    """GORGO's cost with w_rtt and w_queue tuned online by GORGO v2's (1+1)-ES on p95 TTFT.

    Every completed request's TTFT (measured by the runtime, LB queueing included) feeds the tuner; it
    scores the weights it serves on a window's p95 and mutates them in log space within the
    ranges (see :mod:`kvroute.policy.adaptive.es_tuner`). Its RNG is seeded from the policy seed,
    so a simulation is deterministic. ``frozen: true`` serves the given weights unchanged. (The
    tuner replaces ``calibrate``, which this preset does not take.)
    """

    w_rtt_range: tuple[float, float] = Field(
        (GORGO_RANGES["w_rtt"].lo, GORGO_RANGES["w_rtt"].hi),
        description="[lo, hi] the tuner keeps w_rtt in (GORGO v2: [0.05, 2.0]; lo > 0, log space)")
    w_queue_range: tuple[float, float] = Field(
        (GORGO_RANGES["w_queue"].lo, GORGO_RANGES["w_queue"].hi),
        description="[lo, hi] the tuner keeps w_queue in (GORGO v2: [0.05, 0.5]; a lo near 0 lets "
                    "it drop the queue term, the paper's reward-hacking failure)")
    window: int = Field(128, ge=8,
                        description="samples (completed requests' TTFTs) in the rolling window (GORGO v2: 128)")
    hop: int = Field(32, ge=1, description="samples between tuner steps (GORGO v2: 32)")
    judge: Literal["window", "hop"] = Field(
        "window", description="what a step scores: the p95 of the rolling window (GORGO v2 §4) or of the last "
        "hop's first tokens only (each offspring on its own samples; kvroute's alternative)")
    sigma0: float = Field(0.5, gt=0, description="initial log-space step size σ")
    sigma_min: float = Field(0.05, gt=0, description="the search stops once σ falls below this")
    frozen: bool = Field(False, description="serve w_rtt and w_queue as given, never tune (held-out "
                         "evaluation with learned weights)")

    @model_validator(mode="after")
    def _check(self) -> GorgoTunedParams:
        for name, (lo, hi), start in (("w_rtt", self.w_rtt_range, self.w_rtt),
                                      ("w_queue", self.w_queue_range, self.w_queue)):
            if self.frozen:
                continue
            if not 0 < lo <= start <= hi:
                raise ValueError(f"{name}_range must satisfy 0 < lo <= {name} <= hi, got "
                                 f"[{lo}, {hi}] with {name} {start}")
        if self.hop > self.window:
            raise ValueError(f"hop ({self.hop}) must not exceed window ({self.window})")
        if self.queue != "inflight":
            raise ValueError("gorgo_tuned tunes the in-flight queue term (GORGO v2): drop queue "
                             "(or use gorgo with queue: prefill)")
        if self.calibrate:
            raise ValueError("gorgo_tuned tunes the weights instead of fitting them: drop calibrate "
                             "(or use gorgo with calibrate)")
        return self
