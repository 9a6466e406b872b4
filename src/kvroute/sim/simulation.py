"""One simulated run: replicas, load balancers, network and a workload, under one policy.

A request's journey (a ``Flight``): the client sends it to the nearest load balancer (half an
RTT); the balancer's Router decides — dispatch, hold in its FIFO queue, or forward to a peer;
the replica receives it another half RTT later (plus the profile's per-request overhead); its
first token and its completion travel back along the same path, and every balancer on the path
gets its ``on_first_token`` / ``on_finish`` when they pass, which is when the live gateway would.
"""

from __future__ import annotations

import gc
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvroute.metrics import Recorder
from kvroute.native import mypyc_attr
from kvroute.perf.network import Network
from kvroute.perf.profile import HardwareProfile
from kvroute.policy import Router
from kvroute.sim import migration_settings
from kvroute.sim.balancer import SimBalancer
from kvroute.sim.disagg import Disaggregation, PDSetup, PrefillLeg
from kvroute.sim.engine import Engine, Host, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.flight import Flight, Replica
from kvroute.sim.migration import make_migrator
from kvroute.sim.noise import NoiseSpec, attach
from kvroute.workload import Program, SimRequest, Workload


@dataclass
class ReplicaSpec:
    """One simulated replica: id, region, hardware profile, and the machine it shares cores with, if any."""

    id: str
    region: str
    profile: HardwareProfile
    host: tuple[str, int, float] | None = None  # (machine, cores, background cores) shared (sim/host.py)
    role: str = "mixed"  # prefill / decode / mixed (sim/disagg.py)
    noise: NoiseSpec | None = None  # timing noise and reordering (sim/noise.py); None: off
    accelerator: str | None = None  # the accelerator the deployment declares (ReplicaGroup.accelerator)
    batch_limit_known: bool = True  # the balancers know the engine's max_running (ReplicaGroup.batch_limit_known)


@dataclass
class BalancerSpec:
    """One simulated load balancer: its region, replicas it manages, probe interval, forwarding, pacing."""

    id: str
    region: str
    replicas: list[str]
    probe_interval_s: float = 0.1
    forward: bool = False
    dispatch_tick_s: float = 0.01  # paced queue: one dispatch per tick (0: unpaced)
    share_interval_s: float | None = None  # tells the others its dispatches (sim/share.py); None: no


@dataclass
class Limits:
    """When a run stops issuing (request count or simulated time) and how long in-flight requests then get to
    finish."""

    max_requests: int | None = None
    max_sim_s: float | None = None  # stop issuing after this much simulated time
    drain_s: float = 3600.0  # then give in-flight requests this long to finish


