"""The load balancer's state in the live gateway: replicas, the Router, the FIFO queue, probes,
health, circuit breakers. Everything here runs on the event loop's thread, so a routing
decision and its commit are one synchronous step — no burst can see stale in-flight counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import aiohttp

from kvroute.discovery.manager import Discovery
from kvroute.errors import ServiceError
from kvroute.gateway.breaker import CircuitBreaker
from kvroute.gateway.config import GatewayConfig, ProbeConfig, ReplicaConfig
from kvroute.gateway.ejection import Ejector
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.peers import Peering
from kvroute.gateway.probes import (
    VLLM_FILTERED,
    ProbeError,
    ProbeStreak,
    Reading,
    kv_capacity,
    next_probe_interval,
    parse_prometheus,
    probe_forever,
    read_indicators,
    restarted,
    tick_breakers,
)
from kvroute.gateway.tokens import RESIZE_STEP, TokenRatio
from kvroute.gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamPool
from kvroute.model import Decision, DecisionKind, Endpoint, Request
from kvroute.policy import DispatchPacer

if TYPE_CHECKING:
    from kvroute.fleet.sync import FleetSync

log = logging.getLogger("kvroute.gateway")


@dataclass
class Upstream:
    """One replica as the gateway keeps it: its config, the Endpoint the policy sees, breaker, connection
    pool, probe streak, last reading and the models it serves."""

    config: ReplicaConfig
    endpoint: Endpoint
    breaker: CircuitBreaker
    pool: UpstreamPool
    engine: str = "auto"
    streak: ProbeStreak = field(default_factory=ProbeStreak)
    reading: Reading | None = None  # the last successful probe
    restarts: int = 0
    models: frozenset[str] | None = None  # what it serves: configured, or read from /v1/models
    model_cards: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models entries
    models_read_at: float = -1e9
    # what the gateway sent it, for /metrics: attempts, failed attempts, tokens
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0  # the gateway's count of served prompts (the engine's units once learned)
    completion_tokens: int = 0  # the engine's usage, else the token events streamed
    # the abort of every exchange sent to it and not over yet (gateway/proxy.py): called when its
    # probes find nothing listening, so no request keeps waiting on a replica known to be gone
    exchanges: set[Callable[[UpstreamError], None]] = field(default_factory=set)
    # adaptive probing (probes.next_probe_interval) and what probing it costs
    probe_every_s: float = 0.0
    next_probe_at: float = 0.0
    probes: int = 0
    probe_bytes: int = 0
    filtered: bool | None = None  # vLLM's filtered metrics: None untried, then whether they answer


@dataclass
class Waiter:
    """A request the policy held, waiting in the gateway queue for a replica (its future gets the Decision)."""

    request: Request
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class QueueFull(ServiceError):
    """The LB queue is at its configured length; the gateway answers 429."""


class QueueTimeout(ServiceError):
    """No replica took the request within the queue's max wait; the gateway answers 503."""


class PolicyError(ServiceError):
    """The routing policy raised; logged with its traceback, answered 503 without details."""


class Outcome(Enum):
    """What one upstream attempt says about the replica's health (fed to its breaker)."""

    OK = "ok"
    FAILED = "failed"
    NEUTRAL = "neutral"


