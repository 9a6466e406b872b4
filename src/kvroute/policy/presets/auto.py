"""``auto``: the default policy — one composition of the seeds' mechanisms, each in charge where it wins.

Side by side no preset is best everywhere (issue 22): LMetric's P-tokens × batch-size score leads
on prefix-heavy single-region traffic, GORGO's RTT-aware cost across regions, and on length-only
traces they tie. ``auto`` decides per request, from what a live load balancer observes and
nothing else — its own accounting (in-flight requests and tokens, the prefill backlog it
dispatched), the prefix index, and the RTTs its probes measure — never a step-time model:

1. **hot prefix** (LMetric §5.2): the two-phase KV-hotspot detector watches which request classes
   outgrow the instances caching their prefix; while it fires, the class is routed among the
   others (branch ``auto:hotspot``);
2. **several regions** (GORGO v1 §3, v2's weights): when the candidates' measured RTTs spread by
   more than ``rtt_spread_ms``, the cost is w_rtt·RTT + t_p·uncached tokens + w_queue·queued tokens,
   so a remote replica is used only when the queue it avoids outweighs the network time
   (branch ``auto:rtt-aware``);
3. otherwise **LMetric's score**: (queued prefill + this request's uncached tokens) × (batch + 1) —
   it follows the cache while that saves prefill and spreads load when it does not; on traffic
   without prefix reuse it reduces to least prefill work (branch ``auto:prefix-load``).

The branch of every decision says which mechanism was in charge: ``kvroute_policy_branch`` in the
gateway's /metrics and decision records, ``branches`` in the simulation report. Where it falls
short (see ``kvroute bench auto``): it adds no cross-region forwarding of its own (a topology
choice, ``two-layer``), and the RTT switch is a threshold, not learned.
"""

from __future__ import annotations

from pydantic import Field

from kvroute.policy.adaptive import selector  # noqa: F401  (registers ttft_selector)
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams

HOTSPOT, RTT_AWARE, ADDITIVE, PREFIX_LOAD = "auto:hotspot", "auto:rtt-aware", "auto:additive", "auto:prefix-load"


@register_preset(
    "auto", source="issue 22: LMetric §4 score and §5.2 hotspot detector; GORGO v1 §3 / v2 cost across regions",
    rules=[{"enabled": "$hotspot", "route": {"hotspot": "$hotspot_window"}, "branch": HOTSPOT},
           {"when": {"rtt_spread_above": "$rtt_spread_ms"}, "branch": RTT_AWARE,
            "cost": {"rtt_ms": "$w_rtt", "uncached_tokens": "$t_p", "inflight_tokens": "$w_queue"}},
           {"enabled": "$select", "when": {"ttft_selector": {"window": "$select_window", "exploit": "$select_exploit"}},
            "branch": ADDITIVE, "cost": {"uncached_tokens": "$t_p", "inflight_tokens": "$w_queue"}}],
    cost={"lmetric": 1}, branch=PREFIX_LOAD)
class AutoParams(PolicyParams):
    """The default: LMetric's score in one region, GORGO's RTT-aware cost across regions, hotspot detection.

    Which mechanism decided is each decision's branch (``auto:prefix-load``, ``auto:rtt-aware``,
    ``auto:hotspot``); see the module docstring for when each takes charge and why.
    """

    hotspot: bool = Field(True, description="LMetric §5.2's KV-hotspot detector takes a hot class's "
                          "instances out of its targets while it fires")
    hotspot_window: int = Field(256, ge=8, description="routed requests the detector measures class shares over")
    rtt_spread_ms: float = Field(10.0, ge=0, description="candidates whose probe RTTs differ by more than this "
                                 "are in different regions: weigh the network (GORGO's cost)")
    w_rtt: float = Field(0.5, ge=0.0, description="RTT weight per ms in the cross-region cost (GORGO v2 start)")
    t_p: float = Field(1.0, ge=0.0, description="cost per uncached prompt token in the cross-region cost")
    w_queue: float = Field(0.1, ge=0.0, description="weight of queued tokens in the cross-region cost")
    select: bool = Field(True, description="within a region, measure GORGO's additive cost against LMetric's "
                         "score online (alternating blocks, p90 TTFT, E2E guard) and keep the faster")
    select_window: int = Field(64, ge=8, description="dispatches per measured block")
    select_exploit: int = Field(8, ge=1, description="blocks the winner serves before both are measured again")
