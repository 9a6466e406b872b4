"""The paged KV cache of a simulated engine and its prefix cache (split out of sim/engine.py,
issue 22).

Memory is counted in tokens (``used`` of ``capacity``). A prompt's full blocks become cache
blocks once computed (or, where the engine does so, as each chunk is scheduled: sim/batch.py
``store_at``), keyed by the request's chained block hashes (``refcnt``: hash → running
sequences referencing it); blocks no running sequence references stay cached and are evicted
LRU (``evictable``), tail blocks before head blocks, so the cache stays prefix-closed and a
prompt's cached prefix is the longest run of its leading hashes in ``refcnt``
(prefix/index.py ``cached_prefix``). llama-server's slot reuse (``profile.prefix_reuse ==
"idle_slots"``) restricts reuse to copies no running sequence holds (perf/profile.py).

The batch (sim/batch.py) decides who is admitted; this module answers what a prompt finds in the
cache, takes and gives back references, and frees memory by eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvroute.perf.profile import HardwareProfile
from kvroute.prefix.index import cached_prefix
from kvroute.sim.seq import Seq


class KVCache:
    """KV memory accounting and the prefix cache of one engine (see the module docstring)."""

    def __init__(self, profile: HardwareProfile):
        self.p = profile
        self.capacity = profile.kv_tokens
        self.used = 0  # KV tokens in use (private + cache blocks)
        self.refcnt: dict[int, int] = {}
        # llama-server (profile.prefix_reuse "idle_slots"): copies of each cached block that no
        # running sequence holds — in idle slots (left by finished sequences) and in the host
        # prompt cache; a new sequence reuses a prefix only by taking such a copy, so a prefix
        # that only running sequences hold must be computed again (profile.py)
        self.idle_copies: dict[int, int] | None = {} if profile.prefix_reuse == "idle_slots" else None
        self.host_copies: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cache blocks, LRU first
        self.cache_bt = 0  # tokens per cache block (the requests' block size)
        # the emulator's KV events (emulator/kv_events.py); None in the simulator: one test each
        self.on_blocks_stored: Callable[[Seq, list[int]], None] | None = None  # seq, indexes of new blocks
        self.on_blocks_removed: Callable[[list[int]], None] | None = None  # evicted block hashes

    def free_tokens(self) -> int:
        """KV tokens a migration could take now: free plus evictable cache."""
        return self.capacity - self.used + len(self.evictable) * self.cache_bt

    def _match(self, hashes: tuple[int, ...]) -> int:
        """Leading blocks of ``hashes`` a new sequence can reuse from the cache now."""
        m = cached_prefix(hashes, self.refcnt)  # the cache is prefix-closed: blocks leave tail first
        copies = self.idle_copies
        if copies is not None:  # only a copy no running sequence holds can be taken
            k, host = 0, self.host_copies
            while k < m and (copies.get(hashes[k], 0) > 0 or host.get(hashes[k], 0) > 0):
                k += 1
            m = k
        return m

    def _take(self, hashes: tuple[int, ...], m: int) -> None:
        """Reference the ``m`` leading blocks of ``hashes`` (cached, see ``_match``)."""
        copies = self.idle_copies
        refcnt, evictable = self.refcnt, self.evictable
        if copies is not None:  # take a slot's copy (its old content goes to the host
            host = self.host_copies  # cache: one more copy) or else a host copy (moved)
            for h in hashes[:m]:
                if copies.get(h, 0) > 0:
                    copies[h] -= 1
                    host[h] = host.get(h, 0) + 1
                else:
                    host[h] -= 1
        for h in hashes[:m]:
            c = refcnt[h]
            if c == 0:
                del evictable[h]
            refcnt[h] = c + 1

    def _store_prompt(self, seq: Seq) -> None:
        """``seq``'s prompt was computed: its full blocks become cache blocks."""
        self._store_blocks(seq, seq.prompt)

    def _store_blocks(self, seq: Seq, tokens: int) -> None:
        """The full blocks of ``seq``'s first ``tokens`` prompt tokens become cache blocks, hittable
        by the next lookup and counted once in ``used`` (a block computed meanwhile by another
        sequence is shared and this sequence's copy freed). Called when the whole prompt is
        computed, and, where the engine caches chunk by chunk, as each chunk is scheduled or
        computed (sim/batch.py ``store_at``)."""
        bt = seq.bt
        self.cache_bt = bt
        full = tokens // bt
        n = len(seq.hashes)
        if n < full:  # min(len(seq.hashes), tokens // bt) without the builtin call
            full = n
        if full <= seq.refs:
            return
        refcnt = self.refcnt
        evictable = self.evictable
        new = seq.hashes[seq.refs:full]
        shared = 0
        stored: list[int] | None = [] if self.on_blocks_stored is not None else None
        if stored is None:  # the simulator: the loop below without its index bookkeeping
            for h in new:
                if h in refcnt:  # computed meanwhile by another sequence: share it, free our copy
                    c = refcnt[h]
                    if c == 0:
                        del evictable[h]
                    refcnt[h] = c + 1
                    shared += 1
                else:
                    refcnt[h] = 1
        else:
            for i, h in enumerate(new):
                if h in refcnt:
                    c = refcnt[h]
                    if c == 0:
                        del evictable[h]
                    refcnt[h] = c + 1
                    shared += 1
                else:
                    refcnt[h] = 1
                    stored.append(seq.refs + i)
        if shared:
            self.used -= bt * shared
        if stored and self.on_blocks_stored is not None:
            self.on_blocks_stored(seq, stored)
        seq.private -= bt * (full - seq.refs)  # its prompt blocks (``new``) are cache blocks now
        seq.refs = full

    def _room(self, need: int, protect: tuple[int, ...] = ()) -> bool:
        """Whether ``need`` tokens could be made free by evicting cache blocks not in ``protect``
        (about to be referenced); nothing is evicted (vLLM's admission gate, sim/batch.py)."""
        free = self.capacity - self.used
        if need <= free:
            return True
        evictable = self.evictable
        guarded = sum(1 for h in protect if h in evictable) if protect else 0
        return need <= free + (len(evictable) - guarded) * self.cache_bt

    def _make_room(self, need: int, protect: tuple[int, ...] = ()) -> bool:
        """Make ``need`` tokens free, evicting LRU cache blocks (never those in ``protect``, about
        to be referenced); False, evicting nothing, when even full eviction would not do."""
        free = self.capacity - self.used
        if need <= free:
            return True
        evictable = self.evictable
        reclaimable = len(evictable) * self.cache_bt
        guarded = [h for h in protect if h in evictable] if protect else ()
        if need > free + reclaimable - len(guarded) * self.cache_bt:
            return False
        for h in guarded:  # about to be referenced: keep them out of the eviction order
            del evictable[h]
        bt = self.cache_bt
        short = need - free
        if short > 0:  # evict exactly the blocks that cover the shortfall, LRU first
            k = -(-short // bt)
            refcnt, pop = self.refcnt, evictable.popitem
            copies = self.idle_copies
            evicted: list[int] | None = [] if self.on_blocks_removed is not None else None
            if copies is None and evicted is None:  # the simulator's common case
                for _ in range(k):
                    del refcnt[pop(False)[0]]
            else:
                for _ in range(k):
                    h = pop(False)[0]
                    del refcnt[h]
                    if copies is not None:
                        copies.pop(h, None)
                        self.host_copies.pop(h, None)
                    if evicted is not None:
                        evicted.append(h)
            self.used -= k * bt
            if evicted and self.on_blocks_removed is not None:
                self.on_blocks_removed(evicted)
        for h in guarded:
            evictable[h] = None
        return True

    def _unref(self, seq: Seq) -> None:
        """Drop ``seq``'s cache references (tail first: the head stays cached longest) and its
        private KV count."""
        refs = seq.refs
        if refs:
            refcnt, evictable = self.refcnt, self.evictable
            tail_first = seq.hashes[refs - 1::-1]  # tail first: the head stays cached longest
            copies = self.idle_copies
            if copies is not None:  # its slot keeps its copy, free for the next request
                for h in tail_first:
                    copies[h] = copies.get(h, 0) + 1
            for h in tail_first:
                c = refcnt[h] - 1
                refcnt[h] = c
                if c == 0:
                    evictable[h] = None
        seq.refs = 0
        seq.private = 0
