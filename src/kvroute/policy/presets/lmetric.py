"""LMetric: new prefill tokens × batch size, no hyper-parameters; optional KV-hotspot detector."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams


@register_preset(
    "lmetric", source="LMetric §4 (P-tokens × BS), §5.2 (hotspot detector); blitz-router policies/lmetric.rs",
    rules=[{"enabled": "$hotspot", "route": {"hotspot": "$hotspot_window"}, "branch": Branch.HOTSPOT_FILTERED}],
    cost={"lmetric": 1}, branch=Branch.MIN_SCORE)
class LMetricParams(PolicyParams):
    """Minimise (queued prefill + this request's new prefill tokens) × (batch size + 1).

    New prefill tokens are the prompt minus its cached prefix on the endpoint; queued prefill is
    the router's backlog of dispatched-but-not-prefilled tokens there; batch size is running +
    waiting (LMetric §4, Figure 17). The +1 keeps idle endpoints comparable by their P-tokens
    (blitz-router's lmetric.rs does the same). With ``hotspot: true`` the detector of §5.2
    (:mod:`kvroute.policy.adaptive.hotspot`) may take a hotspot's instances out of the targets.
    """

    hotspot: bool = Field(False, description="LMetric §5.2's two-phase KV-hotspot detector: when a "
                          "request class outgrows the instances caching its prefix (Equation 2) and "
                          "more than 2·|M| consecutive class requests still prefer them, route the "
                          "class among the other instances")
    hotspot_window: int = Field(256, ge=8, description="routed requests the detector measures class "
                                "shares over")
