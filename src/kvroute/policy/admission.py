"""Admission: may a request be pushed now, and to which endpoints (selective pushing).

SkyWalker §3.3: blind pushing sends every request at once; selective pushing keeps it in the
load balancer's FIFO queue until some replica can take it. "Outstanding" gates on a fixed limit
of in-flight requests (SP-O); "pending" gates on the replica having no waiting requests, i.e. a
continuous batch with room (SP-P, SkyWalker's choice). Peer load balancers are admitted when
they have a non-full replica and a short queue (SkyWalker's steal threshold, 10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.model import Endpoint, EndpointKind

if TYPE_CHECKING:
    from kvroute.policy.base import PolicyParams

PEER_QUEUE_LIMIT = 10  # SkyWalker _STEAL_TRIGGER_THRESHOLD


class Admission:
    name = "blind"

    def ready(self, eps: list[Endpoint]) -> list[Endpoint]:
        return eps


class PendingGate(Admission):
    name = "pending"

    def ready(self, eps: list[Endpoint]) -> list[Endpoint]:
        if eps[0].kind is EndpointKind.PEER:  # a router's pool is all peers or all replicas
            return [e for e in eps if _peer_ok(e)]
        return [e for e in eps if not e.waiting]


class OutstandingGate(Admission):
    name = "outstanding"

    def __init__(self, limit: int):
        self.limit = limit

    def ready(self, eps: list[Endpoint]) -> list[Endpoint]:
        return [e for e in eps if e.inflight < self.limit]


def _peer_ok(e: Endpoint) -> bool:
    return e.peer_available > 0 and e.peer_queue <= PEER_QUEUE_LIMIT


def make_admission(params: "PolicyParams") -> Admission:
    if params.admission == "pending":
        return PendingGate()
    if params.admission == "outstanding":
        return OutstandingGate(params.max_outstanding)
    return Admission()
