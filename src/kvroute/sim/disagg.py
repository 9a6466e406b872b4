"""Prefill/decode disaggregation in the simulator: the prefill leg, the KV transfer, the decode leg.

A balancer whose Router is a :class:`~kvroute.policy.pd.PDRouter` may split a request (its
decision names a prefill engine besides the target). The flow is vLLM's (NixlConnector, through
a proxy; see docs/pd.md):

1. the request travels LB → prefill engine (half an RTT, plus the profile's per-request
   overhead) and is prefilled there as a one-token request; when its prompt is computed the
   prefill engine's part is over (its KV stays in the prefill engine's prefix cache — vLLM holds
   the blocks until the decode engine has read them, a few milliseconds at these sizes, which
   this model does not charge to the prefill engine's memory);
2. the answer goes back to the LB and the decode request on to the decode engine (half an RTT
   each); every LB on the path hears ``on_prefill_done`` when the answer passes it;
3. the decode engine admits the request like any other — FCFS, a batch slot and KV memory for
   the prompt less its own cached prefix (so admission is bounded by KV capacity) — then the
   KV arrives: :func:`~kvroute.policy.builtin.pd.kv_transfer_s` of those tokens × the prefill
   profile's ``kv_bytes_per_token`` over ``link_gb_s`` (``cross_region_link_gb_s`` between
   regions) plus the RTT between the two engines' regions; then the last prompt token is
   computed in the decode engine's next step — the first token — and decoding goes on.

SGLang's flow differs in one hop: its decode request is sent with the prefill request, so the
LB → decode leg overlaps the prefill instead of following it; the simulator models vLLM's.
Per-request times of each split request (prefill leg, transfer) are kept for the results'
``pd`` section: the transfer's share of TTFT, the prefill leg's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.perf.network import Network
from kvroute.policy.builtin.pd import kv_transfer_s
from kvroute.sim.engine import Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.flight import Flight, Replica
from kvroute.stats import percentile

if TYPE_CHECKING:
    from kvroute.sim.balancer import SimBalancer


class PDHost(Protocol):
    """What the P/D legs use of the simulation that drives them (:class:`kvroute.sim.simulation.Simulation`;
    a protocol, so that this module does not import the one that imports it)."""

    @property
    def loop(self) -> EventLoop: ...

    @property
    def network(self) -> Network: ...

    @property
    def replicas(self) -> Mapping[str, Replica]: ...

    def fail(self, flight: Flight, reason: str) -> None: ...

    def arrive_replica(self, flight: Flight) -> None: ...

DEFAULT_KV_BYTES = 131072  # per token, when a profile gives none (a 7-8B model in bf16: 128 KiB)


@dataclass(frozen=True)
class PDSetup:
    """A disaggregated deployment's routing and links (the scenario's ``pd:``)."""

    prefill_policy: str | dict[str, Any] = "sglang_cache_aware"
    disaggregate: str | dict[str, Any] | list[Any] = "always"
    link_gb_s: float = 25.0  # prefill → decode inside a region (200 Gb/s InfiniBand: assumed)
    cross_region_link_gb_s: float = 1.25  # between regions (10 Gb/s: assumed)


class PrefillLeg:
    """The payload of a prefill engine's sequence: the request it prefills for, and the LB."""

    __slots__ = ("flight", "lb", "arrived")

    def __init__(self, flight: Flight, lb: SimBalancer, arrived: float):
        self.flight = flight
        self.lb = lb
        self.arrived = arrived


