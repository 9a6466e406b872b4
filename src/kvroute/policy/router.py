"""The Router: a policy plus the state it decides on, with explicit accounting hooks.

Both runtimes drive this one class. ``route`` decides *and* commits in one synchronous call, so
the next decision — even within the same burst — already sees this request's in-flight
request, tokens and queued prefill. Every exit path calls ``on_finish`` (finish, error, client
cancel, retry elsewhere); it is idempotent, so counters never drift or go negative.

The same hooks feed the policy's stateful plugins (:mod:`kvroute.policy.hooks`): each dispatch,
first token, completion and failure is forwarded to every plugin in ``policy.listeners``, with
the endpoint taken from the request's ticket. Stateless presets have no listeners, so the hot
path pays one empty-tuple test per event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from kvroute.model import Decision, DecisionKind, Endpoint, Request
from kvroute.native import mypyc_attr
from kvroute.policy.base import Policy, View
from kvroute.policy.selection import decide as _decide
from kvroute.prefix import DEFAULT_BLOCK_TOKENS, HashRing, PrefixIndex
from kvroute.prefix.index import DEFAULT_MAX_BLOCKS

_POLICY_DECIDE: Final = Policy.decide  # Router.route calls its steps directly when a policy keeps it


@dataclass(slots=True, init=False)  # __init__ written out, as Request's (model/request.py says why)
class Ticket:
    """What a dispatched request added to its endpoint's counters and index, to undo exactly that."""

    endpoint_id: str
    tokens: int
    prefill_tokens: int
    matched_blocks: int = 0
    index_tick: int = 0  # the prefix-index insert this dispatch made (0: none)
    hashes: Sequence[int] = ()

    def __init__(self, endpoint_id: str, tokens: int, prefill_tokens: int, matched_blocks: int = 0,
                 index_tick: int = 0, hashes: Sequence[int] = ()) -> None:
        self.endpoint_id = endpoint_id
        self.tokens = tokens
        self.prefill_tokens = prefill_tokens
        self.matched_blocks = matched_blocks
        self.index_tick = index_tick
        self.hashes = hashes


