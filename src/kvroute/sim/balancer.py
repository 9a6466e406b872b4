"""A load balancer inside the simulation: the same Router and admission as the gateway.

It sees replica indicators only through probes every ``probe_interval_s`` (stale in between),
plus its own in-flight accounting — exactly what the live gateway sees. Requests the policy
holds wait in a FIFO queue (selective pushing) and are retried on every probe and every
completion. When the policy can hold (admission pending or outstanding) the balancer pushes at
most one request per dispatch tick (10 ms, SkyWalker's queue processor), new arrivals
included, through a :class:`~kvroute.policy.pacing.DispatchPacer`.
With ``forward`` on, a request that finds no local replica available may go to a
peer load balancer chosen by the same policy over the peers (SkyWalker's two-layer routing,
with the regional snapshot as the peer router's prefix index); a forwarded request is never
forwarded again. With the ``gorgo`` preset the peer choice is GORGO v1's distributed mode instead
(:class:`GorgoPeering`): the held request goes to the peer whose GORGO cost, from the peer's
summary at the last probe, beats staying in the local queue, else it stays queued.

A balancer knows the simulation only through :class:`BalancerHost` (the clock, dispatch,
forward, fail, the network's RTTs, and each replica's region and :class:`EngineState`: what a
``/metrics`` scrape returns), so this module does not import the simulation that imports it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Protocol

from kvroute.model import DecisionKind, Endpoint, EndpointKind, Request
from kvroute.perf.network import RTT_EWMA, Network
from kvroute.perf.profile import HardwareProfile
from kvroute.policy import DEFAULT_TICK_S, DispatchPacer, Router, build_policy, policy_from_config
from kvroute.policy.admission import replica_available
from kvroute.policy.pd import PDRouter, compile_decider
from kvroute.policy.peering import GorgoWeights, gorgo_peer_choice, peer_router
from kvroute.sim.deferred_gauge import DeferredGauge
from kvroute.sim.events import Scheduler
from kvroute.sim.queue_gauge import SGLangQueueGauge
from kvroute.sim.share import SharedRouter, Sharer
from kvroute.sim.step_gauge import VLLMStatsGauge
from kvroute.workload.base import SimRequest


class EngineState(Protocol):
    """The engine indicators a probe reads (the engine's /metrics), and its static profile."""

    @property
    def p(self) -> HardwareProfile:
        """Hardware profile: KV capacity and batch limit."""

    @property
    def changes(self) -> int:
        """Bumped whenever the running or waiting sets may have changed."""

    @property
    def running(self) -> int:
        """Sequences in the running batch."""

    @property
    def queued(self) -> int:
        """Sequences waiting for admission."""

    @property
    def gauge(self) -> SGLangQueueGauge | DeferredGauge | VLLMStatsGauge | None:
        """The waiting count as the engine exports it when that is not live (SGLang, llama-server, vLLM), else None."""

    def kv_usage(self, now: float) -> float:
        """Share of KV capacity held by requests."""


class ReplicaHandle(Protocol):
    """A replica as a balancer sees it: where it is and its engine's indicators."""

    @property
    def region(self) -> str:
        """The replica's region."""

    @property
    def engine(self) -> EngineState:
        """Its engine's indicators."""


class Routed(Protocol):
    """A request in flight through balancers (the simulation's ``Flight``)."""

    reached_lb: float

    @property
    def sreq(self) -> SimRequest:
        """The simulated request."""


class BalancerHost(Protocol):
    """What a balancer asks of the simulation around it."""

    @property
    def seed(self) -> int:
        """The run's seed (policies' random tie-breaks)."""

    @property
    def loop(self) -> Scheduler:
        """The simulated clock and event queue."""

    @property
    def network(self) -> Network:
        """RTTs between regions."""

    @property
    def replicas(self) -> Mapping[str, ReplicaHandle]:
        """Replicas by id."""

    # ``flight`` is the host's own request object (a Routed), handed back as it arrived
    def dispatch(self, flight: Any, lb: SimBalancer, replica_id: str, branch: str) -> None:
        """Send ``flight`` to a replica."""

    def dispatch_split(self, flight: Any, lb: SimBalancer, prefill_id: str, replica_id: str, branch: str) -> None:
        """Send ``flight``'s prefill leg to ``prefill_id``, its decode leg then to ``replica_id``."""

    def forward(self, flight: Any, src: SimBalancer, via: Router, dst: SimBalancer) -> None:
        """Send ``flight`` on to a peer balancer."""

    def fail(self, flight: Any, reason: str) -> None:
        """``flight`` cannot be served."""


class SimBalancer:
    """One simulated load balancer: a Router, its probes and its paced FIFO queue."""

    def __init__(self, sim: BalancerHost, lb_id: str, region: str, replica_ids: list[str],
                 preset: str, params: dict | None, probe_interval_s: float, forward: bool,
                 index_block_tokens: int, dispatch_tick_s: float = DEFAULT_TICK_S,
                 share_interval_s: float | None = None):
        self.sim = sim
        self.id = lb_id
        self.region = region
        self.probe_interval_s = probe_interval_s
        self.forward = forward
        seed = sim.seed
        eps = []
        for rid in replica_ids:
            rep = sim.replicas[rid]
            p = rep.engine.p
            ep = Endpoint(rid, region=rep.region, profile=p, kv_blocks=p.kv_blocks, block_size=p.block_size,
                          rtt_s=sim.network.rtt(region, rep.region),
                          role=getattr(rep, "role", "mixed"), accelerator=getattr(rep, "accelerator", None))
            if getattr(rep, "batch_limit_known", True):  # else Endpoint's default: none known (ReplicaGroup)
                ep.max_running = p.max_running
            eps.append(ep)
        pd = getattr(getattr(sim, "setup", None), "pd", None)
        shared = share_interval_s is not None and pd is None  # the scenario refuses share with pd
        self.router: Router = ((SharedRouter if shared else Router)(build_policy(preset, params, seed=seed), eps,
                                                                    index_block_tokens=index_block_tokens)
                               if pd is None else
                               PDRouter(build_policy(preset, params, seed=seed),
                                        policy_from_config(pd.prefill_policy, seed=seed + 1),
                                        compile_decider(pd.disaggregate), eps, index_block_tokens=index_block_tokens))
        # [endpoint, engine, engine.changes at the last probe]: an engine whose waiting and running
        # sets did not change since keeps its probed counts (most probes find most replicas unchanged)
        self._probed: list[list] = [[ep, sim.replicas[ep.id].engine, -1] for ep in self.router.all_endpoints]
        self.peers: Router | None = None
        self.peer_lbs: dict[str, SimBalancer] = {}
        self.gorgo: GorgoPeering | None = None  # GORGO v1's distributed peer choice (gorgo preset)
        self._preset, self._params = preset, params
        self.queue: deque[Routed] = deque()
        self.max_queue = 0
        holds = self.router.policy.admission.holds
        self.pacer = DispatchPacer(dispatch_tick_s) if holds and dispatch_tick_s > 0 else None
        self._wake_at = -1.0  # a paced drain already scheduled for this time
        # the other LBs' dispatches mirrored into this one's Router (sim/share.py); None: not shared
        self.sharer = (Sharer(self, self.router, sim.loop, sim.network, share_interval_s or 0.0)
                       if isinstance(self.router, SharedRouter) else None)

    def connect_peers(self, peers: list[SimBalancer]) -> None:
        """Give a forwarding balancer a peer Router over the other regions' balancers (same preset, pending
        admission), at their network RTT; no-op when it does not forward. Balancers that share their
        dispatches (``sharer``) start publishing to each other."""
        if self.sharer is not None:
            self.sharer.connect([p.sharer for p in peers if p.sharer is not None])
        if not self.forward or not peers:
            return
        eps = [Endpoint(p.id, region=p.region, kind=EndpointKind.PEER,
                        rtt_s=self.sim.network.rtt(self.region, p.region)) for p in peers]
        self.peers = peer_router({"preset": self._preset, "params": self._params or {}}, eps, self.sim.seed)
        self.peer_lbs = {p.id: p for p in peers}
        self.router.view.peers = self.peers.endpoints  # what a forward gate weighs (refreshed at each probe)
        if self._preset == "gorgo":
            self.gorgo = GorgoPeering(self, GorgoWeights.of(self.router.policy.params))

    # -- requests ------------------------------------------------------------------------------
    def arrive(self, flight: Routed) -> None:
        """A request reaches this balancer: stamp its arrival, queue it and try to dispatch."""
        if flight.reached_lb < 0:
            flight.reached_lb = self.sim.loop.now
        self.queue.append(flight)
        if len(self.queue) > self.max_queue:
            self.max_queue = len(self.queue)
        self.drain()

    def drain(self, _=None) -> None:
        """Decide for queued requests in FIFO order: dispatch, forward a held one to a peer balancer, or fail
        it; stop at a held head of line, or when the pacer says wait (a wake-up is set for its next tick)."""
        queue, router, pacer = self.queue, self.router, self.pacer
        now = self.sim.loop.now
        while queue:
            if pacer is not None and not pacer.ready(now):
                wake = pacer.next_at
                if self._wake_at != wake:  # one wake-up per tick, however often drain is called
                    self._wake_at = wake
                    self.sim.loop.at(wake, self.drain)
                return
            flight = queue[0]
            req = flight.sreq.req
            d = router.route(req)
            if d.kind is DecisionKind.DISPATCH and d.target is not None:  # a dispatch has a target
                queue.popleft()
                if pacer is not None:
                    pacer.dispatched(now)
                if d.prefill is not None:  # a prefill/decode pair (sim/disagg.py)
                    self.sim.dispatch_split(flight, self, d.prefill, d.target, d.branch)
                else:
                    self.sim.dispatch(flight, self, d.target, d.branch)
                continue
            if d.kind is DecisionKind.HOLD and self.peers is not None and not req.from_peer:
                if self.gorgo is not None:
                    target = self.gorgo.choose(req)
                else:
                    self.peers.view.local_queue = len(queue) - 1  # the rest of the queue behind it
                    pd = self.peers.route(req)
                    target = pd.target if pd.dispatched else None
                if target is not None:
                    queue.popleft()
                    if pacer is not None:
                        pacer.dispatched(now)
                    self.sim.forward(flight, self, self.peers, self.peer_lbs[target])
                    continue
            if d.kind is DecisionKind.NONE:
                queue.popleft()
                self.sim.fail(flight, f"{d.branch}: {d.reason}")
                continue
            return  # hold: head-of-line waits for capacity

    # -- probes ---------------------------------------------------------------------------------
    def probe(self) -> None:
        """Read every replica's running, waiting and KV usage, as a /metrics scrape would, and
        fold a probe round trip into each replica's RTT EWMA (when the network has jitter).

        This runs ten times a simulated second per balancer, so it writes the probed fields
        directly (what ``Endpoint.apply_probe`` does) instead of calling per endpoint.
        """
        now = self.sim.loop.now
        kv = self.router.policy.reads_kv_usage  # mid-jump KV usage costs a square root
        for item in self._probed:
            ep, eng, seen = item
            if eng.changes != seen:
                item[2] = eng.changes
                ep.running = eng.running
                ep.waiting = eng.queued
            gauge = eng.gauge
            if gauge is not None:  # SGLang exports its queue and batch only at some passes (sim/queue_gauge.py)
                ep.waiting = gauge.read(now)
                ep.running = gauge.running
            if kv:
                ep.kv_usage = eng.kv_usage(now)
            ep.dispatched_since_probe = 0
        net = self.sim.network
        if net.jitter:  # RTT as the gateway keeps it: an EWMA of probe round trips
            for ep in self.router.all_endpoints:
                ep.rtt_s = RTT_EWMA * net.probe_rtt(self.region, ep.region) + (1.0 - RTT_EWMA) * ep.rtt_s
        if self.peers is not None:
            for ep in self.peers.endpoints:
                peer = self.peer_lbs[ep.id]
                ep.peer_queue = len(peer.queue)
                ep.peer_available = sum(1 for e in peer.router.endpoints if replica_available(e))
            if self.gorgo is not None:
                self.gorgo.refresh()
        if self.queue:
            self.drain()


class GorgoPeering:
    """GORGO v1's distributed mode at one balancer (001_55e1ee0b5e0d1fc8.txt §3.3, §3.5).

    The balancer serves locally while a local replica admits the request (its admission gate:
    the scenario's per-instance cap, §7's "rate limits and queuing limits on individual
    instances"); a request it holds is forwarded "only when the local region cannot immediately
    admit" it, to the peer whose cost — RTT to the peer + t_p × tokens not in the snapshot
    index of what this balancer forwarded there + the peer's advertised queue cost — is below
    the local cost (best local replica + the local queue's tokens); otherwise it stays queued
    ("can optionally stay in the local region depending on the queue-size estimate"). Peer
    summaries (``peering.gorgo_peer_choice``'s ``gorgo_base_cost``, the gateway's) are read at
    each probe, so they are as stale as the probe interval. A forwarded request is served at
    the peer (one hop)."""

    def __init__(self, lb: SimBalancer, weights: GorgoWeights):
        self.lb = lb
        self.w = weights
        self.base: dict[str, float] = {}

    def refresh(self) -> None:
        """Read each peer's summary: its cheapest replica's RTT and queued-token cost plus its LB queue."""
        w = self.w
        for ep in self.lb.peers.endpoints if self.lb.peers is not None else ():
            peer = self.lb.peer_lbs[ep.id]
            best = min((w.base(e.rtt_s, w.queued(e)) for e in peer.router.endpoints if e.routable),
                       default=None)
            queued = sum(f.sreq.req.prompt_tokens for f in peer.queue)
            self.base[ep.id] = math.inf if best is None else best + w.w_queue * queued

    def choose(self, req: Request) -> str | None:
        """The peer to forward the held head of the queue to, or None to keep it queued; a choice
        is committed to the peer Router (its prefix index is the snapshot)."""
        lb, peers = self.lb, self.lb.peers
        assert peers is not None
        backlog = sum(f.sreq.req.prompt_tokens for f in lb.queue) - req.prompt_tokens  # behind the head
        target = gorgo_peer_choice(req, lb.router.endpoints, lb.router.prefix.match(req.block_hashes), backlog,
                                   peers.endpoints, peers.prefix.match(req.block_hashes), self.base, self.w)
        if target is not None:
            peers.commit(req, target)
        return target