class Disaggregation:
    """The simulation's P/D legs (module docstring): started by ``Simulation.dispatch_split``."""

    def __init__(self, sim: PDHost, setup: PDSetup):
        self.sim = sim
        self.setup = setup
        self.prefill_s: list[float] = []  # LB dispatch → prefill done at the prefill engine
        self.transfer_s: list[float] = []
        self.share: list[float] = []  # transfer / TTFT per split request
        self.splits = 0

    def split(self, flight: Flight, lb: SimBalancer, prefill_id: str) -> None:
        """Send ``flight``'s prefill leg to ``prefill_id``; its decode leg follows when it is done."""
        sim = self.sim
        rep = sim.replicas[prefill_id]
        flight.prefill = prefill_id
        self.splits += 1
        delay = sim.network.one_way(lb.region, rep.region) + rep.engine.p.ttft_overhead_s
        sim.loop.at(sim.loop.now + delay, self._arrive_prefill, PrefillLeg(flight, lb, sim.loop.now))

    def _arrive_prefill(self, leg: PrefillLeg) -> None:
        flight = leg.flight
        req = flight.sreq.req
        assert flight.prefill is not None
        rep = self.sim.replicas[flight.prefill]
        eng = rep.engine
        if not eng.fits(req.prompt_tokens, 1):
            back = self.sim.network.one_way(rep.region, leg.lb.region)
            self.sim.loop.at(self.sim.loop.now + back, self._reject, flight)
            return
        eng.submit(Seq(req.id, req.prompt_tokens, 1, *flight.sreq.cache_blocks(), leg))

    def _reject(self, flight: Flight) -> None:
        self.sim.fail(flight, "rejected: the prompt exceeds the prefill engine's KV capacity")

    def prefill_done(self, seq: Seq, t: float) -> None:
        """The prefill engine computed the prompt (its first token): tell the LBs, go on to decode."""
        leg: PrefillLeg = seq.payload
        flight, lb, sim = leg.flight, leg.lb, self.sim
        self.prefill_s.append(t - leg.arrived)
        assert flight.prefill is not None
        here = sim.replicas[flight.prefill].region
        back = sim.network.one_way(here, lb.region)
        for router, blb, _delay, reached in flight.notify:  # every LB that routed it (the last is lb)
            at = t + back + (0.0 if blb is lb else sim.network.one_way(lb.region, blb.region))
            sim.loop.at(at, _prefill_done, (router, seq.rid, at - reached))
        rep = sim.replicas[flight.replica]
        delay = back + sim.network.one_way(lb.region, rep.region) + rep.engine.p.ttft_overhead_s
        sim.loop.at(t + delay, sim.arrive_replica, flight)

    def transfer(self, flight: Flight) -> Callable[[int], float]:
        """The decode engine's ``Seq.remote``: seconds to bring ``tokens`` of KV from the prefill engine."""
        assert flight.prefill is not None
        src = self.sim.replicas[flight.prefill]
        dst = self.sim.replicas[flight.replica]
        same = src.region == dst.region
        link = self.setup.link_gb_s if same else self.setup.cross_region_link_gb_s
        rtt = self.sim.network.rtt(src.region, dst.region)
        kv_bytes = src.engine.p.kv_bytes_per_token or DEFAULT_KV_BYTES

        def seconds(tokens: int) -> float:
            s = kv_transfer_s(tokens, kv_bytes, link, rtt)
            flight.transfer_s = s
            return s
        return seconds

    def finished(self, flight: Flight) -> None:
        """A split request completed: keep its transfer's share of its TTFT."""
        ttft = flight.first - flight.sent
        self.transfer_s.append(flight.transfer_s)
        if ttft > 0:
            self.share.append(flight.transfer_s / ttft)

    def summary(self, routers: list[Any]) -> dict[str, Any]:
        """The results' ``pd`` section: split and local counts, transfer and prefill-leg times."""
        split = sum(int(r.splits) for r in routers)
        local = sum(int(r.locals) for r in routers)

        def stats(xs: list[float]) -> dict[str, float]:
            if not xs:
                return {}
            return {"mean": round(sum(xs) / len(xs), 6), "p50": round(percentile(xs, 0.5), 6),
                    "p99": round(percentile(xs, 0.99), 6)}
        return {"split": split, "local": local,
                "split_share": round(split / (split + local), 4) if split + local else 0.0,
                "transfer_s": stats(self.transfer_s), "prefill_leg_s": stats(self.prefill_s),
                "transfer_share_of_ttft": stats(self.share)}


def _prefill_done(arg: tuple[Any, str, float]) -> None:
    arg[0].on_prefill_done(arg[1], arg[2])
