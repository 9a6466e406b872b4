"""``kv_room``: the candidates whose KV cache can hold this request's prompt beside the prompt blocks of this load
balancer's requests in flight there — all of them when none can, or when a candidate's capacity is unknown.

An engine admits a request only when its KV cache has room for it (vLLM allocates a new sequence's blocks before
its first chunk; SGLang's scheduler also reserves the running requests' future output tokens:
``sim/sglang_admission.py``), so a prompt sent to a replica whose cache is full of in-flight requests waits, before
any prefill, until enough of them finish — however empty the replica's prefill queue. ``auto``'s least-work rule
counts only the prefill queued ahead of the first token. On chat-1region at 90 % of the knee (9 seeds, after the
start-up burst) 26 of ``auto``'s 65 slowest first tokens went where the LB's in-flight prompt tokens plus the prompt
passed 90 % of the capacity (llm_d: 8; docs/auto.md, session 12). Counted as here (distinct blocks, prompts only)
those replicas are not full — what stalls them there is SGLang's reservation for output the LB cannot count — so on
that cell this filter changes no decision; in ``kvroute bench auto`` it moves only mooncake (long prompts): TTFT
p99 0.982 → 1.002 of the best at 70 % of the knee, 0.974 → 0.991 at 90 %.

The room is the load balancer's own count, not a probed utilisation that may be seconds old: the prompt blocks
(the prefix index's block hashes) of its requests dispatched to the endpoint and not finished, each block counted
once however many of them share it — a system prompt or a tree's trunk is held once, a conversation's history once
per conversation (the sum of in-flight prompt tokens, ``Endpoint.inflight_tokens``, counts a shared prefix once per
request and finds a replica full that serves one hot prefix: hot-prefix, tot and mixed-tree lost up to 0.49 of the
best TTFT p99 with it, session 12). This request needs its prompt tokens not already held there. The capacity is
the engine's (``kv_blocks`` × ``block_size``: configured, or read by the prober from the engine); no constant is
chosen. Output tokens are not counted (their number is unknown at dispatch), so the filter errs toward a fit.
Pure: no clock, no I/O; the counts come from the lifecycle events.

Cost: a dispatch and a finish only file the request's blocks (O(1)); a replica is checked block by block only when
the plain sum of its in-flight prompt tokens plus this prompt passes its capacity (the distinct count can only be
smaller), and its distinct blocks are counted again only after a request came or went there. Counting every block
at every dispatch cost ``auto`` 1.76x its decision time on 32K-token prompts (`kvroute bench routing`).
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Filter


def fits(held: int, need: int, capacity: int) -> bool:
    """Whether ``need`` more tokens fit beside ``held`` in a cache of ``capacity`` tokens (unknown, 0: yes)."""
    return capacity <= 0 or held + need <= capacity


@register_plugin
class KVRoom(Filter, Lifecycle):
    """The endpoints where the prompt blocks of this load balancer's requests in flight (each distinct block once)
    plus this request's prompt tokens not among them fit in the KV capacity (``kv_blocks`` × ``block_size``); all
    of ``eps`` when none does, and unchanged while ``on`` is false."""

    name = "kv_room"
    inputs = frozenset({"load"})

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.inflight: dict[str, dict[str, tuple[tuple[int, ...], int]]] = {}  # endpoint → request → (blocks, size)
        self.bound: dict[str, int] = {}  # endpoint → its in-flight prompts' block tokens summed (≥ the distinct)
        self.at: dict[str, str] = {}  # request id → its endpoint
        self.distinct: dict[str, tuple[set[int], int]] = {}  # endpoint → (held blocks, their tokens), while current

    def held(self, endpoint_id: str) -> tuple[set[int], int]:
        """The distinct blocks the endpoint's requests in flight hold, and their tokens (counted after a change)."""
        got = self.distinct.get(endpoint_id)
        if got is None:
            blocks: set[int] = set()
            tokens = 0
            for hashes, size in self.inflight.get(endpoint_id, {}).values():
                for h in hashes:
                    if h not in blocks:
                        blocks.add(h)
                        tokens += size
            got = self.distinct[endpoint_id] = (blocks, tokens)
        return got

    def need(self, req: Request, endpoint_id: str) -> int:
        """The request's prompt tokens not in blocks already held on the endpoint by requests in flight."""
        blocks = self.held(endpoint_id)[0]
        if not blocks:
            return req.prompt_tokens
        shared = sum(1 for h in req.block_hashes if h in blocks)
        return max(0, req.prompt_tokens - shared * req.block_tokens)

    def room(self, req: Request, endpoint: Endpoint) -> bool:
        """Whether the request's new tokens fit beside what the endpoint's requests in flight hold."""
        capacity = endpoint.kv_blocks * endpoint.block_size
        if fits(self.bound.get(endpoint.id, 0), req.prompt_tokens, capacity):
            return True  # fits even counting every in-flight block as often as it is held, and none shared
        return fits(self.held(endpoint.id)[1], self.need(req, endpoint.id), capacity)

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The candidates with room for the request's new tokens, else all of them."""
        if not self.on or len(eps) < 2:
            return eps
        kept = [e for e in eps if self.room(st.req, e)]
        return kept or eps

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """The request's blocks are held there until it finishes."""
        if not self.on or req.id in self.at:
            return
        eid = endpoint.id
        self.inflight.setdefault(eid, {})[req.id] = (req.block_hashes, req.block_tokens)
        self.bound[eid] = self.bound.get(eid, 0) + len(req.block_hashes) * req.block_tokens
        self.at[req.id] = eid
        self.distinct.pop(eid, None)

    def _done(self, req_id: str) -> None:
        eid = self.at.pop(req_id, None)
        if eid is None:
            return
        hashes, size = self.inflight[eid].pop(req_id)
        self.bound[eid] -= len(hashes) * size
        self.distinct.pop(eid, None)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Its blocks are released (freed where no other request in flight holds them)."""
        self._done(req_id)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """Left the endpoint: released."""
        self._done(req_id)

    def state(self) -> dict[str, float]:
        """``held_tokens``: tokens of distinct blocks held by requests in flight, over all endpoints."""
        return {"held_tokens": float(sum(self.held(eid)[1] for eid in self.inflight))}
