"""SkyWalker (EuroSys '26): prefix-aware routing with selective pushing on pending requests."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import AdmissionName, PolicyParams, admission_field
from kvroute.policy.presets.hashing import SESSION_AFFINITY


@register_preset(
    "skywalker", source="SkyWalker §3.2–3.3, Listing 1; skypilot serve-multi-region-lb prefix_tree policy",
    rules=[{"when": {"hit_ratio_at_least": "$cache_threshold"}, "among": "best_prefix",
            "cost": {"inflight": 1}, "branch": Branch.PREFIX_HIT}],
    cost={"inflight": 1}, branch=Branch.LEAST_LOAD)
class SkyWalkerParams(PolicyParams):
    """Longest prefix among available endpoints; least in-flight among the best; < 0.5 → least load.

    Available means no pending (waiting) request at the last probe (selective pushing, §3.3);
    when none is available the request holds in the LB's FIFO queue. The same policy runs over
    peer load balancers with the regional snapshot index (§3.2). SkyWalker's code follows the
    cache when the match rate is strictly above 0.5; the issue text says below 0.5 goes to load,
    so a ratio of exactly 0.5 follows the cache here.
    """

    admission: AdmissionName = admission_field("pending")
    cache_threshold: float = Field(0.5, ge=0.0, le=1.0, description="below this match ratio, route by load")


@register_preset("skywalker_ch", source="SkyWalker-CH §3.2 (xxh64 ring, ≥1024 vnodes, header x-hash-key)",
                 **SESSION_AFFINITY)
class SkyWalkerCHParams(PolicyParams):
    """Consistent hash on the user key, clockwise past unavailable endpoints; no key → least load.

    The same plugins as ``consistent_hash``; only the admission differs (pending).
    """

    admission: AdmissionName = admission_field("pending")
