"""Several gateways per region as one: the NATS transport of the fleet ledger (``fleet/ledger.py``).

Each instance publishes its own requests' lifecycle on the region's subject
(``<subject_prefix>.<region>``, or ``.all`` for every region's gateways with ``scope: all``; NATS
core, fire and forget — Dynamo's ``--router-replica-sync`` design) and applies what the others
publish. Every ``heartbeat_s`` it sends a heartbeat with its LB queue, and every ``snapshot_every``
heartbeats its whole in-flight set; an instance silent for ``timeout_s`` is forgotten.

**Without NATS** the gateway keeps routing on its own view and says so: at start it routes while
the connection is attempted in the background (forever, every ``reconnect_s``); when the
connection drops it forgets every sibling at once (their load can no longer be followed), logs
one warning, ``kvroute_fleet_connected`` goes to 0 and ``/health`` and ``GET /admin/fleet`` show
``"sync": "local-view"``. Messages are not buffered while disconnected (they would be stale);
on reconnection the instance says ``hello`` — every sibling answers with a snapshot — and sends
its own, so the views agree again within one NATS round trip, and one info line says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from array import array
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import xxhash
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from kvroute.errors import ServiceError
from kvroute.fleet.ledger import (
    PEER,
    REPLICA,
    BadMessage,
    Ledger,
    add_message,
    decode,
    encode,
    simple_message,
    snapshot_message,
)

if TYPE_CHECKING:
    from kvroute.fleet.config import FleetConfig
    from kvroute.model import Request
    from kvroute.policy import Router

log = logging.getLogger("kvroute.fleet")


class _Registry(Protocol):
    @property
    def registry(self) -> CollectorRegistry:
        """Where the fleet's counters and gauges join the gateway's."""


class _Region(Protocol):
    @property
    def region(self) -> str:
        """The gateway's region (the fleet subject's last part)."""


class _PeerTable(Protocol):
    @property
    def router(self) -> Router:
        """The peer Router (forwards are mirrored into it)."""

    @property
    def links(self) -> Mapping[str, object]:
        """The peer gateways by name."""


class FleetHost(Protocol):
    """What a fleet instance reads of, and tells, the gateway runtime it belongs to."""

    @property
    def config(self) -> _Region:
        """The gateway's config (its region)."""

    @property
    def router(self) -> Router:
        """The local replicas' Router (siblings' dispatches are mirrored into it)."""

    @property
    def peering(self) -> _PeerTable:
        """The peer layer's Router and links."""

    @property
    def upstreams(self) -> Mapping[str, object]:
        """The replicas by name."""

    @property
    def events(self) -> Any:
        """The KV-event consumer (kvroute.kvevents), or None."""

    @property
    def metrics(self) -> _Registry:
        """The gateway's metrics."""

    def held_requests(self) -> list[Request]:
        """The requests waiting in this instance's hold queue."""

    def drain_queue(self) -> None:
        """Capacity a sibling freed may let held requests go."""


class FleetUnavailable(ServiceError, RuntimeError):
    """The fleet section is configured but its client library is missing (install ``kvroute[fleet]``)."""


