"""The emulator's KV-cache events: what its simulated cache stores and evicts, published as vLLM
publishes it (``kvevents.publisher``), in either payload generation.

The engine model caches a prompt's blocks when its prefill completes and evicts LRU, tail first
(``sim/engine.py``); its ``on_blocks_stored`` / ``on_blocks_removed`` hooks become ``BlockStored``
/ ``BlockRemoved`` events, coalesced into one batch per event-loop turn (vLLM: one per engine
step). ``POST /_restart`` restarts the sequence and the replay buffer, as a new engine process
does.

Token ids: the emulator has no tokenizer. A text prompt's key (kvroute's canonical rendering) is
split into 4-byte words read as uint32 ids, so a block of ``block_tokens`` ids is exactly the
``block_tokens × 4`` bytes that kvroute's tokenizer-less gateway hashes as one block: the
consumer's own keys then equal the gateway's prompt hashes, as with a real engine whose
tokenizer the gateway shares. A token-id prompt publishes its ids as they are.

Engine hashes: like vLLM's they are not kvroute's keys: SHA-256 over the block's own hash,
published as the digest's last 8 bytes (vLLM's default integer form) or the 32 digest bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), so the consumer has to key blocks from their tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.sim.engine import Engine, Seq

if TYPE_CHECKING:  # pyzmq and msgspec are the optional 'events' extra: imported when events are on
    from kvroute.kvevents.publisher import EventPublisher


@dataclass(frozen=True)
class KVEventsOptions:
    """``kvroute emulate --kv-events ...``: where to publish and in which form."""

    endpoint: str  # e.g. tcp://*:5557 (binds, as vLLM does with a *)
    replay_endpoint: str | None = None  # e.g. tcp://*:5558
    topic: str = ""
    generation: str = "map"  # map (vLLM ≥ 0.26) or array (legacy)
    hash_bytes: bool = False  # 32-byte digests instead of vLLM's default 64-bit ints
    buffer_steps: int = 10_000

    def publisher(self) -> EventPublisher:
        """A publisher on these endpoints (to be started on the running loop)."""
        from kvroute.replicas import events_extra_installed

        events_extra_installed()  # a ValueError naming the extra rather than an ImportError
        from kvroute.kvevents.publisher import EventPublisher

        return EventPublisher(self.endpoint, self.replay_endpoint, self.topic, self.generation,
                              buffer_steps=self.buffer_steps)


def pseudo_token_ids(key: str | list[int]) -> list[int]:
    """The ids the emulator publishes for a prompt key (module docstring)."""
    if isinstance(key, list):
        return key
    data = key.encode("utf-8", "surrogatepass")
    return array("I", data[: len(data) - len(data) % 4]).tolist()


class EmulatorEvents:
    """Hooks an emulator's engine to a publisher; ``tokens`` maps a running sequence's id to the
    token ids of its prompt (set before submit, dropped when it ends)."""

    def __init__(self, publisher: EventPublisher, block_tokens: int, hash_bytes: bool = False):
        self.publisher = publisher
        self.block_tokens = block_tokens
        self.hash_bytes = hash_bytes
        self.tokens: dict[str, list[int]] = {}
        self.evicted = 0  # blocks evicted since start (restarts included)
        self._pending: list[Any] = []
        self._flush_scheduled = False

    def attach(self, engine: Engine) -> None:
        """Publish ``engine``'s cache changes from now on."""
        engine.on_blocks_stored = self._stored
        engine.on_blocks_removed = self._removed

    def restart(self, engine: Engine) -> None:
        """A new engine process: sequence from 0, empty buffer, the new engine hooked."""
        self._pending.clear()
        self.tokens.clear()
        self.publisher.restart()
        self.attach(engine)

    def cleared(self) -> None:
        """The whole cache was dropped."""
        self._queue(self.publisher.encoder.cleared())

    def engine_hash(self, h: int) -> int | bytes:
        """The engine's hash for a block whose own chained hash is ``h``."""
        digest = hashlib.sha256(h.to_bytes(8, "little")).digest()
        return digest if self.hash_bytes else int.from_bytes(digest[-8:], "big")

    def _stored(self, seq: Seq, indexes: list[int]) -> None:
        ids = self.tokens.get(seq.rid)
        if ids is None:
            return
        bt, enc = self.block_tokens, self.publisher.encoder
        run: list[int] = []
        for i in indexes:  # one event per run of consecutive blocks, chained to the block before it
            if run and i != run[-1] + 1:
                self._queue(self._event(enc, seq, run, ids, bt))
                run = []
            run.append(i)
        if run:
            self._queue(self._event(enc, seq, run, ids, bt))

    def _event(self, enc: Any, seq: Seq, run: list[int], ids: list[int], bt: int) -> Any:
        first = run[0]
        parent = self.engine_hash(seq.hashes[first - 1]) if first > 0 else None
        return enc.stored([self.engine_hash(seq.hashes[i]) for i in run], parent,
                          ids[first * bt:(run[-1] + 1) * bt], bt)

    def _removed(self, hashes: list[int]) -> None:
        self.evicted += len(hashes)
        self._queue(self.publisher.encoder.removed([self.engine_hash(h) for h in hashes]))

    def _queue(self, event: Any) -> None:
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        events, self._pending = self._pending, []
        self.publisher.publish(events)
