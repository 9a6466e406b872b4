"""Distributed load balancers that tell each other where they sent work: the fleet ledger across regions.

With one load balancer per region that may send anywhere (``topology: {kind: distributed}``), each
LB accounts only its own dispatches; the other LBs' requests on a replica reach it through the
engine's gauges, and an SGLang gauge can be 40 decode steps old (``sim/queue_gauge.py``). Several
gateways of one region already solve this among themselves: each publishes its requests' lifecycle
(``add``, ``prefill``, ``free``) on a NATS subject and mirrors the others' into its own Router
(``fleet/ledger.py``, NVIDIA Dynamo's ``--router-replica-sync`` design). ``share: true`` runs the
same ledger between the regions' LBs, with the delay a NATS supercluster would add: a message leaves
at the sender's next publish (every ``share_interval_s``; 0 = at once, as ``fleet/sync.py``
publishes) and reaches each other LB one WAN hop later (half the RTT between their regions: the
gateway link between the regions' NATS clusters), plus the in-region hops on both ends (the
network's in-region one-way delay, twice).

What is mirrored is what a local dispatch changes — requests and prompt tokens in flight, queued
prefill, dispatches since the probe, the prefix index — through ``Router.commit(notify=False)``, so
every preset reads the other LBs' work in the same Endpoint fields as its own, and learning plugins
are told only of the requests whose outcome this LB measures. Nothing is lost in the simulation, so
the ledger's heartbeats and snapshots (which repair lost messages on a real NATS) are not needed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvroute.fleet.ledger import REPLICA, Ledger, add_message, simple_message
from kvroute.model import Request
from kvroute.perf.network import Network
from kvroute.policy import Router
from kvroute.sim.events import Scheduler

Publish = Callable[[dict[str, Any]], None]


class SharedRouter(Router):
    """A Router that publishes its own requests' lifecycle (never what it mirrors from the others)."""

    me: str = ""
    own: set[str]

    def attach(self, me: str, publish: Publish) -> None:
        """Publish under the name ``me`` through ``publish`` from now on."""
        self.me = me
        self.publish = publish
        self.own: set[str] = set()
        self.seq = itertools.count()

    def commit(self, req: Request, endpoint_id: str, matched_blocks: int | None = None, *,
               notify: bool = True, prefill_tokens: int | None = None) -> None:
        """As Router's; a dispatch of this LB's own (``notify``) is published."""
        super().commit(req, endpoint_id, matched_blocks, notify=notify, prefill_tokens=prefill_tokens)
        if notify:
            self.own.add(req.id)
            self.publish(add_message(self.me, next(self.seq), req.id, self.tickets[req.id], req.block_tokens,
                                     REPLICA))

    def on_first_token(self, req_id: str, ttft_s: float | None = None) -> None:
        """As Router's; published for an own request."""
        super().on_first_token(req_id, ttft_s)
        if req_id in self.own:
            self.publish(simple_message("prefill", self.me, next(self.seq), id=req_id))

    def on_failed(self, req_id: str, *, notify: bool = True) -> None:
        """As Router's; the others take the request's blocks back out of their index too."""
        mine = req_id in self.own
        self.own.discard(req_id)
        super().on_failed(req_id, notify=notify)
        if mine:
            self.publish(simple_message("free", self.me, next(self.seq), id=req_id, ok=False))

    def on_finish(self, req_id: str, e2e_s: float | None = None, output_tokens: int = 0, *,
                  notify: bool = True) -> None:
        """As Router's; published for an own request."""
        super().on_finish(req_id, e2e_s, output_tokens, notify=notify)
        if req_id in self.own:
            self.own.discard(req_id)
            self.publish(simple_message("free", self.me, next(self.seq), id=req_id, ok=True))


class Sharer:
    """One LB's side of the sharing: its outbox (flushed every ``interval_s``) and its ledger of the others."""

    def __init__(self, lb: Any, router: SharedRouter, loop: Scheduler, network: Network, interval_s: float):
        self.lb = lb
        self.loop = loop
        self.network = network
        self.interval_s = interval_s
        self.ledger = Ledger(lb.id, {REPLICA: router}, math.inf)
        router.attach(lb.id, self.publish)
        self.peers: list[tuple[Sharer, float]] = []
        self.outbox: list[dict[str, Any]] = []
        self.messages = 0  # published, for the report

    def connect(self, others: Sequence[Sharer]) -> None:
        """Deliver to ``others``, each after its delay: one WAN hop and the in-region hops at both ends."""
        net, here = self.network, self.lb.region
        self.peers = [(o, net.one_way(here, o.lb.region) + 2 * net.one_way(here, here)) for o in others]

    def publish(self, msg: dict[str, Any]) -> None:
        """Queue ``msg`` for the next publish (now, when the interval is 0)."""
        self.messages += 1
        if self.interval_s <= 0:
            self._send([msg])
            return
        if not self.outbox:
            now, step = self.loop.now, self.interval_s
            self.loop.at((math.floor(now / step) + 1) * step, self._flush)
        self.outbox.append(msg)

    def _flush(self, _: Any = None) -> None:
        batch, self.outbox = self.outbox, []
        self._send(batch)

    def _send(self, batch: list[dict[str, Any]]) -> None:
        now = self.loop.now
        for peer, delay in self.peers:
            self.loop.at(now + delay, peer.receive, batch)

    def receive(self, batch: list[dict[str, Any]]) -> None:
        """Apply another LB's messages; load it freed may let this LB's held requests go."""
        now, freed = self.loop.now, False
        for msg in batch:
            freed = self.ledger.apply(msg, now).freed or freed
        if freed and self.lb.queue:
            self.lb.drain()
