"""The prefix index: which endpoint is believed to hold which prompt blocks.

Storage is one dict per endpoint, ``block hash -> tick`` of last use, where the tick is a logical
counter bumped per insert (no clock: the policy layer stays pure). It is used twice: over
replicas, and over peer load balancers (SkyWalker's regional snapshot).

Two properties make lookups cheap:

* Every insert stamps all blocks of a chain with the same tick, and any insert that touches block
  i+1 of a chain also touches block i; so along a chain ticks never increase.
* Eviction removes whole tick classes, oldest first (all entries with tick <= a cutoff), in
  batches of ``evict_fraction`` of capacity — an LRU at insert granularity, amortised O(1).

Together they keep each endpoint's blocks *prefix-closed* on every chain: if block i is held,
blocks 0..i-1 are too. The longest cached prefix on one endpoint is then a binary search, and a
match over all endpoints costs O(E log B) dictionary probes — within the O(blocks) bound and far
below it for long prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 1 << 18, evict_fraction: float = 0.1):
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if not 0.0 < evict_fraction < 1.0:
            raise ValueError(f"evict_fraction must be in (0, 1), got {evict_fraction}")
        self.default_capacity = capacity_blocks
        self.evict_fraction = evict_fraction
        self._tables: dict[str, dict[int, int]] = {}
        self._capacity: dict[str, int] = {}
        self._tick = 0

    # -- membership ---------------------------------------------------------------------------
    def add_endpoint(self, endpoint_id: str, capacity_blocks: int | None = None) -> None:
        self._tables.setdefault(endpoint_id, {})
        self._capacity[endpoint_id] = capacity_blocks or self.default_capacity

    def remove_endpoint(self, endpoint_id: str) -> None:
        self._tables.pop(endpoint_id, None)
        self._capacity.pop(endpoint_id, None)

    def clear(self, endpoint_id: str) -> None:
        """Forget what an endpoint holds (e.g. it restarted and lost its cache)."""
        if endpoint_id in self._tables:
            self._tables[endpoint_id] = {}

    @property
    def endpoints(self) -> list[str]:
        return list(self._tables)

    def blocks(self, endpoint_id: str) -> int:
        return len(self._tables.get(endpoint_id, ()))

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    # -- updates ------------------------------------------------------------------------------
    def insert(self, endpoint_id: str, hashes: Sequence[int]) -> None:
        """Record that ``endpoint_id`` now holds the chain ``hashes`` (most recently used)."""
        if endpoint_id not in self._tables:
            self.add_endpoint(endpoint_id)
        if not hashes:
            return
        cap = self._capacity[endpoint_id]
        if len(hashes) > cap:
            hashes = hashes[:cap]  # keep the head: it is what later requests can reuse
        self._tick += 1
        table = self._tables[endpoint_id]
        table.update(dict.fromkeys(hashes, self._tick))
        if len(table) > cap:
            self._evict(endpoint_id, table, cap)

    def _evict(self, endpoint_id: str, table: dict[int, int], cap: int) -> None:
        keep = int(cap * (1.0 - self.evict_fraction))
        n_remove = len(table) - keep
        ticks = np.fromiter(table.values(), dtype=np.int64, count=len(table))
        cutoff = int(np.partition(ticks, n_remove - 1)[n_remove - 1])
        cutoff = min(cutoff, self._tick - 1)  # never drop the chain just inserted
        self._tables[endpoint_id] = {h: t for h, t in table.items() if t > cutoff}

    # -- queries ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], endpoint_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Longest cached prefix, in blocks, per endpoint; endpoints with none are omitted."""
        if not hashes:
            return {}
        tables = self._tables
        ids = tables if endpoint_ids is None else endpoint_ids
        first, last, n = hashes[0], hashes[-1], len(hashes)
        out: dict[str, int] = {}
        for eid in ids:
            table = tables.get(eid)
            if table is None or first not in table:
                continue
            if last in table:
                out[eid] = n
                continue
            lo, hi = 1, n - 1  # invariant: hashes[lo-1] held, hashes[hi] not held
            while lo < hi:
                mid = (lo + hi) >> 1
                if hashes[mid] in table:
                    lo = mid + 1
                else:
                    hi = mid
            out[eid] = lo
        return out

    def match_one(self, endpoint_id: str, hashes: Sequence[int]) -> int:
        return self.match(hashes, (endpoint_id,)).get(endpoint_id, 0)

    def holders(self, block_hash: int) -> list[str]:
        """Endpoints believed to hold ``block_hash``."""
        return [eid for eid, t in self._tables.items() if block_hash in t]