class Runtime:
    """The gateway's routing state shared by every connection: Router and policy, replicas and their probes,
    the hold queue with its pacing, API keys, metrics and peers."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.policy_name = self._policy_label(config)
        self.router = config.build_router(index_block_tokens=config.block_tokens,
                                          max_prefix_blocks=config.max_prefix_blocks)
        self.upstreams: dict[str, Upstream] = {}
        self.events: Any = None  # the KV-event consumer (kvroute.kvevents), made for the first replica with events
        self.drained: set[str] = set()  # replicas taking no new requests (admin API)
        self._excluded: dict[str | None, tuple[str, ...] | None] = {}  # excluded_for, per model
        for rc in config.replicas:
            self._add(rc)
        self.queue: deque[Waiter] = deque()
        self.pacer = self._pacer(config)
        self._wake: asyncio.TimerHandle | None = None  # a paced drain already scheduled
        self.tokens = TokenRatio()  # engine tokens per estimated token (gateway/tokens.py)
        self._index_scale = 1.0  # the ratio the index's capacity was last computed with
        self.prompt_tokens_routed = 0
        self.hit_tokens_routed = 0
        self.keys = config.auth.key_ring(time.monotonic())
        self.ready = True  # /readyz; false from the moment a drain begins
        self.draining = False
        self.metrics = GatewayMetrics(self)
        self.peering = Peering(self)  # peer gateways and forwarding (gateway/peers.py)
        self.fleet = self._fleet(config)  # sibling instances of this region (kvroute/fleet), or None
        self._probe_task: asyncio.Task | None = None
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

    @staticmethod
    def _policy_label(config: GatewayConfig) -> str:
        policy = config.policy
        if isinstance(policy, str):
            return policy
        return str(policy.get("preset") or policy.get("name") or "composed")  # a composition names itself

    # -- replicas -------------------------------------------------------------------------------
    def _replicas_changed(self) -> None:
        self._excluded.clear()

    def _add(self, rc: ReplicaConfig) -> None:
        ep = Endpoint(rc.name, region=rc.region, zone=rc.zone, weight=rc.weight, block_size=1,
                      kv_blocks=rc.kv_tokens or 0, role=rc.role)
        if rc.max_running:
            ep.max_running = rc.max_running
        self.router.add_endpoint(ep)
        self._follow_events(rc)
        bc = self.config.breaker
        breaker = CircuitBreaker(bc.failures, bc.cooldown_s, bc.successes)
        up = self.upstreams[rc.name] = Upstream(rc, ep, breaker, UpstreamPool(rc.url, tls=rc.tls_context()),
                                                engine=rc.engine)
        self._replicas_changed()
        if rc.models is not None:
            up.models = frozenset(rc.models)
            up.model_cards = [{"id": m, "object": "model", "owned_by": rc.name} for m in rc.models]

    def _follow_events(self, rc: ReplicaConfig) -> None:
        """Subscribe to the replica's KV events (a replica without them is routed on the approximate
        index); the consumer hands its exact table to the prefix index while it trusts it."""
        if rc.kv_events is None:
            if self.events is not None:
                self.events.remove(rc.name)
            return
        from kvroute.kvevents import EventSource, KVEventConsumer

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
        self._replicas_changed()
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
        self._replicas_changed()
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
                up = self.upstreams[name]
                if fresh[name].url != up.config.url:
                    up.pool.close()
                    up.pool = UpstreamPool(fresh[name].url, tls=fresh[name].tls_context())
                if fresh[name].kv_events != up.config.kv_events:
                    self._follow_events(fresh[name])
                up.config, up.engine = fresh[name], fresh[name].engine
                up.endpoint.region, up.endpoint.weight = fresh[name].region, fresh[name].weight
                up.endpoint.zone = fresh[name].zone or fresh[name].region
                changes.append(f"updated {name}")
        if new.policy != self.config.policy:
            policy = new.build_policy()
            self.router.policy = policy
            if policy.uses_ring:
                self.router.ring.add_many(e.id for e in self.router.endpoints)
            self.policy_name = self._policy_label(new)
            changes.append(f"policy {self.policy_name}")
        if (new.block_tokens, new.max_prefix_blocks) != (self.config.block_tokens, self.config.max_prefix_blocks):
            self.router.reset_index(new.block_tokens, new.max_prefix_blocks)
            self._index_scale = 1.0  # in nominal units again: the next probe round rescales it
            if self.events is not None:  # own keys of another block size: follow every replica afresh
                self.events.block_tokens = new.block_tokens
                for r in new.replicas:
                    self._follow_events(r)
            changes.append("prefix index (emptied: new block size or bound)")
        if new.breaker != self.config.breaker:
            bc = new.breaker
            for up in self.upstreams.values():
                up.breaker.threshold, up.breaker.cooldown_s, up.breaker.successes_to_close = (
                    bc.failures, bc.cooldown_s, bc.successes)
            changes.append("breaker thresholds")
        if new.stall != self.config.stall:
            detector = self.stalls.detector
            detector.factor, detector.min_s, detector.max_s = new.stall.factor, new.stall.min_s, new.stall.max_s
            changes.append("stall detection")
        if new.auth != self.config.auth:
            fresh_keys = new.auth.key_ring(time.monotonic())
            for d, state in fresh_keys.keys.items():  # a key that stays keeps its usage
                if d in self.keys.keys:
                    old_state = self.keys.keys[d]
                    state.used_requests, state.used_tokens, state.limited = (
                        old_state.used_requests, old_state.used_tokens, old_state.limited)
            self.keys = fresh_keys
            changes.append("api keys")
        if self.peering.reconfigure(new):
            changes.append("peers")
            if self.fleet is not None:
                self.fleet.rebind()
        if new.fleet != self.config.fleet:
            changes.append("fleet (needs a restart; kept as it was)")
        restart_discovery = new.discovery != self.config.discovery
        self.config = new
        if restart_discovery:
            self._restart_discovery()
            changes.append("discovery (restarted)")
        self.pacer = self._pacer(new)
        self._replicas_changed()
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
        """Route now, or wait in FIFO order while the policy holds (selective pushing)."""
        forward = self.peering.before_local(req)  # GORGO distributed: a cheaper peer
        if forward is not None:
            return forward
        if not self.queue:
            d = self._route(req)
            if d.kind is not DecisionKind.HOLD:
                return d
        qc = self.config.queue
        if len(self.queue) >= qc.max_len:
            raise QueueFull(f"LB queue is full ({qc.max_len} waiting)")
        waiter = Waiter(req, asyncio.get_running_loop().create_future())
        self.queue.append(waiter)
        self.drain_queue()
        try:
            async with asyncio.timeout(qc.max_wait_s):  # unlike wait_for on 3.11, a cancel after
                return await waiter.future  # set_result still cancels: _abandon undoes the dispatch
        except TimeoutError:
            self._abandon(waiter)
            raise QueueTimeout(f"no replica could take the request within {qc.max_wait_s:g} s") from None
        except asyncio.CancelledError:  # the client went away while queued
            self._abandon(waiter)
            raise

    def _abandon(self, w: Waiter) -> None:
        """A waiter gave up: leave the queue, or undo a dispatch it can no longer use — as a
        request never sent: the index forgets its prompt, and a half-open breaker's trial slot
        (taken by the dispatch) is handed back."""
        if not w.future.done():
            w.future.cancel()  # drain_queue skips it
        elif not w.future.cancelled() and w.future.exception() is None and (d := w.future.result()).dispatched:
            self.release(w.request.id, served=False)
            self.attempt_done(d.target or "", Outcome.NEUTRAL)
            if d.prefill is not None:
                self.attempt_done(d.prefill, Outcome.NEUTRAL)

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
            for name in (d.target, d.prefill):  # a prefill/decode pair takes a trial slot on each
                up = self.upstreams.get(name or "")
                if up is not None:
                    if up.probe_every_s > self.config.probe.interval_s:  # idle until now: back to the fast rate
                        up.probe_every_s = self.config.probe.interval_s
                        up.next_probe_at = min(up.next_probe_at, time.monotonic() + up.probe_every_s)
                    up.breaker.dispatched()
                    up.endpoint.circuit_open = not up.breaker.allows
                    if self.events is not None:  # until its BlockStored arrives, the prompt counts as cached there
                        self.events.speculate(up.config.name, req.block_hashes)
        elif d.branch == "policy-error":
            log.error("routing %s: %s", req.id, d.reason)
            raise self._policy_failed()
        return d

    def _policy_failed(self) -> PolicyError:
        self.metrics.policy_errors.inc()
        return PolicyError(f"policy {self.policy_name} failed")

    def drain_queue(self) -> None:
        """Dispatch queued requests, oldest first, while the policy admits them — at most one
        per pacer tick, so a replica that looked free at the last probe is not handed the whole
        queue at once (SkyWalker's LB pops one request per 10 ms). Requests that arrive to an
        empty queue route at once; the admission gate counts them against the probed room."""
        queue, pacer = self.queue, self.pacer
        while queue:
            w = queue[0]
            if w.future.done():
                queue.popleft()
                continue
            if pacer is not None:
                now = time.monotonic()
                if not pacer.ready(now):
                    self._wake_later(pacer.wait_s(now))
                    return
            try:
                d = self._route(w.request)
            except PolicyError as exc:
                queue.popleft()
                w.future.set_exception(exc)
                continue
            if d.kind is DecisionKind.HOLD:
                behind = len(queue) - 1 + (self.fleet.sibling_queue() if self.fleet is not None else 0)
                forward = self.peering.on_hold(w.request, behind)  # SkyWalker: a peer that admits it
                if forward is None:
                    return
                d = forward
            queue.popleft()
            if pacer is not None and d.kind is DecisionKind.DISPATCH:
                pacer.dispatched(time.monotonic())
            self.metrics.queue_wait.observe(time.monotonic() - w.enqueued)
            w.future.set_result(d)

    def _wake_later(self, delay_s: float) -> None:
        if self._wake is None:
            self._wake = asyncio.get_running_loop().call_later(delay_s, self._paced_drain)

    def _paced_drain(self) -> None:
        self._wake = None
        self.drain_queue()

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
        if outcome is Outcome.OK:
            breaker.success()
        elif outcome is Outcome.FAILED:
            up.errors += 1
            breaker.failure(time.monotonic())
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
        await self.probe_all()
        self._probe_task = asyncio.create_task(
            probe_forever(lambda: self.config.probe.interval_s, self.probe_due, "probe round failed"))
        self.peering.start()
        self.stalls.start()
        if self.fleet is not None:
            self.fleet.start()

    async def stop(self) -> None:
        """Stop probing, fail every queued request with QueueTimeout (shutting down) and close sessions and
        pools."""
        if self._wake is not None:
            self._wake.cancel()
        if self._probe_task:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        if self.discovery is not None:
            await self.discovery.stop()
        await self.peering.stop()
        await self.stalls.stop()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.events is not None:
            await self.events.stop()
        for w in self.queue:
            if not w.future.done():
                w.future.set_exception(QueueTimeout("gateway is shutting down"))
        if self.session:
            await self.session.close()
        for up in self.upstreams.values():
            up.pool.close()

    async def probe_all(self) -> None:
        """Probe every replica once, in parallel; then tick the breakers, rescale the prefix index and let
        queued requests go where a replica freed up."""
        await self._probe_round(force=True)

    async def probe_due(self) -> None:
        """One round of the probe loop: the replicas whose adaptive interval has come
        (``probes.next_probe_interval``), then the same bookkeeping as :meth:`probe_all`."""
        await self._probe_round(force=False)

    async def _probe_round(self, force: bool) -> None:
        ups = list(self.upstreams.values())
        now = time.monotonic()
        slack = self.config.probe.interval_s / 2  # a round that runs a little early still probes what is due
        await asyncio.gather(*(self._probe(up) for up in ups if force or up.next_probe_at <= now + slack))
        tick_breakers(ups, time.monotonic())
        self._rescale_index()
        self.drain_queue()

    def _rescale_index(self) -> None:
        """A prefix block is a fixed span of bytes; when the learned token ratio has moved, its
        worth in tokens, and so each index's capacity in blocks, follows (gateway/tokens.py)."""
        scale = self.tokens.scale
        if abs(scale / self._index_scale - 1) <= RESIZE_STEP:
            return
        self._index_scale = scale
        self.router.index_block_tokens = self.tokens.block_tokens(self.config.block_tokens)
        for ep in self.router.all_endpoints:
            self.router.resize_index(ep.id)

    async def _probe(self, up: Upstream) -> None:
        pc = self.config.probe
        ep = up.endpoint
        t0 = time.monotonic()
        try:
            await self._read_probe(up, pc, ep, t0)
        finally:
            reading = up.reading
            idle = ep.healthy and ep.inflight == 0 and reading is not None and reading.running == 0 \
                and reading.waiting == 0
            up.probe_every_s = next_probe_interval(up.probe_every_s, idle, pc.interval_s, pc.idle_interval_s)
            up.next_probe_at = t0 + up.probe_every_s

    async def _scrape(self, up: Upstream, path: str, timeout_s: float) -> str:
        """One GET of the replica's metrics at ``path``; its text (ProbeError unless 200)."""
        assert self.session is not None, "probing before start()"
        # identity: prometheus_client's app (vLLM's /metrics/) gzips for a client that accepts it
        async with self.session.get(f"{up.config.url}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    headers={"Accept-Encoding": "identity"},
                                    ssl=up.pool.tls if up.pool.tls is not None else True) as resp:
            if resp.status != 200:
                raise ProbeError(f"{path.split('?')[0]} answered {resp.status}")
            text = await resp.text()
        up.probe_bytes += len(text)
        return text

    async def _read_probe(self, up: Upstream, pc: ProbeConfig, ep: Endpoint, t0: float) -> None:
        up.probes += 1
        try:
            reading = None
            if up.engine == "vllm" and up.filtered is not False:  # only the series routing reads
                try:
                    text = await self._scrape(up, VLLM_FILTERED, pc.timeout_s)
                    reading = read_indicators(parse_prometheus(text), up.engine)
                    up.filtered = True
                except ProbeError as exc:  # an engine that does not filter: the whole page from now on
                    up.filtered = False
                    log.info("replica %s: filtered metrics refused (%s); reading /metrics", ep.id, exc)
            if reading is None:
                text = await self._scrape(up, "/metrics", pc.timeout_s)
                reading = read_indicators(parse_prometheus(text), up.engine)
            if reading.kv_tokens is None:
                reading.kv_tokens = kv_capacity(text)
        except (TimeoutError, aiohttp.ClientError, ProbeError, UnicodeDecodeError) as exc:
            self.metrics.probe_failures.labels(ep.id).inc()
            if up.streak.failed(ep.healthy, pc.unhealthy_after):
                ep.healthy = False
                why = str(exc) or ("timed out" if isinstance(exc, TimeoutError) else exc.__class__.__name__)
                log.warning("replica %s (%s) ejected after %d failed probes: %s", ep.id, up.config.url,
                            up.streak.fails, why)
                if isinstance(exc, aiohttp.ClientConnectorError) and up.exchanges:
                    # nothing listens there (the engine died or restarted): the exchanges still open
                    # to it cannot be answered, whether or not their connection's close reached us;
                    # failed now, they are retried elsewhere (a non-streamed one would otherwise wait
                    # up to timeouts.non_stream_s for a head)
                    log.warning("replica %s: %d request(s) in flight there retried elsewhere", ep.id,
                                len(up.exchanges))
                    for abort in list(up.exchanges):
                        abort(UpstreamConnectError(f"replica {ep.id} ejected: {why}"))
            return
        ep.rtt_s = up.streak.rtt(time.monotonic() - t0, pc.rtt_ewma)
        if up.engine == "auto":
            up.engine = reading.engine
            self._replicas_changed()
        if restarted(up.reading, reading):  # a restart faster than ejection: the cache is gone
            up.restarts += 1
            self.router.forget_cache(ep.id)
            if self.events is not None:
                self.events.restarted(ep.id)  # its sequence starts over: replay from 0
            self.tokens.forget(ep.id)  # it may serve another model (tokenizer) now
            ep.warming = True  # its cache is empty: the warm-up rule may let it in
            log.warning("replica %s restarted (process start time or counters reset); its cache entries "
                        "are forgotten", ep.id)
        elif up.reading is None and reading.kv_usage is None:
            log.info("replica %s (%s) exports no KV-cache usage; KV-aware scores treat it as empty",
                     ep.id, reading.engine)
        if reading.kv_tokens and not up.config.kv_tokens and ep.kv_blocks != reading.kv_tokens:
            ep.kv_blocks = reading.kv_tokens  # block_size 1: capacity in tokens
            self.router.resize_index(ep.id)
            log.info("replica %s holds %d KV tokens (from its metrics); its prefix index is bounded to that",
                     ep.id, reading.kv_tokens)
        up.reading = reading
        if up.config.models is None and t0 - up.models_read_at >= pc.models_every_s:
            up.models_read_at = t0
            await self._read_models(up)
        ep.apply_probe(reading.running, reading.waiting, reading.kv_usage)
        if up.streak.succeeded(ep.healthy, pc.healthy_after):
            ep.healthy = True
            self.router.forget_cache(ep.id)  # it may have restarted with an empty cache
            if self.events is not None:
                self.events.restarted(ep.id)
            ep.warming = True
            log.info("replica %s re-admitted", ep.id)

    async def _read_models(self, up: Upstream) -> None:
        """What the replica serves, from its /v1/models (kept as it was when the read fails)."""
        assert self.session is not None
        try:
            async with self.session.get(f"{up.config.url}/v1/models",
                                        ssl=up.pool.tls if up.pool.tls is not None else True,
                                        timeout=aiohttp.ClientTimeout(total=self.config.probe.timeout_s)) as r:
                data = (await r.json(content_type=None)).get("data") if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return
        if isinstance(data, list):
            cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
            up.model_cards = cards
            models = frozenset(c["id"] for c in cards)
            if models != up.models:
                up.models = models
                self._replicas_changed()
