"""Routes: rules written in code, for the few that are not condition → score → pick."""

from __future__ import annotations

import math

from kvroute.model import Branch, Decision, Endpoint, Request
from kvroute.policy.catalog import register_plugin
from kvroute.policy.plugins import DecisionState, Route


@register_plugin
class BoundedPrefixRing(Route):
    """Consistent hashing with bounded loads (Mirrokni et al.) on the prompt's leading tokens.

    The key is the chained hash of the block covering the first ``prefix_tokens`` tokens, but
    never shallower than ``min_key_blocks`` blocks; an endpoint may take the request while its
    in-flight count stays within ``ceil(load_factor × (total + 1) / n)``, walking the ring
    clockwise from the key. Declines when every candidate is over the bound.
    """

    name = "bounded_prefix_ring"
    inputs = frozenset({"ring", "load"})
    uses_ring = True

    def __init__(self, prefix_tokens: int = 256, load_factor: float = 1.25, min_key_blocks: int = 2):
        self.prefix_tokens, self.load_factor, self.min_key_blocks = prefix_tokens, load_factor, min_key_blocks

    def key(self, req: Request) -> int | str:
        """The ring key: a chained block hash, or the prompt text's head without hashes."""
        if req.block_hashes:
            n = max(self.min_key_blocks, math.ceil(self.prefix_tokens / req.block_tokens))
            return req.block_hashes[min(n, len(req.block_hashes)) - 1]
        return req.prompt_key[: self.prefix_tokens * 4] or req.id

    def route(self, st: DecisionState, eps: list[Endpoint]) -> Decision | None:
        """The first ring successor of the prefix key under the load bound (RING, or RING_OVERFLOW past the
        owner); None when every candidate is full."""
        by_id = {e.id: e for e in eps}
        total = sum(e.inflight for e in eps)
        bound = math.ceil(self.load_factor * (total + 1) / len(eps))
        first = True
        for eid in st.view.ring.successors(self.key(st.req)):
            ep = by_id.get(eid)
            if ep is None:
                continue
            if ep.inflight + 1 <= bound:
                return Decision.dispatch(eid, Branch.RING if first else Branch.RING_OVERFLOW)
            first = False
        return None