def instance_name(configured: str | None) -> str:
    """This instance's name on the fleet subject: configured, else host-pid-random (unique per process,
    so a restarted instance is a new sibling and the old one's state expires)."""
    return configured or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class FleetSync:
    """One gateway's membership in its region's fleet: publishes its dispatches, mirrors the others'."""

    def __init__(self, runtime: FleetHost, config: FleetConfig):
        try:
            import nats  # noqa: F401 - checked at construction, so a missing extra fails at start-up
        except ImportError:
            raise FleetUnavailable("the fleet section needs nats-py: pip install 'kvroute[fleet]'") from None
        self.rt = runtime
        self.config = config
        self.name = instance_name(config.instance)
        scope = runtime.config.region if config.scope == "region" else "all"  # all: every region's gateways
        self.subject = f"{config.subject_prefix}.{scope}"
        self.ledger = Ledger(self.name, self._routers(), config.timeout_s)
        self.own: dict[str, str] = {}  # request id → layer, for our dispatches in flight
        self.seq = itertools.count()
        self.outbox: deque[bytes] = deque()
        self._wake = asyncio.Event()
        self.nc: Any = None
        self.connected = False
        self.ever_connected = False
        self.since = time.monotonic()  # of the current state
        self._tasks: list[asyncio.Task] = []
        self._bad_logged: set[str] = set()  # senders whose malformed messages were logged once
        self._skip_logged: set[str] = set()
        r = runtime.metrics.registry
        self.sent = Counter("kvroute_fleet_messages_sent", "Fleet messages published, by type", ["type"], registry=r)
        self.received = Counter("kvroute_fleet_messages_received", "Fleet messages applied, by type", ["type"],
                                registry=r)
        self.bad = Counter("kvroute_fleet_bad_messages", "Fleet messages refused as malformed", registry=r)
        self.lost = Counter("kvroute_fleet_lost_messages", "Sibling messages missed (sequence gaps; the next "
                            "snapshot repairs them)", registry=r)
        self.dropped = Counter("kvroute_fleet_unsent_messages", "Messages not sent because NATS was unreachable",
                               registry=r)
        self.expired = Counter("kvroute_fleet_siblings_expired", "Siblings forgotten after timeout_s of silence",
                               registry=r)
        r.register(_FleetCollector(self))

    def _routers(self) -> dict[str, Any]:
        return {REPLICA: self.rt.router, PEER: self.rt.peering.router}

    def rebind(self) -> None:
        """The peer Router was rebuilt (a reload changed the peers): mirror into the new one."""
        self.ledger.routers = self._routers()

    # -- what the runtime tells us -----------------------------------------------------------------
    def dispatched(self, req: Request, target: str) -> None:
        """``req`` was committed to ``target`` (a replica, or a peer gateway)."""
        layer = PEER if target in self.rt.peering.links else REPLICA
        ticket = self.ledger.routers[layer].tickets.get(req.id)
        if ticket is None:
            return
        self.own[req.id] = layer
        self._send(add_message(self.name, next(self.seq), req.id, ticket, req.block_tokens, layer))

    def prefill_done(self, rid: str) -> None:
        """The first token of ``rid`` arrived."""
        if rid in self.own:
            self._send(simple_message("prefill", self.name, next(self.seq), id=rid))

    def released(self, rid: str, served: bool) -> None:
        """An attempt of ``rid`` ended (``served``: the engine took it)."""
        if self.own.pop(rid, None) is not None:
            self._send(simple_message("free", self.name, next(self.seq), id=rid, ok=served))

    def sibling_queue(self) -> int:
        """Requests waiting in the other instances' LB queues."""
        return self.ledger.queue()

    def sibling_queued_tokens(self) -> int:
        """Prompt tokens waiting in the other instances' LB queues."""
        return self.ledger.queued_tokens()

    # -- state ------------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``synced`` while connected, else ``local-view``."""
        return "synced" if self.connected else "local-view"

    def view(self) -> dict[str, Any]:
        """What ``GET /admin/fleet`` shows: sync state, siblings, and the event-built index's
        fingerprints (:func:`index_fingerprints`)."""
        now = time.monotonic()
        return {"instance": self.name, "subject": self.subject, "nats": self.config.nats_url, "sync": self.state,
                "state_for_s": round(now - self.since, 3), "own_inflight": len(self.own),
                "siblings": [{"name": s.name, "last_seen_s": round(now - s.last_seen, 3), "queue": s.queue,
                              "inflight": len(s.requests)} for s in self.ledger.siblings.values()],
                "event_index": index_fingerprints(self.rt)}

    # -- the loop side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect in the background and start heartbeats (routing does not wait for NATS)."""
        self._tasks = [asyncio.create_task(self._connect()), asyncio.create_task(self._publisher()),
                       asyncio.create_task(self._ticker())]

    async def stop(self) -> None:
        """Stop the heartbeats and the publisher, say ``bye`` (siblings forget us at once; a killed
        instance is forgotten after ``timeout_s``), then close the connection. The bye is the last
        message: one published after it (a heartbeat while NATS confirmed the bye) would bring this
        instance back at its siblings until their timeout forgot it again."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.connected and self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subject, encode(simple_message("bye", self.name, next(self.seq))))
                await asyncio.wait_for(self.nc.flush(), 1.0)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 2.0)

    async def _connect(self) -> None:
        import nats

        cfg = self.config
        failures = 0

        async def on_error(exc: Exception) -> None:
            nonlocal failures
            failures += 1
            if failures == 1 and not self.ever_connected:  # once; a lost connection logs in _set_connected
                log.warning("fleet: NATS at %s: %s (retrying every %g s; routing on this instance's own view "
                            "meanwhile)", cfg.nats_url, exc or exc.__class__.__name__, cfg.reconnect_s)

        async def on_disconnect() -> None:
            self._set_connected(False)

        async def on_reconnect() -> None:
            nonlocal failures
            failures = 0
            self._set_connected(True)

        self.nc = await nats.connect(
            cfg.nats_url, name=f"kvroute-{self.name}", no_echo=True, allow_reconnect=True,
            max_reconnect_attempts=-1, reconnect_time_wait=cfg.reconnect_s, connect_timeout=cfg.connect_timeout_s,
            ping_interval=cfg.ping_interval_s, max_outstanding_pings=2, error_cb=on_error,
            disconnected_cb=on_disconnect, reconnected_cb=on_reconnect)
        await self.nc.subscribe(self.subject, cb=self._on_message)
        failures = 0
        self._set_connected(True)

    def _set_connected(self, up: bool) -> None:
        if up == self.connected:
            return
        self.connected, self.since = up, time.monotonic()
        if up:
            first = not self.ever_connected
            self.ever_connected = True
            log.info("fleet: %s NATS at %s as %s (subject %s); asking the siblings for their state",
                     "joined" if first else "reconnected to", self.config.nats_url, self.name, self.subject)
            self._send(simple_message("hello", self.name, next(self.seq)))
            self._send_snapshot()
        else:
            n = len(self.ledger.siblings)
            self.outbox.clear()
            if self.ledger.forget_all():
                self.rt.drain_queue()
            log.warning("fleet: lost NATS at %s; routing on this instance's own view (%d sibling(s) forgotten) "
                        "until it returns", self.config.nats_url, n)

    def _send(self, msg: dict[str, Any]) -> None:
        if not self.connected:
            self.dropped.inc()
            return
        self.outbox.append(encode(msg))
        self.sent.labels(msg["t"]).inc()
        self._wake.set()

    def _send_snapshot(self) -> None:
        waiting = self.rt.held_requests()
        self._send(snapshot_message(self.name, next(self.seq), self.ledger.routers, list(self.own.items()),
                                    len(waiting), sum(r.prompt_tokens for r in waiting)))

    async def _publisher(self) -> None:
        """Hand the outbox to the NATS client in order (the hooks above run inside routing and must not wait)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.outbox:
                data = self.outbox.popleft()
                if self.nc is None or not self.connected:
                    self.outbox.clear()
                    break
                try:
                    await self.nc.publish(self.subject, data)
                except Exception as exc:  # the connection went away under us: the snapshot will repair
                    self.dropped.inc()
                    log.debug("fleet: publish failed: %s", exc)

    async def _ticker(self) -> None:
        cfg = self.config
        for beat in itertools.count(1):
            await asyncio.sleep(cfg.heartbeat_s)
            try:
                if self.connected:
                    if beat % cfg.snapshot_every == 0:
                        self._send_snapshot()
                    else:
                        waiting = self.rt.held_requests()
                        self._send(simple_message("hb", self.name, next(self.seq), q=len(waiting),
                                                  qt=sum(r.prompt_tokens for r in waiting)))
                gone = self.ledger.expire(time.monotonic())
                for name, n in gone:
                    self.expired.inc()
                    log.warning("fleet: instance %s silent for %g s; its %d in-flight request(s) are forgotten",
                                name, cfg.timeout_s, n)
                if gone:
                    self.rt.drain_queue()
            except Exception:  # a heartbeat must never stop for good
                log.exception("fleet heartbeat failed")

    async def _on_message(self, msg: Any) -> None:
        try:
            data = decode(msg.data)
            applied = self.ledger.apply(data, time.monotonic())
        except BadMessage as exc:
            self.bad.inc()
            sender = "?"
            with contextlib.suppress(BadMessage):
                sender = decode(msg.data).get("o", "?")
            if sender not in self._bad_logged:  # once per sender
                self._bad_logged.add(sender)
                log.warning("fleet: malformed message from %s ignored: %s", sender, exc)
            return
        self.received.labels(data["t"]).inc()
        if applied.gap:
            self.lost.inc(applied.gap)
        if applied.restarted:
            log.info("fleet: instance %s restarted; its old state is forgotten", data["o"])
        if applied.skipped and applied.skipped not in self._skip_logged:
            self._skip_logged.add(applied.skipped)
            log.warning("fleet: instance %s routes to %s, which this instance does not have; not mirrored "
                        "(are the instances' replica lists the same?)", data["o"], applied.skipped)
        if applied.added is not None and self.rt.events is not None:
            ep, hashes = applied.added  # as for our own dispatches: cached there until its BlockStored comes
            if ep in self.rt.upstreams:
                self.rt.events.speculate(ep, hashes)
        if applied.wants_snapshot:
            self._send_snapshot()
        if applied.freed:
            self.rt.drain_queue()


