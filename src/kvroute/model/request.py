"""A request as the routing layer sees it: identity, where it comes from, and its prompt's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Request:
    """One inference request, already keyed and hashed (see :mod:`kvroute.prefix`).

    ``block_hashes`` are chained: block *i*'s hash covers the whole prompt up to the end of
    block *i*, so equal hashes imply equal prefixes. ``block_tokens`` is how many prompt tokens
    one hash covers (64 for prompts hashed by kvroute, 512 for Mooncake trace ids).
    """

    id: str
    arrival_s: float = 0.0
    region: str | None = None
    tenant: str | None = None
    routing_key: str | None = None  # user / session key for consistent hashing
    prompt_key: str = ""  # canonical rendering of the prompt (never logged by default)
    block_hashes: tuple[int, ...] = ()
    block_tokens: int = 64
    prompt_tokens: int = 0  # estimated or exact prompt length
    max_output_tokens: int = 256
    residency: str | None = None  # data-residency zone the request must stay in
    from_peer: bool = False  # arrived from another load balancer: never forwarded again
    hops: int = 0  # load balancers that forwarded it so far (live gateways; GORGO's max_hops)
    exclude: tuple[str, ...] = ()  # endpoints not to use (already failed for this request)
    # prefill/decode disaggregation (policy/pd.py): the prefill engine chosen for this request
    # and its region, while the decode engine is being chosen (the proximity scorer reads them)
    pd_prefill: str | None = None
    pd_prefill_region: str | None = None

    @property
    def has_prompt(self) -> bool:
        """Whether the request carries a prompt to route by (a length or block hashes); an empty one is
        refused."""
        return self.prompt_tokens > 0 or bool(self.block_hashes)

    def new_prefill_tokens(self, matched_blocks: int) -> int:
        """Prompt tokens left to prefill when ``matched_blocks`` leading blocks are cached."""
        return max(0, self.prompt_tokens - matched_blocks * self.block_tokens)

    def hit_ratio(self, matched_blocks: int) -> float:
        """Fraction of the prompt's tokens in the ``matched_blocks`` cached leading blocks.

        Counted in tokens rather than blocks so that it stays true when the router indexes only
        a prompt's first blocks (``PrefixIndex.max_blocks``).
        """
        if self.prompt_tokens <= 0:
            return 0.0
        return min(1.0, matched_blocks * self.block_tokens / self.prompt_tokens)
