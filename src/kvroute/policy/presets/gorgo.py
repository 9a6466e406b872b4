"""GORGO: an additive TTFT cost of network RTT, residual prefill and queue wait."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.builtin.warmup import WARM_UP
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams

# GORGO's cost as scorer → weight (the ES of gorgo_tuned tunes the same terms)
GORGO_TERMS = {"w_rtt": "rtt_ms", "t_p": "uncached_tokens", "w_queue": "inflight_tokens"}


@register_preset(
    "gorgo", source="GORGO v1 §3 cost; GORGO v2 gorgo/policy/gorgo.py (rtt 0.5, queue 0.1, prefill 1.0)",
    rules=[{"enabled": "$warm_up", "route": "warm_up", "branch": WARM_UP},
           {"enabled": "$calibrate", "branch": Branch.MIN_COST,
            "cost": {"rtt_ms": "$w_rtt", "calibration": {"t_p": "$t_p", "w_queue": "$w_queue",
                                                         "min_samples": "$calibration_min_samples"}}},
           {"enabled": "$queue_prefill", "branch": Branch.MIN_COST,
            "cost": {"rtt_ms": "$w_rtt", "uncached_tokens": "$t_p", "queued_prefill_tokens": "$w_queue"}}],
    cost={"rtt_ms": "$w_rtt", "uncached_tokens": "$t_p", "inflight_tokens": "$w_queue"}, branch=Branch.MIN_COST)
class GorgoParams(PolicyParams):
    """Minimise w_rtt·RTT_ms + t_p·uncached tokens + w_queue·queued tokens.

    Uncached tokens are the prompt minus its longest cached prefix on the endpoint; queued tokens
    are the prompt tokens the router has dispatched there and not yet seen complete (GORGO v2's
    proxy accounting). Weights are static here at v2's starting point; ``gorgo_tuned`` learns
    them online with v2's (1+1)-ES. For v1's millisecond form set t_p = w_queue = 0.094 (ms per
    token, 8xA100 Mistral-7B) and w_rtt = 1; with ``calibrate`` the per-token costs and a
    per-replica intercept are fitted from observed TTFTs (v1 §4.2's regression, done online).
    """

    w_rtt: float = Field(0.5, ge=0.0, description="weight of RTT in ms (v2 start 0.5, learned 0.276)")
    t_p: float = Field(1.0, ge=0.0, description="cost per uncached prompt token (v2 prefill_rate)")
    w_queue: float = Field(0.1, ge=0.0, description="weight of queued tokens (v2 start 0.1, learned 0.5)")
    calibrate: bool = Field(False, description="GORGO v1 calibration: fit TTFT − RTT per replica online "
                            "(intercept + ms per uncached token + ms per queued token, recursive least "
                            "squares on observed first tokens) and use it instead of t_p and w_queue; "
                            "costs are then in ms (set w_rtt 1; t_p and w_queue, in ms per token, "
                            "serve a replica until it has calibration_min_samples observations)")
    @property
    def queue_prefill(self) -> bool:
        """Whether queued tokens are the prefill backlog (``queue: prefill``)."""
        return self.queue == "prefill" and not self.calibrate

    calibration_min_samples: int = Field(8, ge=3, description="observations before a replica's fit is used")
    queue: Literal["inflight", "prefill"] = Field(
        "inflight", description="what counts as queued tokens: inflight = prompt tokens dispatched and not "
        "finished (GORGO v2's proxy accounting, v1 §7's updated policy with running requests); prefill = "
        "prefill tokens dispatched and not yet past their first token (the queue alone, v1 as evaluated)")
    warm_up: bool = Field(False, description="a replica with a cold cache (added, recovered) takes requests while "
                          "it has fewer in flight than every warm one (policy/builtin/warmup.py; issue 12); off: "
                          "neither GORGO paper has one")
