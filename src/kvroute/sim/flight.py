"""A simulated replica and one request's journey through the simulated system: shared by the
simulation loop (``simulation.py``) and the parts it drives (``disagg.py``), so that those need not
import the loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvroute.sim.engine import Engine
from kvroute.workload import SimRequest

if TYPE_CHECKING:
    from kvroute.policy import Router
    from kvroute.sim.balancer import SimBalancer


@dataclass
class Replica:
    """A simulated replica at run time: its id, region and engine model."""

    id: str
    region: str
    engine: Engine
    role: str = "mixed"
    accelerator: str | None = None  # declared, as a gateway config would (ReplicaGroup.accelerator)
    batch_limit_known: bool = True  # the balancers know its engine's max_running (ReplicaGroup.batch_limit_known)


class Flight:
    """One request on its way through the simulated system: where it came from, the balancers and replica it
    met, and the times it reached each (for latency breakdowns and on_finish calls)."""

    __slots__ = ("sreq", "client_region", "origin", "sent", "reached_lb", "at_peer", "notify", "replica", "back_s",
                 "first", "net_s", "dispatched", "prefill", "transfer_s")

    def __init__(self, sreq: SimRequest, client_region: str, sent: float):
        self.sreq = sreq
        self.client_region = client_region
        self.origin = client_region  # where it was sent from (the load generator's region, if one sends all)
        self.sent = sent
        self.reached_lb = -1.0  # when it first reached a load balancer
        self.at_peer = -1.0  # when it reached the peer it was forwarded to (-1: not forwarded)
        # balancers on the way back: (router, balancer, delay, when the request reached it)
        self.notify: list[tuple[Router, SimBalancer, float, float]] = []
        self.replica = ""
        self.back_s = 0.0  # replica → client
        self.first = 0.0
        self.net_s = 0.0  # LB → LB forwarding time (not queueing)
        self.dispatched = 0.0
        self.prefill: str | None = None  # the prefill engine of a split request (sim/disagg.py)
        self.transfer_s = 0.0