def index_fingerprints(rt: FleetHost) -> dict[str, dict[str, Any]]:
    """Per replica fed by KV events, the number of blocks its events confirmed and a digest of their
    keys: equal on every instance that consumed the same events (speculative entries are left out:
    they differ by design), so comparing instances' answers checks that their indexes agree."""
    events = rt.events
    out: dict[str, dict[str, Any]] = {}
    if events is None:
        return out
    for name in rt.upstreams:  # keyed by the replica's name
        table = events.table(name)
        if table is not None:
            confirmed = sorted(k for k, n in table.items() if n > 0)
            out[name] = {"blocks": len(confirmed), "digest": xxhash.xxh64(array("Q", confirmed).tobytes()).hexdigest()}
    return out


class _FleetCollector:
    """Fleet gauges read at scrape time."""

    def __init__(self, sync: FleetSync) -> None:
        self.sync = sync

    def collect(self):
        s = self.sync
        up = GaugeMetricFamily("kvroute_fleet_connected", "1 while this instance shares state over NATS; 0: it "
                               "routes on its own view")
        up.add_metric([], 1 if s.connected else 0)
        sib = GaugeMetricFamily("kvroute_fleet_siblings", "Other instances of this region heard within timeout_s")
        sib.add_metric([], len(s.ledger.siblings))
        mirrored = GaugeMetricFamily("kvroute_fleet_mirrored_requests", "Siblings' requests in flight, counted in "
                                     "this instance's load indicators")
        mirrored.add_metric([], s.ledger.mirrored())
        queue = GaugeMetricFamily("kvroute_fleet_sibling_queue", "Requests in the siblings' LB queues")
        queue.add_metric([], s.ledger.queue())
        yield from (up, sib, mirrored, queue)
