"""One replica's prefix cache as its KV events describe it, in kvroute's own block keys.

Engine block hashes are not portable — vLLM seeds its chain with a per-process random value unless
``PYTHONHASHSEED`` is set, and its hash algorithm is configurable — so, like llm-d's precise
prefix scorer ("dual-key design", llm-d-kv-cache ``docs/architecture.md``) and Dynamo's KV router
(``LocalBlockHash`` over token ids), the consumer computes its own key for every stored block from
the token ids the event carries, chained over the parent's own key, and keeps an
``engine hash → own key`` map to apply removals. The own key is exactly what the gateway computes
for a prompt (``prefix.blocks.hash_token_ids``: ``xxh3_64(uint32 token bytes, seed=previous)``),
so a request's block hashes are looked up in the table directly. That requires the gateway's
``block_tokens`` to equal the engine's block size and the gateway to see the engine's token ids
(``kvevents.tokenize``); an event of another block size is refused (``BlockSizeMismatch``).

``ReplicaTable.blocks`` (own key → number of engine blocks holding it, 0 for a speculative entry)
is the dict the prefix index reads for the replica while its events are trusted. Each data-parallel
rank publishes on its own stream and gets its own ``EventIndex`` over the replica's one table, so a
rank's restart or gap clears only that rank's share. Speculative entries (llm-d's
``speculativeIndexing``, TTL 2 s) cover the time between routing a prompt and the engine's
``BlockStored`` for it: without them a burst sharing a new prefix would scatter.

Pure: no I/O, no clock (times come in as arguments).

Blocks deliberately left out (counted as ``ignored``): other media than the GPU tier (offloaded
copies are not where a request's prefill reads from), LoRA blocks and blocks with extra keys
(multimodal ids, cache salt: the gateway's prompt keys do not include them, so they could only
produce false hits), and KV-cache groups other than 0 / none (hybrid models publish one stream
per group over shared hashes; llm-d treats hybrid attention as work in progress too).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import xxhash

from kvroute.errors import ServiceError
from kvroute.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

_xxh3 = xxhash.xxh3_64_intdigest
GPU_MEDIA = (None, "GPU", "gpu")


class BlockSizeMismatch(ServiceError, ValueError):
    """The engine's blocks are not the gateway's: its events cannot key the gateway's prompts."""


class TokenError(ServiceError, ValueError):
    """A BlockStored whose token ids do not fill its blocks or are not 32-bit token ids."""


class ReplicaTable:
    """The replica's exact-cache table (``blocks``) and its speculative entries."""

    __slots__ = ("blocks", "_spec", "ttl_s")

    def __init__(self, speculative_ttl_s: float = 2.0):
        self.blocks: dict[int, int] = {}  # own key -> engine blocks holding it (0: speculative only)
        self._spec: dict[int, float] = {}  # own key -> expiry, in insertion (so expiry) order
        self.ttl_s = speculative_ttl_s

    def speculate(self, keys: Iterable[int], now: float) -> None:
        """A prompt with these block keys was just routed here: count them as held until ``now +
        ttl`` unless events confirm them first (confirmed blocks need no entry)."""
        if self.ttl_s <= 0:
            return
        blocks, spec, until = self.blocks, self._spec, now + self.ttl_s
        for k in keys:
            if blocks.get(k):  # held already (by events)
                continue
            blocks[k] = 0
            spec.pop(k, None)  # re-insert at the end: the dict stays in expiry order
            spec[k] = until

    def expire(self, now: float) -> int:
        """Drop speculative entries past their time that no event confirmed; returns how many."""
        spec, blocks = self._spec, self.blocks
        dropped = 0
        while spec:
            k = next(iter(spec))
            if spec[k] > now:
                break
            del spec[k]
            if blocks.get(k) == 0:
                del blocks[k]
                dropped += 1
        return dropped

    def clear(self) -> None:
        """Forget everything (every rank's share and every speculation)."""
        self.blocks.clear()
        self._spec.clear()

    def _ref(self, key: int) -> None:
        self.blocks[key] = self.blocks.get(key, 0) + 1
        self._spec.pop(key, None)

    def _unref(self, key: int) -> None:
        c = self.blocks.get(key, 0) - 1
        if c > 0:
            self.blocks[key] = c
        elif key in self._spec:
            self.blocks[key] = 0
        else:
            self.blocks.pop(key, None)


class EventIndex:
    """Applies one event stream (one data-parallel rank of a replica) to the replica's table.

    Counters (cumulative): ``stored`` and ``removed`` engine blocks applied, ``cleared`` events,
    ``ignored`` blocks outside what the gateway keys (see the module docstring),
    ``unknown_parent`` stored blocks whose parent this index never saw (a missed event: the
    chain cannot be keyed), ``unknown_removed`` removals of blocks it does not hold."""

    def __init__(self, table: ReplicaTable, block_tokens: int):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.table = table
        self.block_tokens = block_tokens
        self.own: dict[int, int] = {}  # engine hash -> own key
        self.stored = self.removed = self.cleared = 0
        self.ignored = self.unknown_parent = self.unknown_removed = 0

    def __len__(self) -> int:
        return len(self.own)

    def apply(self, event: Event) -> None:
        """Apply one decoded event; raises BlockSizeMismatch or TokenError for a BlockStored this
        index cannot key (nothing of that event is applied)."""
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear()
            self.cleared += 1

    def clear(self) -> None:
        """Drop this stream's share of the table (the engine restarted, cleared, or the view was
        lost); other ranks' blocks stay."""
        unref = self.table._unref
        for key in self.own.values():
            unref(key)
        self.own.clear()

    def _stored(self, ev: BlockStored) -> None:
        n = len(ev.hashes)
        if (ev.medium not in GPU_MEDIA or ev.lora_name or ev.group_idx not in (None, 0)
                or (ev.extra_keys and any(k is not None for k in ev.extra_keys))):
            self.ignored += n
            return
        bs = ev.block_size
        if bs != self.block_tokens:
            raise BlockSizeMismatch(f"engine blocks of {bs} tokens, gateway block_tokens {self.block_tokens}")
        tokens = ev.token_ids
        if len(tokens) != n * bs:
            raise TokenError(f"BlockStored with {n} blocks of {bs} carries {len(tokens)} token ids")
        if ev.parent is None:
            seed = 0
        else:
            seed = self.own.get(ev.parent, -1)
            if seed < 0:
                self.unknown_parent += n
                return
        try:
            data = array("I", tokens).tobytes()
        except OverflowError:
            raise TokenError("token id outside 0..2^32-1") from None
        width = bs * 4
        own, ref = self.own, self.table._ref
        for i, h in enumerate(ev.hashes):
            seed = _xxh3(data[i * width:(i + 1) * width], seed)
            old = own.get(h)
            if old == seed:
                continue  # stored again (e.g. replayed): already counted
            if old is not None:
                self.table._unref(old)
            own[h] = seed
            ref(seed)
            self.stored += 1

    def _removed(self, ev: BlockRemoved) -> None:
        if ev.medium not in GPU_MEDIA or ev.group_idx not in (None, 0):
            self.ignored += len(ev.hashes)
            return
        own, unref = self.own, self.table._unref
        for h in ev.hashes:
            key = own.pop(h, None)
            if key is None:
                self.unknown_removed += 1
            else:
                unref(key)
                self.removed += 1