@mypyc_attr(allow_interpreted_subclasses=True)  # PDRouter (policy/pd.py) subclasses it; compiled build
class Router:
    """One load balancer's routing state: the policy, the endpoints, the prefix index and the
    hash ring, and the accounting of every request it dispatched (its tickets).

    ``route`` decides and commits; the runtime then reports the request's progress through
    ``on_first_token``, ``on_finish`` and ``on_failed``. Nothing here reads a clock: measured
    times (TTFT, end-to-end) come from the runtime as arguments.
    """

    def __init__(self, policy: Policy, endpoints: Iterable[Endpoint] = (), *,
                 index_capacity_blocks: int | None = None,
                 index_block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 max_prefix_blocks: int = DEFAULT_MAX_BLOCKS,
                 ring_vnodes: int = 1024):
        self.policy = policy
        self.index_capacity_blocks = index_capacity_blocks
        self.index_block_tokens = index_block_tokens
        self.prefix = PrefixIndex(max_blocks=max_prefix_blocks)
        self.ring = HashRing(vnodes=ring_vnodes)
        self.tickets: dict[str, Ticket] = {}
        self._eps: dict[str, Endpoint] = {}
        self.view = View([], self.prefix, self.ring)
        for ep in endpoints:
            self.add_endpoint(ep, _ring=False)
        if self.policy.uses_ring:
            self.ring.add_many(self._eps)

    # -- membership ---------------------------------------------------------------------------
    def add_endpoint(self, ep: Endpoint, _ring: bool = True) -> None:
        """Start routing to ``ep`` (an id already registered is an error)."""
        if ep.id in self._eps:
            raise ValueError(f"endpoint {ep.id!r} is already registered")
        if len(self.prefix):  # joining a fleet that already caches: the warm-up rule may let it in
            ep.warming = True
        self._eps[ep.id] = ep
        self.prefix.add_endpoint(ep.id, self._index_capacity(ep))
        if _ring and self.policy.uses_ring:
            self.ring.add(ep.id)
        self.view.endpoints = list(self._eps.values())

    def remove_endpoint(self, endpoint_id: str) -> Endpoint | None:
        """Stop routing to ``endpoint_id`` and forget its index; returns it (None: unknown).
        Its requests in flight finish without touching its counters."""
        ep = self._eps.pop(endpoint_id, None)
        self.prefix.remove_endpoint(endpoint_id)
        self.ring.remove(endpoint_id)
        self.view.endpoints = list(self._eps.values())
        return ep

    def reset_index(self, block_tokens: int, max_prefix_blocks: int) -> None:
        """Start an empty prefix index with another block size or bound (hashes of one block
        size mean nothing under another)."""
        self.index_block_tokens = block_tokens
        self.prefix = PrefixIndex(max_blocks=max_prefix_blocks)
        self.view.prefix = self.prefix
        for ep in self._eps.values():
            self.prefix.add_endpoint(ep.id, self._index_capacity(ep))

    def resize_index(self, endpoint_id: str) -> None:
        """The endpoint's KV capacity became known or changed: bound its index to it."""
        self.prefix.add_endpoint(endpoint_id, self._index_capacity(self._eps[endpoint_id]))

    def _index_capacity(self, ep: Endpoint) -> int | None:
        if self.index_capacity_blocks:
            return self.index_capacity_blocks
        if ep.kv_blocks:  # what the engine can hold, in the index's block unit
            return max(1, ep.kv_blocks * ep.block_size // self.index_block_tokens)
        return None

    def forget_cache(self, endpoint_id: str) -> None:
        """The endpoint's cache is gone (it restarted or came back): forget its index entries."""
        self.prefix.clear(endpoint_id)

    def use_cache_table(self, endpoint_id: str, table: dict[int, int] | None) -> None:
        """Match the endpoint against an exact table kept by its owner (the engine's KV events),
        or again against the index's estimate (None): ``PrefixIndex.use_table``."""
        self.prefix.use_table(endpoint_id, table)

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        """The registered endpoint called ``endpoint_id``, or None."""
        return self._eps.get(endpoint_id)

    @property
    def endpoints(self) -> list[Endpoint]:
        """Every registered endpoint, in registration order."""
        return self.view.endpoints

    @property
    def all_endpoints(self) -> list[Endpoint]:
        """Every endpoint this router accounts for (a PDRouter's prefill side too)."""
        return self.view.endpoints

    # -- decisions and accounting -------------------------------------------------------------
    def policy_state(self) -> dict[str, float]:
        """The numeric state of the policy's stateful plugins, as ``"plugin.key"`` names."""
        out: dict[str, float] = {}
        for plugin in self.policy.listeners:
            prefix = plugin.name or type(plugin).__name__
            for key, value in plugin.state().items():
                out[f"{prefix}.{key}"] = value
        return out

    def decide(self, req: Request) -> Decision:
        """What ``route`` would decide now, changing nothing (for explanation and dry runs): no
        counter, index, plugin state or random generator moves (tests/test_decide_purity.py)."""
        return self.policy.decide(req, self.view, dry_run=True)

    def route(self, req: Request) -> Decision:
        """Decide for ``req`` and, when the decision dispatches, commit it (the plugins' deferred
        state changes, counters, index, ticket, ``on_dispatched`` to the policy's listeners)
        before returning."""
        policy = self.policy
        # Policy.decide's steps called directly unless a subclass overrides them: the interpreted method is
        # one Python frame per decision around a compiled function (sixth round, docs/hot-path.md)
        decision = _decide(policy, req, self.view) if type(policy).decide is _POLICY_DECIDE \
            else policy.decide(req, self.view)
        if decision.kind is DecisionKind.DISPATCH and decision.target is not None:  # it always has one
            for effect in decision.effects:  # before the listeners hear of the dispatch
                effect()
            # a policy that does not match prefixes reports 0: match here, so every preset's
            # accounting (queued prefill, hit ratio) reads the same
            self.commit(req, decision.target, decision.matched_blocks or None)
        return decision

    def commit(self, req: Request, endpoint_id: str, matched_blocks: int | None = None, *,
               notify: bool = True, prefill_tokens: int | None = None) -> None:
        """Account ``req`` as dispatched to ``endpoint_id`` (a re-dispatch first undoes the old
        one); ``matched_blocks`` is the prefix the decision found there (None: look it up).
        ``notify=False``: counters and index only, the policy's listeners are not told — for a
        request another load balancer of the same fleet dispatched (``kvroute/fleet``), whose
        outcome this Router's learning plugins never see. ``prefill_tokens`` overrides what the
        endpoint must prefill (0 for a decode engine that receives the prompt's KV from a
        prefill engine, policy/pd.py)."""
        if req.id in self.tickets:  # re-dispatch (retry on another endpoint): undo the old one
            self.on_finish(req.id, notify=notify)
        ep = self._eps[endpoint_id]
        if matched_blocks is None:
            matched_blocks = self.prefix.match_one(endpoint_id, req.block_hashes)
        prefill = req.prompt_tokens - matched_blocks * req.block_tokens  # req.new_prefill_tokens, inlined
        if prefill < 0 or prefill_tokens is not None:
            prefill = prefill_tokens or 0
        ep.inflight += 1
        ep.inflight_tokens += req.prompt_tokens
        ep.queued_prefill_tokens += prefill
        ep.dispatched_since_probe += 1
        hashes = req.block_hashes
        tick = self.prefix.insert(endpoint_id, hashes) if hashes else 0
        self.tickets[req.id] = Ticket(endpoint_id, req.prompt_tokens, prefill, matched_blocks, tick, hashes)
        if notify:
            for plugin in self.policy.listeners:
                plugin.on_dispatched(req, ep, prefill)

    def on_first_token(self, req_id: str, ttft_s: float | None = None) -> None:
        """Prefill is done: the request no longer adds to its endpoint's prefill backlog.

        ``ttft_s``: the runtime's measured time from the request reaching the load balancer to
        its first token; forwarded to the policy's listeners when given."""
        t = self.tickets.get(req_id)
        if t is None:
            return
        if t.prefill_tokens:
            ep = self._eps.get(t.endpoint_id)
            if ep is not None:
                ep.queued_prefill_tokens -= t.prefill_tokens
            t.prefill_tokens = 0
        if ttft_s is not None:
            for plugin in self.policy.listeners:
                plugin.on_first_token(req_id, t.endpoint_id, ttft_s)

    def on_failed(self, req_id: str, *, notify: bool = True) -> None:
        """The endpoint did not serve the request (it failed or refused it): besides undoing the
        counters, forget the prefix blocks this dispatch taught the index, unless a later request
        has used them since."""
        t = self.tickets.get(req_id)
        if t is not None and t.index_tick:
            self.prefix.forget(t.endpoint_id, t.hashes, t.matched_blocks, t.index_tick)
        self.on_finish(req_id, notify=notify)

    def on_finish(self, req_id: str, e2e_s: float | None = None, output_tokens: int = 0, *,
                  notify: bool = True) -> None:
        """Undo a dispatch: finished, failed, cancelled or re-routed. Safe to call twice.

        With ``e2e_s`` (the measured end-to-end latency at the load balancer) the request
        completed and the listeners hear ``on_finished``; without it they hear ``on_failed``.
        ``output_tokens``: tokens generated, 0 when the runtime does not know."""
        t = self.tickets.pop(req_id, None)
        if t is None:
            return
        ep = self._eps.get(t.endpoint_id)
        if ep is not None:  # else removed while the request ran
            ep.inflight -= 1
            ep.inflight_tokens -= t.tokens
            ep.queued_prefill_tokens -= t.prefill_tokens
        listeners = self.policy.listeners if notify else ()  # told after the counters are right again
        if listeners:
            if e2e_s is None:
                for plugin in listeners:
                    plugin.on_failed(req_id, t.endpoint_id)
            else:
                for plugin in listeners:
                    plugin.on_finished(req_id, t.endpoint_id, e2e_s, output_tokens)
