"""Hash-ring placement: session affinity and prefix hashing with bounded load."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Branch
from kvroute.policy.catalog import register_preset
from kvroute.policy.params import PolicyParams

# session affinity, shared with skywalker_ch: the key's owner, else the least-loaded endpoint
SESSION_AFFINITY = {
    "rules": [{"picker": "ring", "branch": Branch.RING}],
    "cost": {"inflight": 1}, "branch": Branch.NO_KEY,
}


@register_preset("consistent_hash", source="SGLang router `consistent_hashing`; GORGO v2 baseline session "
                 "affinity", **SESSION_AFFINITY)
class ConsistentHashParams(PolicyParams):
    """Session affinity: the request's user/session key on a consistent-hash ring.

    The key comes from a header or body field (the gateway fills ``Request.routing_key``;
    SkyWalker's benchmark sets ``x-hash-key`` to the user id). Without a key: least request.
    """


@register_preset("prefix_hash", source="SGLang router `prefix_hash` (first 256 tokens, load factor 1.25)",
                 rules=[{"route": {"bounded_prefix_ring": {"prefix_tokens": "$prefix_tokens",
                                                           "load_factor": "$load_factor",
                                                           "min_key_blocks": "$min_key_blocks"}},
                         "branch": Branch.RING}],
                 cost={"inflight": 1}, branch=Branch.RING_OVERFLOW)
class PrefixHashParams(PolicyParams):
    """Hash the first 256 prompt tokens onto the ring; skip endpoints over 1.25x mean load.

    Consistent hashing with bounded loads (Mirrokni et al.): an endpoint may take the request
    while its in-flight count stays within ``ceil(load_factor × (total + 1) / n)``; when every
    endpoint is over the bound, least request.

    The key is the chained hash of the block that covers the first ``prefix_tokens`` tokens, but
    never shallower than ``min_key_blocks`` blocks. With kvroute's 64-token blocks that changes
    nothing (256 tokens = 4 blocks). With Mooncake's 512-token hash ids the first block alone
    is the shared system prompt of every request in the conversation trace, so a one-block key
    sent every request to one ring point and 92 % of decisions overflowed (issue 7); two blocks
    tell conversations apart, as the trace's own session key does.
    """

    prefix_tokens: int = Field(256, ge=1, description="leading tokens hashed onto the ring")
    load_factor: float = Field(1.25, ge=1.0, description="bound: in-flight ≤ factor × mean")
    min_key_blocks: int = Field(2, ge=1, description="the key spans at least this many hash blocks "
                                "(when the prompt has them), so a shared first block is not the key")
