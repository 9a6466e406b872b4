"""The load balancer's state in the live gateway: replicas, the Router, health, circuit breakers,
accounting and reloads; the hold queue is :mod:`.holdqueue`, the probes :mod:`.prober`, one
replica's record :mod:`.replica`. Everything here runs on the event loop's thread, so a routing
decision and its commit are one synchronous step — no burst can see stale in-flight counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Final

import aiohttp

from kvroute.discovery.manager import Discovery
from kvroute.gateway.breaker import CircuitBreaker
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.ejection import Ejector
from kvroute.gateway.holdqueue import HoldQueue, PolicyError
from kvroute.gateway.hotconfig import HotConfig
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.peers import Peering
from kvroute.gateway.prober import Prober
from kvroute.gateway.reload import retune, update_replica
from kvroute.gateway.replica import Outcome, Upstream
from kvroute.gateway.tokens import TokenRatio
from kvroute.gateway.upstream import UpstreamPool
from kvroute.model import Decision, DecisionKind, Endpoint, Request
from kvroute.policy import DispatchPacer
from kvroute.policy.router import Router
from kvroute.replicas import ReplicaConfig

if TYPE_CHECKING:
    from kvroute.fleet.sync import FleetSync

log = logging.getLogger("kvroute.gateway")
# Final: a compiled build reads these from C statics, where a module global or a module's attribute is
# a dict lookup per use (issue 25, fifth round: ~80 of them per request; docs/hot-path.md)
_OK: Final = Outcome.OK
_FAILED: Final = Outcome.FAILED
_NEUTRAL: Final = Outcome.NEUTRAL
monotonic: Final = time.monotonic


class Runtime:
    """The gateway's routing state shared by every connection: Router and policy, replicas and their probes,
    the hold queue with its pacing, API keys, metrics and peers."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.hot = HotConfig(config)  # what each request reads, as plain attributes (gateway/hotconfig.py)
        self.policy_name = config.policy_label
        # typed, so a compiled build calls it and reads its decisions natively (PDRouter is a Router)
        self.router: Router = config.build_router(index_block_tokens=config.block_tokens,
                                          max_prefix_blocks=config.max_prefix_blocks)
        self.upstreams: dict[str, Upstream] = {}
        self.events: Any = None  # the KV-event consumer (kvroute.kvevents), made for the first replica with events
        self.drained: set[str] = set()  # replicas taking no new requests (admin API)
        self._excluded: dict[str | None, tuple[str, ...] | None] = {}  # excluded_for, per model
        for rc in config.replicas:
            self._add(rc)
        self.hold = HoldQueue(lambda: self.config.queue, self._route, self._forward_held, self._undo,
                              lambda s: self.metrics.queue_wait.observe(s))  # gateway/holdqueue.py
        self.queue = self.hold.waiting  # the held requests, oldest first
        self.hold.pacer = self._pacer(config)
        self.tokens = TokenRatio()  # engine tokens per estimated token (gateway/tokens.py)
        self.prompt_tokens_routed = 0
        self.hit_tokens_routed = 0
        self.keys = config.auth.key_ring(monotonic())
        self.ready = True  # /readyz; false from the moment a drain begins
        self.draining = False
        self.metrics = GatewayMetrics(self)
        self.peering = Peering(self)  # peer gateways and forwarding (gateway/peers.py)
        self.fleet = self._fleet(config)  # sibling instances of this region (kvroute/fleet), or None
        self.prober = Prober(self)  # replica probes (gateway/prober.py)
        self.stalls = Ejector(self)  # stall detection from request progress (gateway/outlier.py)
        self.session: aiohttp.ClientSession | None = None
        self.discovery = self._discovery(config)  # engines that come and go (kvroute/discovery)
        self._discovery_swap: asyncio.Task | None = None  # a reload's restart of discovery, running

    def _discovery(self, config: GatewayConfig) -> Discovery | None:
        return Discovery(self) if config.discovery else None

    def _fleet(self, config: GatewayConfig) -> FleetSync | None:
        if config.fleet is None:
            return None
        from kvroute.fleet.sync import FleetSync  # nats-py is an optional extra

        return FleetSync(self, config.fleet)

    def _pacer(self, config: GatewayConfig) -> DispatchPacer | None:
        """Pace the queue only for policies that can hold requests in it (selective pushing)."""
        tick = config.queue.dispatch_tick_s
        return DispatchPacer(tick) if tick > 0 and self.router.policy.admission.holds else None

    # -- replicas -------------------------------------------------------------------------------
    def replicas_changed(self) -> None:
        """A replica came, went, was drained, or its engine or models changed: exclusions are recomputed."""
        self._excluded.clear()

    def _add(self, rc: ReplicaConfig) -> None:
        ep = Endpoint(rc.name, region=rc.region, zone=rc.zone, weight=rc.weight, block_size=1,
                      kv_blocks=rc.kv_tokens or 0, role=rc.role, accelerator=rc.accelerator)
        ep.healthy = False  # not routable until a probe answers (gateway/prober.py); Upstream.starting
        if rc.max_running:
            ep.max_running = rc.max_running
        self.router.add_endpoint(ep)
        self.follow_events(rc)
        bc = self.config.breaker
        breaker = CircuitBreaker(bc.failures, bc.cooldown_s, bc.successes)
        up = self.upstreams[rc.name] = Upstream(rc, ep, breaker, UpstreamPool(rc.url, tls=rc.tls_context()),
                                                engine=rc.engine)
        self.replicas_changed()
        if rc.models is not None:
            up.models = frozenset(rc.models)
            up.model_cards = [{"id": m, "object": "model", "owned_by": rc.name} for m in rc.models]

    def follow_events(self, rc: ReplicaConfig) -> None:
        """Subscribe to the replica's KV events (a replica without them is routed on the approximate
        index); the consumer hands its exact table to the prefix index while it trusts it."""
        if rc.kv_events is None:
            if self.events is not None:
                self.events.remove(rc.name)
            return
        # the defining module, not the package: its lazy __getattr__ is not seen by a compiled from-import
        from kvroute.kvevents.consumer import EventSource, KVEventConsumer

        if self.events is None:
            ks = self.config.kv_events
            self.events = KVEventConsumer(self.config.block_tokens, stale_s=ks.stale_s,
                                          speculative_ttl_s=ks.speculative_ttl_s,
                                          replay_timeout_s=ks.replay_timeout_s, on_change=self._events_changed)
        ec = rc.kv_events
        self.router.use_cache_table(rc.name, None)
        self.events.add(rc.name, EventSource(ec.endpoint, ec.replay_endpoint, ec.topic, ec.dp_ranks))

    def _events_changed(self, name: str, table: dict[int, int] | None) -> None:
        self.router.use_cache_table(name, table)

    def kv_source(self, name: str) -> dict[str, Any]:
        """Where the replica's prefix index comes from: ``events`` (its KV events), ``stale`` (events
        lost: approximate until rebuilt) or ``approximate`` (no events), with the consumer's status."""
        status = self.events.status(name) if self.events is not None else None
        return status if status is not None else {"source": "approximate"}

    def add_replica(self, rc: ReplicaConfig) -> None:
        """Add a replica at run time (admin API); it is probed from the next round on."""
        self._add(rc)
        log.info("replica %s added at run time (%s)", rc.name, rc.url)

    def remove_replica(self, name: str) -> None:
        """Remove a replica at run time; its in-flight requests finish where they are."""
        self._drop(name)
        self.replicas_changed()
        log.info("replica %s removed at run time", name)

    def _drop(self, name: str) -> None:
        """Forget a replica: routing, its pool, its token ratio and its drained mark."""
        self.router.remove_endpoint(name)
        if self.events is not None:
            self.events.remove(name)
        self.upstreams.pop(name).pool.close()
        self.tokens.forget(name)
        self.drained.discard(name)
        self.stalls.forget(name)

    def set_drained(self, name: str, drained: bool) -> None:
        """A drained replica takes no new requests; its in-flight ones finish."""
        (self.drained.add if drained else self.drained.discard)(name)
        self.replicas_changed()
        log.info("replica %s %s", name, "drained" if drained else "taking requests again")
        if not drained:
            self.drain_queue()

    def excluded_for(self, model: str | None) -> tuple[str, ...] | None:
        """Replicas a request for ``model`` must not go to (drained ones, and those not serving
        the model); None when no replica serves it. A replica whose model list is not known yet
        may serve anything, and so may a llama-server: it serves its one model whatever name a
        request gives. Cached per model: this runs for every request."""
        if model in self._excluded:
            return self._excluded[model]
        out: tuple[str, ...] | None = tuple(self.drained)
        if model is not None and any(up.models is not None for up in self.upstreams.values()):
            unfit = tuple(name for name, up in self.upstreams.items()
                          if not (up.models is None or model in up.models or up.engine == "llamacpp"))
            out = None if len(unfit) == len(self.upstreams) else (*self.drained, *unfit)
        self._excluded[model] = out
        return out

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the healthy replicas' /v1/models entries, one per model id."""
        cards: dict[str, dict[str, Any]] = {}
        for up in self.upstreams.values():
            if up.endpoint.healthy:
                for card in up.model_cards:
                    cards.setdefault(str(card.get("id")), card)
        return list(cards.values())

    def reconfigure(self, new: GatewayConfig) -> list[str]:
        """Apply a reloaded config without dropping requests: replicas are added and removed,
        the policy swapped; in-flight requests finish where they are."""
        changes = []
        old = {r.name: r for r in self.config.replicas}
        fresh = {r.name: r for r in new.replicas}
        for name in old.keys() - fresh.keys():
            self._drop(name)
            changes.append(f"removed {name}")
        for name in fresh.keys() - old.keys():
            self._add(fresh[name])
            changes.append(f"added {name}")
        for name in fresh.keys() & old.keys():
            if fresh[name].role != old[name].role:  # another side of a P/D deployment: route it anew
                self._drop(name)
                self._add(fresh[name])
                changes.append(f"updated {name} (role {fresh[name].role})")
            elif fresh[name] != old[name]:
                changes.append(update_replica(self, fresh[name]))
        if new.policy != self.config.policy:
            policy = new.build_policy()
            self.router.policy = policy
            if policy.uses_ring:
                self.router.ring.add_many(e.id for e in self.router.endpoints)
            self.policy_name = new.policy_label
            changes.append(f"policy {self.policy_name}")
        if (new.block_tokens, new.max_prefix_blocks) != (self.config.block_tokens, self.config.max_prefix_blocks):
            self.router.reset_index(new.block_tokens, new.max_prefix_blocks)
            self.prober.index_scale = 1.0  # in nominal units again: the next probe round rescales it
            if self.events is not None:  # own keys of another block size: follow every replica afresh
                self.events.block_tokens = new.block_tokens
                for r in new.replicas:
                    self.follow_events(r)
            changes.append("prefix index (emptied: new block size or bound)")
        changes += retune(self, new)
        if self.peering.reconfigure(new):
            changes.append("peers")
            if self.fleet is not None:
                self.fleet.rebind()
        if new.fleet != self.config.fleet:
            changes.append("fleet (needs a restart; kept as it was)")
        restart_discovery = new.discovery != self.config.discovery
        self.config, self.hot = new, HotConfig(new)
        if restart_discovery:
            self._restart_discovery()
            changes.append("discovery (restarted)")
        self.hold.pacer = self._pacer(new)
        self.replicas_changed()
        self.drain_queue()
        return changes

    def _restart_discovery(self) -> None:
        """A reload changed ``discovery:``: stop the old sources, drop what they added, start the new."""
        old, self.discovery = self.discovery, self._discovery(self.config)

        async def swap() -> None:
            if old is not None:
                await old.stop()
                for source in list(old.reconciler.owned):
                    old.reconciler.forget(source)
            if self.discovery is not None:
                await self.discovery.start()
        if self.session is not None:  # started: swap in the background (reconfigure is synchronous)
            self._discovery_swap = asyncio.get_running_loop().create_task(swap())

    # -- admission and accounting ----------------------------------------------------------------
    async def admit(self, req: Request) -> Decision:
        """Route now, or wait in FIFO order while the policy holds (selective pushing); a held
        request may go to a peer (:meth:`Peering.on_hold`)."""
        return await self.hold.admit(req)

    def route_now(self, req: Request) -> Decision | None:
        """:meth:`admit` without a coroutine when it need not wait (the proxy's hot path): the
        decision made at once; None when the request must wait in the hold queue (then
        ``await hold.wait(req)``, where a held head may go to a peer)."""
        return self.hold.try_now(req)

    def _forward_held(self, req: Request, behind: int) -> Decision | None:
        """A held request with ``behind`` others queued after it here: a peer that admits it (SkyWalker,
        counting the queues of this region's sibling instances too) or a cheaper one (GORGO distributed)."""
        if self.fleet is not None:
            behind += self.fleet.sibling_queue()
        return self.peering.on_hold(req, behind)

    def _undo(self, req: Request, d: Decision) -> None:
        """A queued request gave up after it was dispatched: as a request never sent, the index
        forgets its prompt, and a half-open breaker's trial slot (taken by the dispatch) is handed back."""
        self.release(req.id, served=False)
        self.attempt_done(d.target or "", _NEUTRAL)
        if d.prefill is not None:
            self.attempt_done(d.prefill, _NEUTRAL)

    def _route(self, req: Request) -> Decision:
        """Decide and commit; a dispatch to a half-open replica takes its single trial slot.
        A policy that raised (the policy layer turns that into a ``policy-error`` decision) is
        logged and counted here, and reaches the client as a PolicyError without its details."""
        try:
            d = self.router.route(req)
        except Exception as exc:
            log.exception("routing %s raised", req.id)
            raise self._policy_failed() from exc
        if d.kind is DecisionKind.DISPATCH:
            # a prefill/decode pair takes a trial slot on each (written out, not a loop over a tuple made
            # per decision: issue 25's ninth round)
            if d.target is not None:
                self._took(d.target, req)
            if d.prefill is not None:
                self._took(d.prefill, req)
        elif d.branch == "policy-error":
            log.error("routing %s: %s", req.id, d.reason)
            raise self._policy_failed()
        elif d.kind is DecisionKind.NONE and d.branch == "all-filtered":
            starting = self._starting_for(req)
            if starting:  # its first answer is due within a few probe intervals: wait for it, bounded
                return Decision.hold(f"waiting for {', '.join(starting)} to answer a first probe")
        return d

    def _took(self, name: str, req: Request) -> None:
        """A dispatch to replica ``name``: its probe rate, its breaker's trial slot, its KV speculation."""
        up = self.upstreams.get(name)
        if up is not None:
            if up.probe_every_s > self.hot.probe_interval_s:  # idle until now: back to the fast rate
                up.probe_every_s = self.hot.probe_interval_s
                up.next_probe_at = min(up.next_probe_at, monotonic() + up.probe_every_s)
            up.breaker.dispatched()
            up.endpoint.circuit_open = not up.breaker.allows
            if self.events is not None:  # until its BlockStored arrives, the prompt counts as cached there
                self.events.speculate(up.config.name, req.block_hashes)

    def _starting_for(self, req: Request) -> list[str]:
        """The replicas ``req`` could go to once they answer their first probe (``Upstream.starting``):
        not excluded for it (drained, failed it, not serving its model) and inside its residency zone."""
        unhealthy_after = self.config.probe.unhealthy_after
        zone = req.residency
        return [name for name, up in self.upstreams.items()
                if up.starting(unhealthy_after) and name not in req.exclude and name not in self.drained
                and (zone is None or up.endpoint.zone == zone)]

    def _policy_failed(self) -> PolicyError:
        self.metrics.policy_errors.inc()
        return PolicyError(f"policy {self.policy_name} failed")

    def held_requests(self) -> list[Request]:
        """The requests waiting in the hold queue, oldest first."""
        return [w.request for w in self.queue if not w.future.done()]

    def region_queue(self) -> tuple[int, int]:
        """Requests held in this region — here and at this instance's fleet siblings — and their prompt tokens."""
        waiting = self.held_requests()
        n, tokens = len(waiting), sum(r.prompt_tokens for r in waiting)
        if self.fleet is not None:
            n += self.fleet.sibling_queue()
            tokens += self.fleet.sibling_queued_tokens()
        return n, tokens

    def drain_queue(self) -> None:
        """Dispatch held requests while the policy admits them (:meth:`HoldQueue.drain`)."""
        self.hold.drain()

    def dispatched(self, req: Request, d: Decision) -> None:
        """A decision is about to be forwarded (the fleet hears of it: its siblings count it)."""
        self.metrics.count_branch(self.policy_name, d.branch)
        if self.fleet is not None and d.target is not None:
            self.fleet.dispatched(req, d.target)

    def first_token(self, rid: str, ttft_s: float | None = None) -> None:
        """The first token of ``rid`` arrived, ``ttft_s`` after the request reached the gateway."""
        self.router.on_first_token(rid, ttft_s)
        if self.fleet is not None:
            self.fleet.prefill_done(rid)

    def release(self, rid: str, served: bool = True, e2e_s: float | None = None, output_tokens: int = 0) -> None:
        """An attempt ended. ``served``: the engine took the request, so its prompt counts in the
        hit ratio and stays indexed; otherwise (failed, refused) the index forgets what this
        dispatch taught it. ``e2e_s``: the request completed, this long after it reached the
        gateway; ``output_tokens``: what it generated (the policy's plugins learn from both, as
        in the simulator)."""
        router = self.router
        ticket = router.tickets.get(rid)
        if ticket is not None and served:
            tokens = ticket.tokens
            up = self.upstreams.get(ticket.endpoint_id)
            if up is not None:
                up.prompt_tokens += tokens
                up.completion_tokens += output_tokens
            self.prompt_tokens_routed += tokens
            self.hit_tokens_routed += min(tokens, ticket.matched_blocks * router.index_block_tokens)
            router.on_finish(rid, e2e_s, output_tokens)
        else:
            router.on_failed(rid)
        self.peering.release(rid, served)
        if self.fleet is not None:
            self.fleet.released(rid, served)
        if self.queue:
            self.drain_queue()

    def attempt_done(self, name: str, outcome: Outcome) -> None:
        """Count one attempt and feed its outcome to the replica's breaker."""
        up = self.upstreams.get(name)
        if up is None:
            self.peering.attempt_done(name, outcome.value)
            return
        up.requests += 1
        breaker = up.breaker
        if outcome is _OK:
            breaker.success()
        elif outcome is _FAILED:
            up.errors += 1
            breaker.failure(monotonic())
        else:
            breaker.neutral()
        up.endpoint.circuit_open = not breaker.allows
        if self.queue and breaker.allows:
            self.drain_queue()

    # -- probes -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the probe session, probe every replica once (so the first request sees real load), then keep
        probing replicas and peers in the background."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=False),
            auto_decompress=False)
        if self.discovery is not None:
            await self.discovery.start()
        if self.events is not None:
            await self.events.start()
        await self.prober.probe_all()
        self.prober.start()
        self.peering.start()
        self.stalls.start()
        if self.fleet is not None:
            self.fleet.start()

    async def stop(self) -> None:
        """Stop probing, fail every queued request with QueueTimeout (shutting down) and close sessions and
        pools."""
        self.hold.stop_pacing()
        await self.prober.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.peering.stop()
        await self.stalls.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.events is not None:
            await self.events.stop()
        self.hold.close()
        if self.session:
            await self.session.close()
        for up in self.upstreams.values():
            up.pool.close()
