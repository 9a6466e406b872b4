"""The decode side of a disaggregated deployment (policy/pd.py)."""

from __future__ import annotations

from pydantic import Field

from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams


@register_preset(
    "pd_decode", source="SGLang router PD mode (decode by load: power_of_two); llm-d decode profile (load and KV "
    "scorers); kvroute: proximity to the prefill engine",
    filters=["pd_kv_fits"],
    score={"inflight": "$w_load", "kv_cache_util": "$w_kv", "pd_proximity": "$w_proximity"}, branch="pd-decode")
class PDDecodeParams(PolicyParams):
    """Decode engine for a prefill/decode pair: room for the prompt's KV, then fewest in flight,
    most KV free, closest to the prefill engine (normalised scores, weighted).

    ``pd_kv_fits`` keeps engines whose free KV (probed usage) can hold the prompt — decode
    admission is bounded by KV capacity, so a full engine would queue the transfer. Proximity
    ranks the prefill engine itself (a mixed engine: no transfer), its region, then elsewhere:
    a cross-region transfer moves the whole prompt's KV over the slower link. On an aggregated
    fleet (no prefill engine chosen) proximity is flat and this is a load + KV policy.
    """

    w_load: float = Field(1.0, ge=0, description="weight of fewest requests in flight")
    w_kv: float = Field(1.0, ge=0, description="weight of free KV-cache share (1 − usage)")
    w_proximity: float = Field(1.0, ge=0, description="weight of closeness to the prefill engine")
