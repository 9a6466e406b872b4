"""Admission: may a request be pushed now, and to which endpoints (selective pushing).

SkyWalker §3.3: blind pushing sends every request at once; selective pushing keeps it in the
load balancer's FIFO queue until some replica can take it. "Outstanding" gates on a fixed limit
of in-flight requests (SP-O); "pending" gates on the replica having no waiting requests, i.e. a
continuous batch with room (SP-P, SkyWalker's choice). A probe is up to one interval old, so
the pending gate also counts the requests this balancer sent since that probe against the
room the probe showed (free batch slots): a replica that looked idle cannot absorb a whole
queue before the next probe. Peer load balancers are admitted when their queue is no longer
than the local one and at most SkyWalker's steal threshold (10), and they have a replica
available (skypilot ``serve-multi-region-lb``: ``conf.queue_size <= own qsize and <= 10 and
num_available_replicas > 0``). "Forward" (``auto``'s) holds only what a peer would take at once
and pushes blindly otherwise. The pace at which a queue drains is the caller's
(:mod:`kvroute.policy.pacing`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.model import Endpoint, EndpointKind
from kvroute.policy.params import PolicyParams

PEER_QUEUE_LIMIT = 10  # SkyWalker _STEAL_TRIGGER_THRESHOLD


class Admission:
    """Blind pushing: every endpoint may take a request now (never holds)."""

    name = "blind"
    holds = False  # whether this gate can ever keep a request in the LB queue (and wants it paced)
    forwards = False  # whether it can hold a request, which a load balancer with peers then forwards

    def ready(self, eps: list[Endpoint], local_queue: int = 0, peers: Sequence[Endpoint] = ()) -> list[Endpoint]:
        """Endpoints that may take a request now; ``local_queue`` is this LB's queue length, ``peers``
        the peer load balancers a held request could be forwarded to (their last status)."""
        return eps


class PendingGate(Admission):
    """SP-P: replicas with no waiting request and free batch slots left since the last probe."""

    name = "pending"
    holds = forwards = True

    def ready(self, eps: list[Endpoint], local_queue: int = 0, peers: Sequence[Endpoint] = ()) -> list[Endpoint]:
        """The endpoints that may take a request now: replicas with nothing waiting and free batch slots, or
        peers reporting an available replica."""
        if eps[0].kind is EndpointKind.PEER:  # a router's pool is all peers or all replicas
            return [e for e in eps if peer_available(e, local_queue)]
        # replica_available, inlined: this runs for every endpoint of every decision
        # (min(a, b) < room written as a < room or b < room: no call per endpoint)
        return [e for e in eps if not e.waiting
                and (e.dispatched_since_probe < e.max_running - e.running
                     or e.inflight < e.max_running - e.running)]


class OutstandingGate(Admission):
    """SP-O: replicas below a fixed number of in-flight requests."""

    name = "outstanding"
    holds = forwards = True

    def __init__(self, limit: int):
        self.limit = limit

    def ready(self, eps: list[Endpoint], local_queue: int = 0, peers: Sequence[Endpoint] = ()) -> list[Endpoint]:
        """The endpoints with fewer than ``limit`` requests in flight."""
        return [e for e in eps if e.inflight < self.limit]


class ForwardGate(Admission):
    """Blind pushing, except for a request that the local region cannot admit while a peer can.

    SkyWalker §3.2 holds a request no local replica admits (the pending gate: a replica with nothing
    waiting and free batch slots) and forwards it to a peer load balancer that admits it; held
    without a peer — one region, or every peer busy — the request waits in the LB queue, which costs
    where no peer could have served it sooner. This gate holds only when some peer would take the
    request *now* by SkyWalker's steal condition with nothing queued behind it (``peer_available``
    with local queue 0: an available replica there and an empty queue — the condition the peer
    layer applies with the real, never shorter, queue), so a held request is forwarded at once;
    otherwise every endpoint may take it, as blind pushing. ``peers`` is empty without peers (and for
    a request that was forwarded already): it then never holds. It keeps no request waiting, so the
    LB does not pace it (``holds`` false)."""

    name = "forward"
    forwards = True

    def ready(self, eps: list[Endpoint], local_queue: int = 0, peers: Sequence[Endpoint] = ()) -> list[Endpoint]:
        """``eps``, or none (hold: forward) when no replica of ``eps`` is available and a peer would admit it."""
        if not peers or any(replica_available(e) for e in eps):
            return eps
        return [] if any(peer_available(p, 0) for p in peers) else eps


def replica_available(e: Endpoint) -> bool:
    """No waiting request at the last probe, and the requests sent since then that are still in
    flight fit its free slots. (Counting every dispatch since the probe, finished or not, would
    cap a fast replica at ``max_running`` requests per probe interval: 2,560 req/s at 100 ms.)"""
    return not e.waiting and min(e.dispatched_since_probe, e.inflight) < e.max_running - e.running


def peer_available(e: Endpoint, local_queue: int) -> bool:
    """SkyWalker's steal condition for a peer LB, judged from its last /conf."""
    return (e.peer_available > 0 and e.peer_queue <= local_queue
            and e.peer_queue <= PEER_QUEUE_LIMIT)


def make_admission(params: PolicyParams) -> Admission:
    """The gate ``params.admission`` names."""
    if params.admission == "pending":
        return PendingGate()
    if params.admission == "outstanding":
        return OutstandingGate(params.max_outstanding)
    if params.admission == "forward":
        return ForwardGate()
    return Admission()
