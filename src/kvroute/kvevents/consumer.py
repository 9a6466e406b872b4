"""The KV-event consumer: subscribes to every event-publishing replica, keeps each one's exact
cache table, recovers gaps by replay and says which replicas the gateway can trust.

Per replica and data-parallel rank (vLLM offsets both ports by the rank, ``offset_endpoint_port``)
one ZMQ SUB socket connects to the engine's PUB endpoint; batches are decoded (``wire``) and
applied in sequence order (``index``). The sequence number (8 bytes, big-endian, from 0 per
publisher process) drives recovery, as vLLM's replay protocol intends (fleet-facts.md §1.7):

* on start, and after a publisher restart (the sequence goes back), the rank asks its replay
  socket (a DEALER to the engine's ROUTER: ``[b"", start_seq]``; replies ``[b"", topic, seq,
  payload]``, or ``[b"", seq, payload]`` from publishers before vLLM PR #45177 and SGLang,
  ended by an ``0xff * 8`` sequence) for everything from 0: a buffer that still starts at 0 gives
  the exact cache, an empty one an engine that has published nothing yet (empty cache);
* a gap (``seq > last + 1``) is replayed from ``last + 1``; live batches already applied from a
  replay are dropped as duplicates;
* when the replay cannot fill the hole (the buffer has moved past it, there is no replay socket,
  it does not answer), the rank's share is dropped and the replica is **stale**: the gateway
  routes it on its approximate index, while events keep rebuilding the table from that point;
  the view is trusted again after ``stale_s`` (by then a busy cache has turned over), at once on
  ``AllBlocksCleared`` (the cache is known to be empty), or after a full replay.

Malformed frames and payloads, unknown event types and out-of-order sequences are counted per
replica and logged once per replica and kind; they never raise out of the consumer and never
touch another replica's table.

API (also for several gateway instances that each build their index from the same engines)::

    consumer = KVEventConsumer(block_tokens=32, on_change=lambda name, table: ...)
    consumer.add("r0", EventSource("tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558", topic="kv"))
    await consumer.start()                 # tasks on the running loop; add()/remove() work before or after
    consumer.table("r0")                   # the exact table (own key -> holders) while trusted, else None
    consumer.speculate("r0", hashes, now)  # a prompt was just routed there (covers prefill time)
    consumer.restarted("r0")               # a probe saw the engine restart: resync from 0
    consumer.status("r0")                  # source, lag, sequence, counters (admin API, /metrics)
    await consumer.stop()

``on_change(name, table_or_None)`` is called whenever a replica's trusted table appears or goes
(stale); the gateway then points its prefix index at the table or back at its approximate one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvroute.kvevents.index import BlockSizeMismatch, EventIndex, ReplicaTable, TokenError
from kvroute.kvevents.wire import END_SEQ, AllBlocksCleared, MalformedPayload, decode_batch

log = logging.getLogger("kvroute.kvevents")

EVENTS, STALE = "events", "stale"  # a replica's source; "approximate" (no events) is the gateway's


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of data-parallel rank ``rank``: vLLM's ``offset_endpoint_port`` (tcp port +
    rank, port 0 left alone; ``inproc://x`` → ``inproc://x_dp{rank}``)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} has no tcp port to offset by the rank")
    return endpoint if int(port) == 0 else f"{host}:{int(port) + rank}"


@dataclass(frozen=True)
class EventSource:
    """Where one replica publishes: its PUB endpoint (the consumer connects), its replay ROUTER
    endpoint, the topic, and how many data-parallel ranks publish (on consecutive ports)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_ranks: int = 1


@dataclass
class _Rank:
    rank: int
    endpoint: str
    replay: str | None
    index: EventIndex
    last_seq: int | None = None  # the last sequence applied (None: take the next one as the baseline)
    dedup_until: int = -1  # live batches up to here were applied by a replay already
    stale_since: float | None = None  # monotonic; None: exact
    resync_from: int | None = None  # replay wanted from this sequence
    task: asyncio.Task | None = None


