"""Gateways as peers: authentication, the peer status endpoint and its probes, and the two
cross-region forwarding decisions (SkyWalker two-layer, GORGO distributed).

**Authentication.** Gateways share one token (``peer_auth``). A forward carries it in
``x-kvroute-peer-token`` beside ``x-kvroute-forwarded`` (the regions it passed through, comma
separated); the receiving gateway compares it in constant time (``hmac.compare_digest``). A
request that claims to be forwarded without the right token is answered 401 and never treated
as forwarded; the peer status endpoint asks for the same token.

**Status and probes.** ``GET /kvroute/peer/status`` reports this gateway's LB queue length,
available replicas (no waiting request and free batch slots, the SkyWalker /conf
``num_available_replicas``), in-flight requests, and GORGO's summary (below). Every peer is
probed each ``probe.interval_s`` (100 ms, SkyWalker's /conf period) with an RTT EWMA
(``probe.rtt_ewma``, GORGO's 0.3); ``probe.unhealthy_after`` failed probes eject it and
``probe.healthy_after`` good ones re-admit it, as for replicas, and a circuit breaker per peer
counts failed forwards.

**SkyWalker two-layer** (SkyWalker §3.2): when the head of the LB queue finds no local replica
that admits it, the same preset, with the pending gate, picks among the peers over a Router
whose prefix index is the *regional snapshot* (prefixes this gateway forwarded where, learned at
each forward; no index is exchanged). A peer is admitted iff its queue ≤ the local queue behind
the head, ≤ τ = 10, and it has an available replica (``policy.admission.peer_available``). A
forwarded request is never forwarded again. This is ``sim/balancer.py``'s rule, step for step.

**GORGO distributed** (GORGO v1 §3.3-3.4): a request is served locally while a local replica
admits it; only the head of the LB queue — a request the local region "cannot immediately
admit" (§3.3), held by the policy's admission gate (§7's per-instance caps: ``admission:
outstanding``) — is offered to the peers, and goes to one whose cost beats staying (best local
replica plus the local queue's tokens), else it keeps waiting. This is ``sim/balancer.py``'s
``GorgoPeering`` step for step. Costs are GORGO's additive TTFT estimate with the gorgo preset's
weights (or its defaults): ``w_rtt·RTT_ms + t_p·uncached tokens + w_queue·queued tokens``.
Choice (the paper leaves the peer summary open): a peer advertises ``gorgo_base_cost``, the
cheapest ``w_rtt·RTT_ms + w_queue·queued tokens`` over its routable replicas plus ``w_queue``
times the prompt tokens in its LB queue; the requester adds its measured RTT to the peer and
``t_p`` times the tokens not covered by the snapshot index. A peer with no available replica is
not a candidate. At most ``max_hops`` forwards, never back through a region already on the path.
A policy that never holds (no admission gate) never forwards; ``auto``'s ``forward`` gate holds only a
request no local replica admits while a peer would take it at once (its ``View.peers``: this layer's endpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from kvroute.errors import ServiceError
from kvroute.gateway.breaker import CircuitBreaker
from kvroute.gateway.config import GatewayConfig, PeerConfig
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.probes import ProbeStreak, probe_forever, tick_breakers
from kvroute.gateway.residency import REGION_HEADER, RESIDENCY_HEADER, request_zone
from kvroute.gateway.upstream import UpstreamPool
from kvroute.model import Decision, Endpoint, EndpointKind, Request
from kvroute.policy import Router
from kvroute.policy.admission import replica_available
from kvroute.policy.peering import GorgoWeights, gorgo_peer_choice, peer_router, skywalker_peer_choice

if TYPE_CHECKING:
    from kvroute.gateway.auth import KeyState
    from kvroute.gateway.http import Request as HTTPRequest
    from kvroute.gateway.http import Responder

log = logging.getLogger("kvroute.gateway")

FORWARDED_HEADER = "x-kvroute-forwarded"  # the regions a forward passed through, comma separated
TOKEN_HEADER = "x-kvroute-peer-token"
STATUS_PATH = "/kvroute/peer/status"
PEER_HEADERS = frozenset({FORWARDED_HEADER, TOKEN_HEADER})  # never passed on as they came
FORWARD_BRANCH = "forward"  # the policy-branch label of a forward


class PeerRefused(ServiceError):
    """A request claims to come from a peer but cannot prove it (answered 401)."""


def token_matches(presented: str | None, token: str | None) -> bool:
    """Constant-time comparison of a presented peer token with ours (no token: never)."""
    if not presented or not token:
        return False
    return hmac.compare_digest(presented.encode(), token.encode())


def forwarded_path(headers: dict[str, str], token: str | None) -> list[str]:
    """The regions an inbound request was forwarded through ([] for a client's own request).

    Raises :class:`PeerRefused` when it claims to be forwarded without the peer token."""
    if FORWARDED_HEADER not in headers:
        return []
    if token is None:
        raise PeerRefused("this gateway accepts no forwarded requests (no peer_auth configured)")
    if not token_matches(headers.get(TOKEN_HEADER), token):
        raise PeerRefused(f"forwarded request without a valid peer token ({TOKEN_HEADER})")
    path = [r.strip() for r in headers[FORWARDED_HEADER].split(",") if r.strip()]
    if not path:
        raise PeerRefused(f"{FORWARDED_HEADER} must name the regions the request passed through")
    return path


@dataclass
class PeerLink:
    """One peer gateway: its endpoint in the peer Router, breaker, connection pool and probe state."""

    config: PeerConfig
    endpoint: Endpoint
    breaker: CircuitBreaker
    pool: UpstreamPool
    streak: ProbeStreak = field(default_factory=ProbeStreak)
    base_cost: float = math.inf  # its advertised gorgo_base_cost
    status: dict[str, Any] | None = None  # its last status answer


class PeeringHost(Protocol):
    """What the peer layer reads of the gateway runtime that owns it."""

    @property
    def config(self) -> GatewayConfig:
        """The gateway's config (peers, mode, probe settings)."""

    @property
    def router(self) -> Router:
        """The local replicas' Router (their load and prefix index go into the status and GORGO's choice)."""

    @property
    def drained(self) -> Collection[str]:
        """Replicas taking no new requests."""

    @property
    def metrics(self) -> GatewayMetrics:
        """The registry the peer counters join."""

    @property
    def session(self) -> aiohttp.ClientSession | None:
        """The HTTP session peer status probes use (None before start)."""

    def region_queue(self) -> tuple[int, int]:
        """Requests held in this region (this instance and its fleet siblings) and their prompt tokens."""

    def drain_queue(self) -> None:
        """A peer's new status may let held requests go."""


class Peering:
    """This gateway's peers and its forwarding decisions; one per gateway runtime."""

    def __init__(self, runtime: PeeringHost):
        self.rt = runtime
        r = runtime.metrics.registry
        self.forwards = Counter("kvroute_peer_forwards", "Requests forwarded to a peer gateway, by reason",
                                ["peer", "reason"], registry=r)
        self.inbound = Counter("kvroute_peer_inbound", "Requests that claimed to come from a peer, by result",
                               ["result"], registry=r)
        self.probe_failures = Counter("kvroute_peer_probe_failures", "Failed peer status probes", ["peer"],
                                      registry=r)
        r.register(_PeerCollector(self))
        self._task: asyncio.Task | None = None
        self._build(runtime.config)

    def _build(self, config: GatewayConfig) -> None:
        self.config = config
        self.mode = config.routing_mode
        self.token = config.peer_auth.token() if config.peer_auth is not None else None
        self.weights = GorgoWeights.of(getattr(self.rt.router.policy, "params", None))  # a composition may have none
        bc = config.breaker
        self.links: dict[str, PeerLink] = {}
        for pc in config.peers:
            ep = Endpoint(pc.name, region=pc.region, zone=pc.zone, kind=EndpointKind.PEER)
            self.links[pc.name] = PeerLink(pc, ep, CircuitBreaker(bc.failures, bc.cooldown_s, bc.successes),
                                           UpstreamPool(pc.url))
        self.router = peer_router(config.policy, [link.endpoint for link in self.links.values()], config.seed,
                                  index_block_tokens=config.block_tokens,
                                  max_prefix_blocks=config.max_prefix_blocks)
        # the peers a held request is forwarded to (SkyWalker mode), for a gate that holds only to forward
        self.rt.router.view.peers = list(self.router.endpoints) if self.mode == "skywalker" else []

    def reconfigure(self, new: GatewayConfig) -> bool:
        """Rebuild the peer table when a reload changed it (in-flight forwards finish as they are)."""
        fields = ("peers", "peer_auth", "routing_mode", "max_hops", "policy", "region", "zone", "breaker")
        if all(getattr(new, f) == getattr(self.config, f) for f in fields):
            self.config = new
            return False
        for link in self.links.values():
            link.pool.close()
        self._build(new)
        return True

    # -- inbound: authentication, hops, residency ------------------------------------------------
    def check_forwarded(self, request: HTTPRequest, resp: Responder) -> bool | None:
        """None: a client's own request; True: an authenticated forward; False: refused (401 sent)."""
        if FORWARDED_HEADER not in request.headers:
            return None
        try:
            forwarded_path(request.headers, self.token)
        except PeerRefused as exc:
            self.inbound.labels("refused").inc()
            resp.send_error(401, str(exc), code="invalid_peer_token")
            return False
        self.inbound.labels("accepted").inc()
        return True

    def accept(self, req: Request, headers: dict[str, str], key: KeyState | None) -> None:
        """Fill in what peers need to know about a request: its hops (only authenticated forwards
        reach here with the header), the regions it may not go back to, and its residency zone
        (raises ``ResidencyConflict`` when the header and the key's pin disagree)."""
        # not getattr(key, "zone", None): with no key that raises and catches an AttributeError, ~3,600
        # instructions per request (callgrind, issue 25 fifth round). With no key request_zone returns the
        # header's zone or None: done here, as residency.py is interpreted (~500 instructions, tenth round)
        if key is not None:
            req.residency = request_zone(req.residency, key.zone)
        elif not req.residency:
            req.residency = None
        path = forwarded_path(headers, self.token) if FORWARDED_HEADER in headers else []
        if path:
            req.hops, req.from_peer = len(path), True
            back = tuple(name for name, link in self.links.items() if link.config.region in path)
            if back:
                req.exclude = (*req.exclude, *back)

    def outbound(self, headers: list[tuple[str, str]], req: Request,
                 inbound: dict[str, str]) -> list[tuple[str, str]]:
        """The headers of a forward: the client's (peer headers are hop-by-hop), the path so far
        plus this region, the token, the residency pin and the client's region."""
        path = inbound.get(FORWARDED_HEADER, "")
        via = f"{path},{self.config.region}" if path else self.config.region
        out = [(k, v) for k, v in headers if k not in PEER_HEADERS and k not in (RESIDENCY_HEADER, REGION_HEADER)]
        out += [(FORWARDED_HEADER, via), (TOKEN_HEADER, self.token or "")]
        if req.residency is not None:
            out.append((RESIDENCY_HEADER, req.residency))
        if req.region is not None:
            out.append((REGION_HEADER, req.region))
        return out

    # -- decisions ---------------------------------------------------------------------------------
    def on_hold(self, req: Request, behind: int) -> Decision | None:
        """The queue's head found no local replica that admits it: a peer to forward it to, or None
        to keep it queued. ``behind``: requests in the local queue after it. SkyWalker: a peer that
        admits it (the peer condition compares the queues); GORGO distributed: a peer cheaper than
        waiting here."""
        if self.mode == "skywalker":
            target = skywalker_peer_choice(self.router, req, behind)
            return None if target is None else self._forwarding(req, target, "no-local-replica")
        if self.mode == "gorgo_distributed":
            return self._gorgo_forward(req)
        return None

    def _gorgo_forward(self, req: Request) -> Decision | None:
        """GORGO v1 §3.3 for a held request: the cheaper peer, or None (stay queued)."""
        if req.hops >= self.config.max_hops or not self.links:
            return None
        rt = self.rt
        backlog = max(0, rt.region_queue()[1] - req.prompt_tokens)  # the region's queue, without the head
        peers = self.router.endpoints
        target = gorgo_peer_choice(req, rt.router.endpoints, rt.router.prefix.match(req.block_hashes), backlog,
                                   peers, self.router.prefix.match(req.block_hashes),
                                   {p.id: self.links[p.id].base_cost for p in peers}, self.weights)
        if target is None:
            return None
        self.router.commit(req, target)
        return self._forwarding(req, target, "peer-cheaper")

    def _forwarding(self, req: Request, target: str, reason: str) -> Decision:
        link = self.links[target]
        link.breaker.dispatched()
        link.endpoint.circuit_open = not link.breaker.allows
        self.forwards.labels(target, reason).inc()
        return Decision.dispatch(target, FORWARD_BRANCH)

    # -- accounting ----------------------------------------------------------------------------------
    def release(self, rid: str, served: bool) -> None:
        """A forward ended: undo its in-flight count; a failed one also leaves the snapshot index."""
        if rid in self.router.tickets:
            (self.router.on_finish if served else self.router.on_failed)(rid)

    def attempt_done(self, name: str, outcome: str) -> None:
        """Feed a forward's outcome (``ok``, ``failed``, ``neutral``) to the peer's breaker."""
        link = self.links.get(name)
        if link is None:
            return
        if outcome == "ok":
            link.breaker.success()
        elif outcome == "failed":
            link.breaker.failure(time.monotonic())
        else:
            link.breaker.neutral()
        link.endpoint.circuit_open = not link.breaker.allows

    # -- the status endpoint ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What peers read every probe (see the module docstring)."""
        rt = self.rt
        eps = [e for e in rt.router.endpoints if e.routable and e.id not in rt.drained]
        queue, queued_tokens = rt.region_queue()  # several instances in a region: the queue is all of theirs
        w = self.weights
        best = min((w.base(e.rtt_s, w.queued(e)) for e in eps), default=None)
        return {"region": self.config.region, "zone": self.config.home_zone, "mode": self.mode,
                "queue": queue, "available": sum(1 for e in eps if replica_available(e)),
                "replicas": len(eps), "inflight": sum(e.inflight for e in rt.router.endpoints),
                "queued_tokens": queued_tokens,
                "gorgo_base_cost": None if best is None else best + w.w_queue * queued_tokens}

    def serve_status(self, request: HTTPRequest, resp: Responder) -> None:
        """``GET /kvroute/peer/status``, for peers holding the token."""
        if request.method != "GET":
            resp.send_error(405, f"method {request.method} not allowed on {STATUS_PATH}; allowed: GET",
                            headers=[("Allow", "GET")])
        elif not token_matches(request.headers.get(TOKEN_HEADER), self.token):
            resp.send_error(401, f"peer status needs the peer token ({TOKEN_HEADER})", code="invalid_peer_token")
        else:
            resp.send(200, json.dumps(self.status()).encode())

    # -- probes ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Probe the peers from now on (on the running loop)."""
        if self.links and self._task is None:
            self._task = asyncio.create_task(
                probe_forever(lambda: self.config.probe.interval_s, self.probe_all, "peer probe round failed"))

    async def stop(self) -> None:
        """Stop probing peers and close their connection pools (the gateway is shutting down)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for link in self.links.values():
            link.pool.close()

    async def probe_all(self) -> None:
        """Read every peer's status once; a change may let held requests go."""
        links = list(self.links.values())
        await asyncio.gather(*(self._probe(link) for link in links))
        tick_breakers(links, time.monotonic())
        self.rt.drain_queue()

    async def _probe(self, link: PeerLink) -> None:
        pc = self.config.probe
        ep = link.endpoint
        session = self.rt.session
        assert session is not None, "probing before start()"
        t0 = time.monotonic()
        try:
            async with session.get(f"{link.config.url}{STATUS_PATH}", headers={TOKEN_HEADER: self.token or ""},
                                   timeout=aiohttp.ClientTimeout(total=pc.timeout_s)) as resp:
                if resp.status != 200:
                    raise ValueError(f"{STATUS_PATH} answered {resp.status}")
                status = await resp.json(content_type=None)
            queue, available = int(status["queue"]), int(status["available"])
            base = status.get("gorgo_base_cost")
            base_cost = math.inf if base is None else float(base)
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError) as exc:
            self.probe_failures.labels(ep.id).inc()
            if link.streak.failed(ep.healthy, pc.unhealthy_after):
                ep.healthy = False
                log.warning("peer %s (%s) ejected after %d failed probes: %s", ep.id, link.config.url,
                            link.streak.fails, str(exc) or exc.__class__.__name__)
            return
        ep.rtt_s = link.streak.rtt(time.monotonic() - t0, pc.rtt_ewma)
        ep.peer_queue, ep.peer_available, link.base_cost, link.status = queue, available, base_cost, status
        ep.probe_age_s = 0.0
        if link.streak.succeeded(ep.healthy, pc.healthy_after):
            ep.healthy = True
            self.router.prefix.clear(ep.id)  # it may have restarted: what it cached is unknown
            log.info("peer %s re-admitted", ep.id)


class _PeerCollector:
    """Peer gauges read at scrape time: up, RTT, queue and available replicas."""

    def __init__(self, peering: Peering) -> None:
        self.peering = peering

    def collect(self):
        up = GaugeMetricFamily("kvroute_peer_up", "1 if the peer gateway passes status probes", labels=["peer"])
        rtt = GaugeMetricFamily("kvroute_peer_rtt_seconds", "Peer status probe round trip, EWMA", labels=["peer"])
        queue = GaugeMetricFamily("kvroute_peer_queue", "The peer's LB queue at its last status", labels=["peer"])
        avail = GaugeMetricFamily("kvroute_peer_available", "The peer's available replicas at its last status",
                                  labels=["peer"])
        for name, link in self.peering.links.items():
            ep = link.endpoint
            up.add_metric([name], 1 if ep.routable else 0)
            if link.streak.rtt_ewma_s is not None:
                rtt.add_metric([name], link.streak.rtt_ewma_s)
            queue.add_metric([name], ep.peer_queue)
            avail.add_metric([name], ep.peer_available)
        yield from (up, rtt, queue, avail)
