"""Moving running sequences between simulated engines: CascadeInfer's stages, or Llumnix-like
memory balancing.

Built only when a balancer's policy asks for it (a ``cascadeinfer`` or ``llumnix`` preset), so
every other run pays nothing. For CascadeInfer (004_131677394a4b07f8.txt):

* **Plan** (§4.2): unless the preset names its stages, the partition runs at start-up on the
  QoE model fitted to this profile (``sim/qoe_profiling.py``) and a length sample of the
  workload (``layout``: exact DP, two-phase heuristic, chain, or one stage).
* **Hand-over** (§3.2): every engine gets its stage's upper bound as a context limit; a sequence
  that passes it goes to the stage covering its length, the receiver chosen by bid-ask (§4.4)
  (``bidask: full`` or ``handover``) or, with ``bidask: off``, as the least loaded.
* **Transfer** (§5): the KV of the sequence (its context × ``kv_bytes_per_token``) moves at
  ``transfer_gb_s`` while the sequence keeps decoding at the source (live migration; the last
  round's few tokens are not charged); at most ``max_transfers`` concurrent transfers per
  instance, counting both ends; skipped — the sequence stays where it is and is retried on the
  next round — when the target lacks free KV or a batch slot.
* **Receive** (§4.4): a receiver queues what it won by the sender's load and starts the first
  whose sender has a free transfer slot; a request passed over too often starves the rest.
* **Rebalance** (§4.4, ``bidask: full``): every ``rebalance_interval_s`` an instance whose KV demand is 25 % above
  its stage's mean asks its stage peers to take its newest sequences.
* **Refine** (§4.3): every ``refine_interval_s`` each stage boundary moves by the QoE split of
  the two stages' sequences (or a naive split), EMA-smoothed, frozen under five sequences.

For the Llumnix-like baseline (``migrate`` on) every ``rebalance_interval_s`` the most loaded
instances (KV demand) each send their newest sequence to the least loaded ones while the gap
exceeds ``imbalance`` of capacity; with ``migrate`` off it only dispatches.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvroute.cascade import bidask, partition
from kvroute.cascade.ranges import Item, Refiner, divide, splitter
from kvroute.perf.network import Network
from kvroute.policy.presets.cascadeinfer import LengthStage, stage_filter
from kvroute.sim.balancer import SimBalancer
from kvroute.sim.cascade_planning import StagePlanner
from kvroute.sim.engine import DECODE, Engine, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.migration_settings import MigrationSettings
from kvroute.sim.qoe_profiling import QoEFit, fit_profile


class _Replica(Protocol):
    @property
    def engine(self) -> Engine: ...

    @property
    def region(self) -> str: ...


class MigrationHost(Protocol):
    """What the migrator reads of the simulation it serves (:class:`kvroute.sim.simulation.Simulation`;
    a protocol, so that this module does not import the one that imports it)."""

    @property
    def loop(self) -> EventLoop: ...

    @property
    def lbs(self) -> Sequence[SimBalancer]: ...

    @property
    def replicas(self) -> Mapping[str, _Replica]: ...

    @property
    def workload(self) -> object: ...

    @property
    def seed(self) -> int: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def network(self) -> Network: ...

    @property
    def issuing(self) -> bool: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def migration_settings(self) -> MigrationSettings: ...

DEFAULT_KV_BYTES_PER_TOKEN = 131_072  # assumed when a profile does not say (128 KiB)


def make_migrator(sim: MigrationHost) -> Migrator | None:
    """A migrator when the first balancer's policy has length stages or is ``llumnix`` with
    ``migrate`` on, else None."""
    policy = sim.lbs[0].router.policy if sim.lbs else None
    if policy is None:
        return None
    if stage_filter(policy) is not None or (policy.name == "llumnix" and sim.migration_settings.migrate):
        return Migrator(sim)
    return None


class Migrator:
    """Transfers, hand-overs, rebalancing and refinement over one simulation's engines."""

    def __init__(self, sim: MigrationHost):
        self.sim = sim
        self.loop = sim.loop
        # every balancer's stage filter (one balancer in CascadeInfer's setting; kept in step)
        self.stage_filters = [f for lb in sim.lbs if (f := stage_filter(lb.router.policy)) is not None]
        self.cascade: LengthStage | None = self.stage_filters[0] if self.stage_filters else None
        p = sim.migration_settings
        self.params = p
        self.order = [ep.id for ep in sim.lbs[0].router.endpoints]
        self.engines: dict[str, Engine] = {rid: sim.replicas[rid].engine for rid in self.order}
        prof = self.engines[self.order[0]].p
        self.profile = prof
        bytes_per_token = prof.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN
        self.bytes_per_token = bytes_per_token
        self.tokens_per_s = p.transfer_gb_s * 1e9 / bytes_per_token
        self.max_transfers = p.max_transfers
        self.active: dict[str, int] = dict.fromkeys(self.order, 0)
        self.queues: dict[str, bidask.ReceiverQueue] = {rid: bidask.ReceiverQueue() for rid in self.order}
        self.inbound: dict[str, int] = dict.fromkeys(self.order, 0)  # tokens queued to receive
        self.outbound: dict[str, int] = dict.fromkeys(self.order, 0)  # tokens buffered to send
        self.pending: dict[str, tuple[Seq, str, str, int]] = {}  # rid → (seq, source, target, ctx)
        self.retry: dict[str, tuple[Seq, str]] = {}  # over their limit, not yet moved
        self.produced_at: dict[str, int] = {}  # rid → tokens produced when it arrived at its engine
        self.out_tokens: dict[str, int] = dict.fromkeys(self.order, 0)  # tokens generated per instance
        self.stats = {"migrations": 0, "handovers": 0, "rebalances": 0, "skipped_no_kv": 0,
                      "transfer_s": 0.0, "refinements": 0}
        self._qoe: QoEFit | None = None
        self.refiners: list[Refiner] = []
        self.planner = StagePlanner(self, sim.workload, sim.seed)

    # -- set-up -------------------------------------------------------------------------------
    def start(self) -> None:
        """Plan (CascadeInfer), set the engines' limits and schedule the periodic rounds."""
        if self.cascade is not None:
            self.planner.start()
            self._apply_limits()
            self._start_refiners()
            if self.params.refinement != "off":
                self.loop.at(self.params.refine_interval_s, self._refine_round)
        if self.cascade is None or self.params.bidask == "full":
            self.loop.at(self.params.rebalance_interval_s, self._rebalance_round)
        else:
            self.loop.at(self.params.rebalance_interval_s, self._retry_round)

    def _fit(self) -> QoEFit:
        if self._qoe is None:
            self._qoe = fit_profile(self.profile)
        return self._qoe

    def fit(self) -> QoEFit:
        """The QoE model fitted to this profile (fitted once, when first needed)."""
        return self._fit()

    def in_flight(self) -> int:
        """Sequences in the engines' running batches now."""
        return sum(eng.running for eng in self.engines.values())

    def ongoing(self) -> bool:
        """Whether requests are still coming or in flight (periodic rounds continue)."""
        return self._active()

    def issuing(self) -> bool:
        """Whether the workload still issues requests."""
        return self.sim.issuing

    def replanned(self) -> None:
        """A periodic plan replaced the stages: new limits, refiners from the new bounds."""
        self._apply_limits()
        self._start_refiners()

    def _start_refiners(self) -> None:
        c = self.cascade
        assert c is not None
        if self.params.refinement != "off" and len(c.stages) > 1:
            split = splitter(self.params.refinement, self._fit().model)
            self.refiners = [Refiner(float(b), split) for b in c.bounds]
        else:
            self.refiners = []

    def _apply_limits(self) -> None:
        c = self.cascade
        assert c is not None
        for rid, eng in self.engines.items():
            eng.limit = c.context_limit(rid)
            eng.on_limit = self._over_limit

    # -- bookkeeping from the simulation ----------------------------------------------------------
    def finished(self, seq: Seq, replica: str) -> None:
        """A sequence completed on ``replica``: count the tokens it generated there."""
        self.out_tokens[replica] = self.out_tokens.get(replica, 0) + seq.output - self.produced_at.pop(seq.rid, 0)
        if self.cascade is not None:
            self.planner.finished(seq.payload.sreq.req.prompt_tokens, seq.output)
        self.retry.pop(seq.rid, None)

    def demand(self, rid: str) -> float:
        """KV tokens an instance's requests hold or are about to receive."""
        eng = self.engines[rid]
        return eng.used - len(eng.evictable) * eng.cache_bt + self.inbound[rid]

    # -- hand-over ---------------------------------------------------------------------------------
    def _over_limit(self, eng: Engine, seqs: list[Seq]) -> None:
        for seq in seqs:
            self._handover(eng, seq)

    def _handover(self, src: Engine, seq: Seq) -> None:
        c = self.cascade
        assert c is not None
        ctx = src.context(seq)
        if not ctx:
            return
        stage = partition.stage_of(c.bounds, ctx)
        if stage == c.stage(src.id):  # the boundary moved past it meanwhile
            seq.moving = False
            self.retry.pop(seq.rid, None)
            return
        candidates = c.stages[stage]
        if self.params.bidask == "off":
            target = min(candidates, key=self.demand)
        else:
            target = self._receiver(src.id, candidates)
        self.stats["handovers"] += 1
        self._queue(seq, src.id, target, ctx)

    def _receiver(self, sender: str, candidates: list[str]) -> str:
        """Bid-ask (§4.4): each candidate bids its load and earliest start; replies arrive after
        one RTT plus a little jitter (the first to answer wins among the kept three)."""
        rng = self.sim.rng
        net = self.sim.network
        here = self.sim.replicas[sender].region
        bids = [bidask.Bid(r, self.demand(r), bidask.earliest_start(self.inbound[r], self.tokens_per_s),
                           net.rtt(here, self.sim.replicas[r].region) + rng.random() * 1e-4)
                for r in candidates if r != sender]
        got = bidask.choose(bids)
        return got.receiver if got is not None else candidates[0]

    def _queue(self, seq: Seq, src: str, dst: str, ctx: int) -> None:
        if seq.rid in self.pending:
            return
        self.pending[seq.rid] = (seq, src, dst, ctx)
        self.retry.pop(seq.rid, None)
        self.outbound[src] += ctx
        self.inbound[dst] += ctx
        self.queues[dst].push(seq.rid, src, float(self.outbound[src]))
        self._pump(dst)

    def _busy(self, rid: str) -> bool:
        return self.active[rid] >= self.max_transfers

    def _pump(self, dst: str) -> None:
        """Start the receiver's transfers while it has slots (§4.4's receive loop)."""
        q = self.queues[dst]
        while q and not self._busy(dst):
            got = q.next(self._busy)
            if got is None:
                return
            rid, src = got
            seq, _, _, ctx_queued = self.pending.pop(rid)
            self.outbound[src] -= ctx_queued
            self.inbound[dst] -= ctx_queued
            source, target = self.engines[src], self.engines[dst]
            ctx = source.context(seq)
            if not ctx:
                continue  # finished or preempted meanwhile
            incoming = len(target.incoming)
            if target.free_tokens() < ctx + target.p.block_size or target.running + incoming >= target.p.max_running:
                self.stats["skipped_no_kv"] += 1  # no idle cache there: it keeps running here (§5)
                if self.cascade is not None:
                    self.retry[rid] = (seq, src)  # still past its stage: tried again next round
                else:
                    seq.moving = False
                continue
            target.reserve(ctx)
            self.active[src] += 1
            self.active[dst] += 1
            dt = ctx / self.tokens_per_s
            self.stats["transfer_s"] += dt
            self.loop.at(self.loop.now + dt, self._transferred, (seq, src, dst, ctx))

    def _transferred(self, arg: tuple[Seq, str, str, int]) -> None:
        seq, src, dst, ctx = arg
        self.active[src] -= 1
        self.active[dst] -= 1
        source, target = self.engines[src], self.engines[dst]
        target.reserve(-ctx)
        if source.context(seq):
            produced_before = self.produced_at.get(seq.rid, 0)

            def arrived(s: Seq, now_ctx: int) -> None:
                produced = s.generated + 1
                self.out_tokens[src] += produced - produced_before
                self.produced_at[s.rid] = produced
                s.payload.replica = dst
                self.stats["migrations"] += 1
                target.adopt(s, now_ctx)

            source.depart(seq, arrived)
        for rid in self.order:  # a freed sender slot may unblock any receiver
            if self.queues[rid]:
                self._pump(rid)

    # -- periodic rounds -----------------------------------------------------------------------------
    def _active(self) -> bool:
        return self.sim.issuing or self.sim.outstanding > 0

    def _retry_round(self, _: object = None) -> None:
        if self.cascade is not None:
            self.planner.observe()
        for rid, (seq, src) in list(self.retry.items()):
            if seq.state == DECODE and self.engines[src].context(seq):
                self.retry.pop(rid, None)
                self._handover(self.engines[src], seq)
            else:
                self.retry.pop(rid, None)
        if self._active():
            self.loop.at(self.loop.now + self.params.rebalance_interval_s, self._retry_round)

    def _rebalance_round(self, _: object = None) -> None:
        if self.cascade is not None:
            self.planner.observe()
            self._retry_round_once()
            for ids in self.cascade.stages:
                if len(ids) > 1:
                    self._bidask_stage(ids)
        else:
            self._memory_balance()
        if self._active():
            self.loop.at(self.loop.now + self.params.rebalance_interval_s, self._rebalance_round)

    def _retry_round_once(self) -> None:
        for rid, (seq, src) in list(self.retry.items()):
            self.retry.pop(rid, None)
            if seq.state == DECODE and self.engines[src].context(seq):
                self._handover(self.engines[src], seq)

    def _bidask_stage(self, ids: list[str]) -> None:
        demands = [self.demand(r) for r in ids]
        mean = sum(demands) / len(demands)
        for rid, d in zip(ids, demands):
            if not bidask.overloaded(d, demands):
                continue
            eng = self.engines[rid]
            lengths = [(s.rid, s.a + eng.steps) for s in eng.decoding.values() if not s.moving]
            by_id = {s.rid: s for s in eng.decoding.values()}
            for victim in bidask.shed(d, mean, lengths):
                seq = by_id[victim]
                ctx = eng.context(seq)
                if not ctx:
                    continue
                seq.moving = True
                self.stats["rebalances"] += 1
                self._queue(seq, rid, self._receiver(rid, ids), ctx)

    def _memory_balance(self) -> None:
        cap = self.profile.kv_tokens
        gap = self.params.imbalance * cap
        ranked = sorted(self.order, key=self.demand)
        for i in range(len(ranked) // 2):
            low, high = ranked[i], ranked[-1 - i]
            if self.demand(high) - self.demand(low) <= gap:
                break
            eng = self.engines[high]
            newest = next((s for s in reversed(eng.decoding.values()) if not s.moving), None)
            if newest is None:
                continue
            ctx = eng.context(newest)
            if ctx:
                newest.moving = True
                self.stats["rebalances"] += 1
                self._queue(newest, high, low, ctx)

    def _refine_round(self, _: object = None) -> None:
        c = self.cascade
        assert c is not None
        items = [self._items(ids, c.bounds[s - 1] if s else 0) for s, ids in enumerate(c.stages)]
        bounds = list(c.bounds)
        for s, ref in enumerate(self.refiners):
            own = divide(items[s], len(c.stages[s]))
            lo = bounds[s - 1] if s else 0
            hi = bounds[s + 1] if s + 1 < len(bounds) else math.inf
            bounds[s] = int(ref.update(own, items[s + 1], len(c.stages[s + 1]), lo, hi))
        if bounds != c.bounds:
            self.stats["refinements"] += 1
            for f in self.stage_filters:
                f.set_bounds(bounds)
            self._apply_limits()
        if self._active():
            self.loop.at(self.loop.now + self.params.refine_interval_s, self._refine_round)

    def _items(self, ids: list[str], lo: int) -> list[Item]:
        """(input length if it was prefilled in this stage else 0, context) of a stage's sequences."""
        out: list[Item] = []
        for rid in ids:
            eng = self.engines[rid]
            for s in eng.decoding.values():
                prompt = s.payload.sreq.req.prompt_tokens
                out.append((float(prompt if prompt >= lo else 0), float(s.a + eng.steps)))
        return out

    # -- results ------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """What moved and how the stages ended, for the run's JSON (no wall-clock times: a
        fixed-seed run's JSON is byte-identical)."""
        out: dict[str, Any] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.stats.items()}
        out["out_tokens"] = dict(self.out_tokens)
        if self.cascade is not None:
            c = self.cascade
            out["stages"] = [list(s) for s in c.stages]
            out["bounds"] = list(c.bounds)
            out["plan"] = self.planner.note
            out["plans"] = self.planner.shapes
            if self._qoe is not None:
                out["qoe_error"] = round(self._qoe.model_error, 4)
        return out