@dataclass
class _Replica:
    name: str
    source: EventSource
    table: ReplicaTable
    ranks: list[_Rank]
    state: str = STALE
    reason: str = "starting"
    unusable: str | None = None  # events can never key this replica (block size): stays stale
    lag_s: float | None = None  # receive time minus the batch's timestamp, last batch
    last_event: float | None = None  # monotonic time of the last applied batch
    counters: dict[str, int] = field(default_factory=dict)
    logged: set[str] = field(default_factory=set)

    def count(self, kind: str, n: int = 1) -> None:
        self.counters[kind] = self.counters.get(kind, 0) + n

    def warn_once(self, kind: str, message: str) -> None:
        """Count ``kind``; log the first of each kind for this replica."""
        self.count(kind)
        if kind not in self.logged:
            self.logged.add(kind)
            log.warning("kv events of %s: %s (logged once; counted under %s)", self.name, message, kind)


class KVEventConsumer:
    """Subscribes to replicas' KV-event streams and keeps their exact cache tables (module docstring)."""

    def __init__(self, block_tokens: int, *, stale_s: float = 30.0, speculative_ttl_s: float = 2.0,
                 replay_timeout_s: float = 2.0,
                 on_change: Callable[[str, dict[int, int] | None], None] | None = None):
        self.block_tokens = block_tokens
        self.stale_s = stale_s
        self.speculative_ttl_s = speculative_ttl_s
        self.replay_timeout_s = replay_timeout_s
        self.on_change = on_change
        self.replicas: dict[str, _Replica] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._tick: asyncio.Task | None = None
        self.running = False

    # -- membership ----------------------------------------------------------------------------
    def add(self, name: str, source: EventSource) -> None:
        """Start following a replica's events (replaces an earlier source of the same name)."""
        if source.dp_ranks < 1:
            raise ValueError(f"dp_ranks must be ≥ 1, got {source.dp_ranks}")
        self.remove(name)
        table = ReplicaTable(self.speculative_ttl_s)
        ranks = [_Rank(r, rank_endpoint(source.endpoint, r),
                       rank_endpoint(source.replay_endpoint, r) if source.replay_endpoint else None,
                       EventIndex(table, self.block_tokens), stale_since=time.monotonic(), resync_from=0)
                 for r in range(source.dp_ranks)]
        rep = self.replicas[name] = _Replica(name, source, table, ranks)
        if self.running:
            self._launch(rep)

    def remove(self, name: str) -> None:
        """Stop following a replica and drop its table."""
        rep = self.replicas.pop(name, None)
        if rep is None:
            return
        for rs in rep.ranks:
            if rs.task is not None:
                rs.task.cancel()

    def table(self, name: str) -> dict[int, int] | None:
        """The replica's exact table while its events are trusted; None when stale or unknown."""
        rep = self.replicas.get(name)
        return rep.table.blocks if rep is not None and rep.state == EVENTS else None

    def speculate(self, name: str, hashes: Sequence[int], now: float | None = None) -> None:
        """A prompt with these block keys was just routed to ``name`` (see ReplicaTable)."""
        rep = self.replicas.get(name)
        if rep is not None and hashes:
            rep.table.speculate(hashes, time.monotonic() if now is None else now)

    def restarted(self, name: str) -> None:
        """The engine restarted (a probe saw it): its cache is empty; resync every rank from 0."""
        rep = self.replicas.get(name)
        if rep is None:
            return
        rep.count("restarts")
        for rs in rep.ranks:
            self._lose(rep, rs, "engine restarted", resync_from=0)
            if rs.task is not None:  # it may be waiting for a batch that never comes: start it afresh
                rs.task.cancel()
                rs.task = asyncio.create_task(self._follow(rep, rs), name=f"kv-events {rep.name}/{rs.rank}")

    # -- status -----------------------------------------------------------------------------------
    def status(self, name: str) -> dict[str, Any] | None:
        """What the admin API and /metrics show for a replica (None: not followed)."""
        rep = self.replicas.get(name)
        if rep is None:
            return None
        now = time.monotonic()
        ranks = []
        for rs in rep.ranks:
            ix = rs.index
            ranks.append({"rank": rs.rank, "endpoint": rs.endpoint, "seq": rs.last_seq,
                          "stale": rs.stale_since is not None, "blocks": len(ix), "stored": ix.stored,
                          "removed": ix.removed, "cleared": ix.cleared, "ignored": ix.ignored,
                          "unknown_parent": ix.unknown_parent, "unknown_removed": ix.unknown_removed})
        return {"source": rep.state, "reason": rep.reason if rep.state == STALE else None,
                "lag_s": rep.lag_s,
                "last_event_age_s": None if rep.last_event is None else round(now - rep.last_event, 3),
                "blocks": len(rep.table.blocks), "counters": dict(rep.counters), "ranks": ranks}

    # -- life cycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start a task per rank and the maintenance tick on the running loop."""
        if self.running:
            return
        self.running = True
        self._ctx = zmq.asyncio.Context()
        for rep in self.replicas.values():
            self._launch(rep)
        self._tick = asyncio.create_task(self._maintain())

    async def stop(self) -> None:
        """Cancel every task and close the sockets."""
        self.running = False
        tasks = [rs.task for rep in self.replicas.values() for rs in rep.ranks if rs.task is not None]
        if self._tick is not None:
            tasks.append(self._tick)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _launch(self, rep: _Replica) -> None:
        for rs in rep.ranks:
            rs.task = asyncio.create_task(self._follow(rep, rs), name=f"kv-events {rep.name}/{rs.rank}")

    async def _maintain(self) -> None:
        """Expire speculative entries; end stale periods that have lasted ``stale_s``."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for rep in list(self.replicas.values()):
                rep.table.expire(now)
                changed = False
                for rs in rep.ranks:
                    if (rs.stale_since is not None and rs.resync_from is None
                            and now - rs.stale_since >= self.stale_s):
                        rs.stale_since = None
                        changed = True
                if changed:
                    self._update(rep)

    # -- one rank's stream --------------------------------------------------------------------------
    async def _follow(self, rep: _Replica, rs: _Rank) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # keep what arrives while a replay runs
        sub.setsockopt(zmq.SUBSCRIBE, rep.source.topic.encode())
        try:
            sub.connect(rs.endpoint)
            while True:
                if rs.resync_from is not None:
                    await self._resync(rep, rs)
                    continue
                frames = await sub.recv_multipart()
                try:
                    self._on_frames(rep, rs, frames)
                except Exception as exc:  # a bug must not stop the stream or reach the gateway
                    rep.warn_once("internal", f"{type(exc).__name__}: {exc}")
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            rep.warn_once("socket", f"{rs.endpoint}: {exc}")
            self._lose(rep, rs, f"socket error: {exc}")
        finally:
            sub.close(linger=0)

    def _on_frames(self, rep: _Replica, rs: _Rank, frames: list[bytes]) -> None:
        if len(frames) != 3:
            rep.warn_once("malformed_frames", f"a message of {len(frames)} frames (expected topic, seq, payload)")
            return
        _, seq_b, payload = frames
        if len(seq_b) != 8:
            rep.warn_once("malformed_seq", f"a sequence frame of {len(seq_b)} bytes (expected 8)")
            return
        seq = int.from_bytes(seq_b, "big")
        last = rs.last_seq
        if last is not None and seq != last + 1:
            if seq <= last:
                if seq <= rs.dedup_until:
                    return  # applied by the replay already
                rep.warn_once("out_of_order", f"rank {rs.rank}: sequence {seq} after {last} "
                              "(publisher restarted?); resyncing from 0")
                self._lose(rep, rs, "sequence went back", resync_from=0)
            else:
                rep.count("gaps")
                rs.resync_from = last + 1
            return  # the batch is in the publisher's buffer: the replay brings it
        self._apply(rep, rs, seq, payload)
        rs.dedup_until = -1

    def _apply(self, rep: _Replica, rs: _Rank, seq: int, payload: bytes) -> None:
        rs.last_seq = seq
        try:
            batch = decode_batch(payload)
        except MalformedPayload as exc:
            rep.warn_once(f"malformed_{exc.kind}", f"sequence {seq}: {exc}")
            return
        if batch.unknown:
            rep.warn_once("unknown_events", "an event type this decoder does not know (skipped)")
            if batch.unknown > 1:
                rep.count("unknown_events", batch.unknown - 1)
        if batch.bad:
            rep.warn_once("malformed_event", batch.bad_reason)
            if batch.bad > 1:
                rep.count("malformed_event", batch.bad - 1)
        index = rs.index
        for ev in batch.events:
            try:
                index.apply(ev)
            except BlockSizeMismatch as exc:
                rep.warn_once("block_size", f"{exc}: the gateway's block_tokens must equal the engine's block "
                              "size; this replica stays on the approximate index")
                rep.unusable = str(exc)
                self._update(rep)
                return
            except TokenError as exc:
                rep.warn_once("malformed_event", str(exc))
                continue
            if isinstance(ev, AllBlocksCleared) and rs.stale_since is not None:
                rs.stale_since = None  # the cache is known to be empty: exact from here
                self._update(rep)
        rep.lag_s = max(0.0, time.time() - batch.ts)
        rep.last_event = time.monotonic()

    async def _resync(self, rep: _Replica, rs: _Rank) -> None:
        """Replay from ``rs.resync_from``; on failure the rank is stale and takes the next live
        batch as its baseline."""
        start = rs.resync_from
        assert start is not None
        rs.resync_from = None
        got = await self._replay(rep, rs, start) if rs.replay else None
        if got is None or (got and got[0][0] != start) or (not got and start > 0):
            why = ("no replay endpoint" if not rs.replay else "replay failed" if got is None
                   else f"replay starts at {got[0][0]}, after {start}" if got else f"replay has nothing from {start}")
            rep.count("unrecovered")
            self._lose(rep, rs, why)
            for seq, payload in got or ():  # rebuild from what the buffer still has
                self._apply(rep, rs, seq, payload)
            rs.dedup_until = rs.last_seq if rs.last_seq is not None else -1
            self._update(rep)
            return
        rep.count("replays")
        for seq, payload in got:
            self._apply(rep, rs, seq, payload)
        if start == 0:
            rs.stale_since = None  # the whole history of this publisher: exact
        rs.dedup_until = rs.last_seq if rs.last_seq is not None else -1
        if not got and start == 0:
            rs.last_seq = None  # nothing published yet: the first live batch (seq 0) is the baseline
        self._update(rep)

    async def _replay(self, rep: _Replica, rs: _Rank, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the publisher's replay socket for every buffered batch from ``start``."""
        assert self._ctx is not None and rs.replay is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(rs.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # topic, seq, payload (vLLM ≥ PR #45177)
                    seq_b, payload = frames[1], frames[2]
                elif len(frames) == 2:  # seq, payload (older vLLM, SGLang)
                    seq_b, payload = frames
                else:
                    rep.warn_once("malformed_replay", f"a replay message of {len(frames)} frames")
                    continue
                if seq_b == END_SEQ:
                    return out
                if len(seq_b) != 8:
                    rep.warn_once("malformed_seq", f"a replayed sequence frame of {len(seq_b)} bytes")
                    continue
                seq = int.from_bytes(seq_b, "big")
                if out and seq <= out[-1][0]:
                    rep.warn_once("out_of_order", f"replayed sequence {seq} after {out[-1][0]}")
                    continue
                out.append((seq, payload))
        except TimeoutError:
            rep.warn_once("replay_timeout", f"{rs.replay} did not finish a replay within "
                          f"{self.replay_timeout_s:g} s")
            return None
        except zmq.ZMQError as exc:
            rep.warn_once("socket", f"{rs.replay}: {exc}")
            return None
        finally:
            dealer.close(linger=0)

    # -- state --------------------------------------------------------------------------------------
    def _lose(self, rep: _Replica, rs: _Rank, why: str, resync_from: int | None = None) -> None:
        """The rank's view is lost: drop its share, mark it stale, optionally ask for a replay."""
        rs.index.clear()
        rs.last_seq = None
        rs.dedup_until = -1
        rs.stale_since = time.monotonic()
        rs.resync_from = resync_from
        rep.reason = why
        self._update(rep)

    def _update(self, rep: _Replica) -> None:
        state = STALE if rep.unusable or any(rs.stale_since is not None for rs in rep.ranks) else EVENTS
        if rep.unusable:
            rep.reason = f"unusable: {rep.unusable}"
        if state != rep.state:
            rep.state = state
            log.info("kv events of %s: %s%s", rep.name, state, f" ({rep.reason})" if state == STALE else "")
            if self.on_change is not None and self.replicas.get(rep.name) is rep:
                self.on_change(rep.name, rep.table.blocks if state == EVENTS else None)