@dataclass
class Setup:
    """Everything a Simulation needs besides the policy and workload: replicas, balancers, network, limits,
    seed, sampling, index block size, SLOs."""

    replicas: list[ReplicaSpec]
    balancers: list[BalancerSpec]
    network: Network = field(default_factory=Network)
    limits: Limits = field(default_factory=Limits)
    seed: int = 0
    sample_interval_s: float = 1.0
    index_block_tokens: int = 64
    slo_ttft_s: float = 5.0  # goodput counts requests meeting both objectives
    slo_tpot_s: float = 0.1
    pd: PDSetup | None = None  # prefill/decode disaggregation (sim/disagg.py)
    # client region → residency zone its requests must be served in (kvroute plan's residency rules;
    # the policies' hard zone filter applies it, as the gateway does for a pinned key)
    residency: dict[str, str] = field(default_factory=dict)
    # one load generator sends every request from this region, each through the balancer nearest
    # its client region (GORGO v1 §4.3's GuideLLM + geo-routing tunnel); None: clients send from their regions
    origin: str | None = None
    # open loop: requests in flight at most (the rest wait at the client, latencies counted from the send)
    client_concurrency: int | None = None


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it to watch dispatches (compiled build)
class Simulation:
    """One policy on one Setup and workload, as a discrete-event run: clients issue requests, balancers route
    them with the same Router and policy code as the gateway, engine models serve them. :meth:`run` returns
    the result dict."""

    def __init__(self, setup: Setup, preset: str, params: dict | None, workload: Workload,
                 progress: Callable[[int], None] | None = None):
        self.setup = setup
        self.seed = setup.seed
        self.loop = EventLoop()
        self.network = setup.network
        self.workload = workload
        self.progress = progress
        self.rng = random.Random(setup.seed)
        hosts = {r.host: Host(r.host[1], r.host[2]) for r in setup.replicas if r.host is not None}
        self.replicas = {r.id: Replica(r.id, r.region, Engine(r.id, r.profile, self.loop, self._first_token,
                                                              self._finish, host=hosts.get(r.host) if r.host else None),
                                       r.role, r.accelerator, r.batch_limit_known) for r in setup.replicas}
        self.api_delay = attach({k: r.engine for k, r in self.replicas.items()},
                                {r.id: r.noise for r in setup.replicas}, setup.seed)
        # prefill/decode legs (sim/disagg.py): None for an aggregated deployment
        self.pd = Disaggregation(self, setup.pd) if setup.pd is not None else None
        self.recorder = Recorder(list(self.replicas), [r.region for r in self.replicas.values()])
        # the simulator's own settings (CascadeInfer planning, migration) are not the policy's
        params, self.migration_settings = migration_settings.split(params)
        self.lbs = [SimBalancer(self, b.id, b.region, b.replicas, preset, params, b.probe_interval_s,
                                b.forward, setup.index_block_tokens, b.dispatch_tick_s, b.share_interval_s)
                    for b in setup.balancers]
        for lb in self.lbs:
            lb.connect_peers([p for p in self.lbs if p is not lb])
        # sequences moving between replicas (CascadeInfer stages, Llumnix-like): None otherwise
        self.migrator = make_migrator(self)
        # whether any router reads what on_first_token changes or has plugins that listen
        # (else first tokens notify nobody)
        self._first_token_matters = any(
            r is not None and (r.policy.reads_prefill_backlog or r.policy.listeners)
            for lb in self.lbs for r in (lb.router, lb.peers))
        self._nearest: dict[str, SimBalancer] = {}
        self.issued = 0
        self.outstanding = 0
        self.issuing = True
        self._live: dict[int, list] = {}  # id(program) → [region, slot, requests in flight]
        self._starts_pending = 0  # client slots scheduled to start and not started yet
        self.first_issue = -1.0
        self.last_issue = 0.0
        self._arrivals: Iterator[SimRequest] = iter(())
        self._held: deque[SimRequest] = deque()  # arrivals waiting for a free client worker

    # -- topology ---------------------------------------------------------------------------
    def lb_for(self, region: str) -> SimBalancer:
        """Clients use their region's balancer, else the one with the smallest RTT."""
        lb = self._nearest.get(region)
        if lb is None:
            lb = self._nearest[region] = min(self.lbs, key=lambda b: (self.network.rtt(region, b.region), b.id))
        return lb

    # -- issuing ------------------------------------------------------------------------------
    def _may_issue(self) -> bool:
        lim = self.setup.limits
        if lim.max_requests is not None and self.issued + len(self._held) >= lim.max_requests:
            self.issuing = False
        if lim.max_sim_s is not None and self.loop.now > lim.max_sim_s:
            self.issuing = False
        return self.issuing

    def issue(self, sreq: SimRequest) -> None:
        """A client in the request's region sends it: counted, then delivered to that region's balancer after
        the one-way network delay."""
        region = sreq.req.region or self.lbs[0].region
        if self.setup.residency and sreq.req.residency is None:
            sreq.req.residency = self.setup.residency.get(region)
        lb = self.lb_for(region)
        now = self.loop.now
        flight = Flight(sreq, region, now)
        if self.setup.origin is not None:
            flight.origin = self.setup.origin
        if self.first_issue < 0:
            self.first_issue = now
        self.last_issue = now
        self.issued += 1
        self.outstanding += 1
        if sreq.program is not None:
            self._live[id(sreq.program)][2] += 1
        self.loop.at(now + self.network.one_way(flight.origin, lb.region), lb.arrive, flight)

    def _next_arrival(self, sreq: SimRequest | None) -> None:
        if sreq is not None and self._may_issue():
            cap = self.setup.client_concurrency
            if cap is not None and self.outstanding >= cap:
                self._held.append(sreq)  # every worker busy: sent (and timed) when one frees
            else:
                self.issue(sreq)
        if not self._may_issue():
            return
        nxt = next(self._arrivals, None)
        if nxt is None:
            self.issuing = False
            return
        self.loop.at(nxt.req.arrival_s, self._next_arrival, nxt)

    def _first_program(self, slot: tuple[str, int]) -> None:
        self._starts_pending -= 1
        self._start_program(slot)

    def _start_program(self, slot: tuple[str, int]) -> None:
        if not self._may_issue():
            return
        region, i = slot
        program = self.workload.new_program(region, i)
        if program is None:
            if not self._live and not self._starts_pending:
                self.issuing = False  # every program has run: the closed loop is over
            return
        self._live[id(program)] = [region, i, 0]
        for sreq in program.start():
            self.issue(sreq)
        self._maybe_program_done(program)

    def _maybe_program_done(self, program: Program) -> None:
        live = self._live[id(program)]
        if live[2] == 0:
            del self._live[id(program)]
            self._start_program((live[0], live[1]))

    def _continue(self, sreq: SimRequest) -> None:
        program = sreq.program
        if program is None:  # only closed-loop requests are scheduled here
            return
        self._live[id(program)][2] -= 1
        if self._may_issue():
            for nxt in program.on_complete(sreq):
                if not self._may_issue():
                    break
                self.issue(nxt)
        self._maybe_program_done(program)

    # -- routing outcomes (called by balancers) -------------------------------------------------
    def dispatch(self, flight: Flight, lb: SimBalancer, replica_id: str, branch: str) -> None:
        """A balancer sends ``flight`` to ``replica_id`` (branch counted): it reaches the replica after the
        network delay plus the profile's TTFT overhead — that of an engine that is stepping where the
        profile measured one (perf/profile.py), stretched by the host's slowdown where engines share
        cores (the front end's work shares them too; calibrate/fit.py divided it out as it did the steps)."""
        rep = self._dispatched(flight, lb, replica_id, branch)
        eng, busy = rep.engine, rep.engine.p.ttft_overhead_busy_s
        overhead = busy if busy is not None and eng.stepping else eng.p.ttft_overhead_s
        overhead = eng.host.front_end_s(overhead) if eng.host is not None else overhead
        if self.api_delay is not None:  # a noisy API server: requests may overtake (sim/noise.py)
            overhead = self.api_delay.delay(replica_id, overhead)
        self.loop.at(self.loop.now + self.network.one_way(lb.region, rep.region) + overhead, self._arrive_replica,
                     flight)

    def dispatch_split(self, flight: Flight, lb: SimBalancer, prefill_id: str, replica_id: str, branch: str) -> None:
        """A balancer splits ``flight``: prefilled on ``prefill_id``, decoded on ``replica_id``
        (sim/disagg.py); the decode leg starts when the prefill leg is done."""
        assert self.pd is not None
        self._dispatched(flight, lb, replica_id, branch)
        self.pd.split(flight, lb, prefill_id)

    def _dispatched(self, flight: Flight, lb: SimBalancer, replica_id: str, branch: str) -> Replica:
        """Count the branch and record the dispatch on ``flight``: its replica, when, and the balancer
        whose Router hears of its first token and finish (after the way back); the replica."""
        rep = self.replicas[replica_id]
        rec = self.recorder
        rec.branches[branch] = rec.branches.get(branch, 0) + 1
        flight.replica = replica_id
        flight.dispatched = self.loop.now
        reached = flight.at_peer if flight.at_peer >= 0 else flight.reached_lb
        flight.notify.append((lb.router, lb, self.network.one_way(rep.region, lb.region), reached))
        return rep

    def forward(self, flight: Flight, src: SimBalancer, via: Router, dst: SimBalancer) -> None:
        """``src`` sends ``flight`` on to its peer ``dst``, chosen by ``via`` (``src.peers``)."""
        self.recorder.forwarded += 1
        flight.sreq.req.from_peer = True
        flight.notify.append((via, src, 0.0, flight.reached_lb))
        hop = self.network.one_way(src.region, dst.region)
        flight.net_s += hop
        flight.at_peer = self.loop.now + hop
        self.loop.at(self.loop.now + hop, dst.arrive, flight)

    def fail(self, flight: Flight, reason: str) -> None:
        """A balancer refused ``flight``: every router it passed forgets it, and the failure is recorded with
        ``reason``."""
        for router, _, _, _ in flight.notify:
            router.on_finish(flight.sreq.req.id)
        self.recorder.fail(reason)
        self._done(flight)

    def _done(self, flight: Flight) -> None:
        self.outstanding -= 1
        if self._held:  # a client worker is free: it sends the oldest waiting arrival now
            self.issue(self._held.popleft())
        if flight.sreq.program is not None:
            self.loop.at(self.loop.now + self.workload.think_time_s, self._continue, flight.sreq)
        if self.progress is not None and (self.recorder.completed & 255) == 0:
            self.progress(self.recorder.completed)

    # -- replicas -----------------------------------------------------------------------------
    def arrive_replica(self, flight: Flight) -> None:
        """``flight`` reaches its (decode) replica."""
        self._arrive_replica(flight)

    def _arrive_replica(self, flight: Flight) -> None:
        rep = self.replicas[flight.replica]
        req = flight.sreq.req
        eng = rep.engine
        # the way back: replica → each balancer on the path (last first) → client
        back, hops, here = 0.0, [], rep.region
        for router, lb, _, reached in reversed(flight.notify):
            back += self.network.one_way(here, lb.region)
            hops.append((router, lb, back, reached))
            here = lb.region
        flight.notify = hops
        flight.back_s = back + self.network.one_way(here, flight.origin)
        if not eng.fits(req.prompt_tokens, flight.sreq.output_tokens):
            self.loop.at(self.loop.now + flight.back_s, self._reject, flight)
            return
        hashes, bt = flight.sreq.cache_blocks()
        seq = Seq(req.id, req.prompt_tokens, flight.sreq.output_tokens, hashes, bt, flight, req.max_output_tokens)
        if flight.prefill is not None and self.pd is not None:  # its KV comes from the prefill engine
            seq.remote = self.pd.transfer(flight)
        eng.submit(seq)

    def _reject(self, flight: Flight) -> None:
        self.fail(flight, "rejected: prompt + output exceed the replica's KV capacity")

    def _first_token(self, seq: Seq, t: float) -> None:
        flight = seq.payload
        if flight.__class__ is PrefillLeg:  # a prefill engine's part of a split request
            assert self.pd is not None
            self.pd.prefill_done(seq, t)
            return
        flight.first = t + flight.back_s
        if not self._first_token_matters:
            return
        for router, _lb, delay, reached in flight.notify:
            policy = router.policy  # nobody else reads what on_first_token changes
            if policy.reads_prefill_backlog or policy.listeners:
                at = t + delay
                self.loop.at(at, self._lb_first_token, (router, seq.rid, at - reached))

    @staticmethod
    def _lb_first_token(arg: tuple[Router, str, float]) -> None:
        arg[0].on_first_token(arg[1], arg[2])  # TTFT as that balancer measures it

    def _finish(self, seq: Seq, t: float) -> None:
        flight = seq.payload
        if flight.__class__ is PrefillLeg:
            return  # its one token was the prefill's: the decode leg carries on
        if flight.prefill is not None and self.pd is not None:
            self.pd.finished(flight)
        out = flight.sreq.output_tokens
        for router, lb, delay, reached in flight.notify:
            at = t + delay
            self.loop.at(at, self._lb_finish, (router, lb, seq.rid, at - reached, out))
        done = t + flight.back_s
        queue_s = flight.dispatched - flight.reached_lb - flight.net_s
        queue_s = queue_s if queue_s > 0.0 else 0.0  # max(0.0, ...) without the call; NaN, -0.0 give 0.0
        rep = self.replicas[flight.replica]
        if self.migrator is not None:
            self.migrator.finished(seq, flight.replica)
        self.recorder.complete(flight.sent, flight.first, done, out, flight.sreq.req.prompt_tokens,
                               seq.cached if seq.cached > 0 else 0, queue_s, flight.replica,
                               rep.region != flight.client_region, flight.client_region, flight.sreq.req.from_peer)
        if flight.sreq.program is None:
            self._done(flight)  # open loop: nobody waits on the client side
        else:
            self.loop.at(done, self._done, flight)  # the client goes on when the answer reaches it

    @staticmethod
    def _lb_finish(arg: tuple[Router, SimBalancer, str, float, int]) -> None:
        router, lb, rid, e2e_s, output_tokens = arg
        router.on_finish(rid, e2e_s, output_tokens)
        if lb.queue:
            lb.drain()

    # -- periodic work ----------------------------------------------------------------------------
    def _active(self) -> bool:
        return self.issuing or self.outstanding > 0

    def _probe(self, lb: SimBalancer) -> None:
        lb.probe()
        if self._active():
            self.loop.at(self.loop.now + lb.probe_interval_s, self._probe, lb)

    def _sample(self, _=None) -> None:
        self.recorder.sample(self.loop.now, [r.engine.running for r in self.replicas.values()],
                             self.outstanding, sum(len(lb.queue) for lb in self.lbs), self.issued)
        if self._active():
            self.loop.at(self.loop.now + self.setup.sample_interval_s, self._sample)

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run to the end (limits reached and in-flight requests finished or drained) and return the summary:
        latencies, throughput, hit rate, branches, load verdict."""
        # Objects that exist before the run (a parsed trace, scenarios, earlier runs' results)
        # are frozen for its duration, so the cyclic collector does not walk them again and again
        # (about 4 % of a run's instructions); results do not depend on when it runs. Skipped
        # when someone else froze objects first (unfreezing would release theirs too).
        freeze = gc.isenabled() and gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return self._run()
        finally:
            if freeze:
                gc.unfreeze()

    def _run(self) -> dict:
        wl = self.workload
        if wl.closed_loop:
            for region, n in wl.clients.items():
                for i in range(n):  # stagger starts over the first second
                    self._starts_pending += 1
                    self.loop.at(self.rng.random(), self._first_program, (region, i))
        else:
            self._arrivals = iter(wl.arrivals())
            self._next_arrival(None)
        for lb in self.lbs:
            self.loop.at(0.0, self._probe, lb)
        self.loop.at(0.0, self._sample)
        if self.migrator is not None:
            self.migrator.start()
        lim = self.setup.limits
        horizon = (lim.max_sim_s if lim.max_sim_s is not None else float("inf")) + lim.drain_s
        self.loop.run(until=horizon)
        if self.outstanding:  # still in flight at the horizon
            self.recorder.failed["unfinished"] = self.outstanding
        hours = len(self.replicas) * self.loop.now / 3600.0
        result = self.recorder.result(hours)
        result["issued"] = self.issued
        result["preemptions"] = sum(r.engine.preemptions for r in self.replicas.values())
        result["max_lb_queue"] = max(lb.max_queue for lb in self.lbs)
        result["sim_time_s"] = round(self.loop.now, 6)
        result["load"] = self.recorder.load(max(0.0, self.first_issue), self.last_issue, self.issued,
                                            self.workload.closed_loop)
        result["slo"] = self.recorder.slo(self.setup.slo_ttft_s, self.setup.slo_tpot_s, self.issued)
        if self.migrator is not None:
            result["migration"] = self.migrator.summary()
        if self.pd is not None:
            result["pd"] = self.pd.summary([lb.router for lb in self.lbs])
        state = self.policy_state()
        if state:  # only policies with stateful plugins have any
            result["policy_state"] = state
        return result

    def policy_state(self) -> dict[str, float]:
        """The stateful plugins' state at the end of the run, per router ("lb/plugin.key" when
        several routers have some)."""
        routers = [(f"{lb.id}{'/peers' if r is lb.peers else ''}", r)
                   for lb in self.lbs for r in (lb.router, lb.peers) if r is not None and r.policy.listeners]
        if len(routers) == 1:
            return routers[0][1].policy_state()
        return {f"{name}/{k}": v for name, r in routers for k, v in r.policy_state().items()}
