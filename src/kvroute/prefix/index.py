"""The prefix index: which endpoint is believed to hold which prompt blocks.

Storage is one dict per endpoint, ``block hash -> tick`` of last use, where the tick is a logical
counter bumped per insert (no clock: the policy layer stays pure), plus a FIFO log of inserts
``(tick, hashes)``. It is used twice: over replicas, and over peer load balancers (SkyWalker's
regional snapshot).

Eviction pops the oldest log record and deletes those of its blocks whose tick is still the
record's (blocks touched again since carry a newer tick and stay). That is exact LRU at insert
granularity, amortised O(1) per inserted block and free of pauses. The log is also trimmed when
it holds more than twice the capacity in blocks, so refreshing hot blocks cannot grow it.

Two properties make lookups cheap:

* An insert stamps all blocks of a chain with one tick, and any insert that touches block i+1 of
  a chain also touches block i; so along a chain ticks never increase.
* Eviction removes blocks in tick order, whole ticks at a time.

Together they keep each endpoint's blocks *prefix-closed* on every chain: if block i is held,
blocks 0..i-1 are too. The longest cached prefix on one endpoint is then a binary search, and a
match over all endpoints costs O(E log B) dictionary probes — within the O(blocks) bound and far
below it for long prompts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Sequence

from kvroute.native import mypyc_attr


def cached_prefix(hashes: Sequence[int], table: Container[int]) -> int:
    """Leading blocks of the chain ``hashes`` present in ``table``, which must be prefix-closed
    on every chain (true of this index and of the simulated engines' caches): a binary search."""
    n = len(hashes)
    if not n or hashes[0] not in table:
        return 0
    if hashes[-1] in table:
        return n
    return _bisect(hashes, table, 1, n - 1)


def _bisect(hashes: Sequence[int], table: Container[int], lo: int, hi: int) -> int:
    """First index in [lo, hi] not in ``table``, given hashes[lo-1] held and hashes[hi] not."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if hashes[mid] in table:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Table:
    __slots__ = ("blocks", "log", "logged", "capacity")

    def __init__(self, capacity: int):
        self.blocks: dict[int, int] = {}
        self.log: deque[tuple[int, Sequence[int]]] = deque()
        self.logged = 0  # blocks referenced by the log
        self.capacity = capacity


DEFAULT_MAX_BLOCKS = 256  # llm-d's prefix-cache scorer: maxPrefixBlocksToMatch 256 (64-token blocks)


@mypyc_attr(allow_interpreted_subclasses=True)  # tests count its lookups by a subclass (compiled build)
class PrefixIndex:
    """``max_blocks`` bounds how many leading blocks of a prompt are indexed and matched (0: all):
    routing needs the head of a prompt, and the bound caps per-request work for very long ones."""

    def __init__(self, capacity_blocks: int = 1 << 18, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be ≥ 0 (0: no bound), got {max_blocks}")
        self.max_blocks = max_blocks
        self.default_capacity = capacity_blocks
        self._tables: dict[str, _Table] = {}
        self._blocks: dict[str, dict[int, int]] = {}  # endpoint -> the table match reads (hot path)
        self._external: dict[str, dict[int, int]] = {}  # endpoint -> an exact table kept by its owner
        self._tick = 0

    # -- membership ---------------------------------------------------------------------------
    def add_endpoint(self, endpoint_id: str, capacity_blocks: int | None = None) -> None:
        """Start tracking an endpoint, or change its capacity in blocks (None: the index default)."""
        cap = capacity_blocks or self.default_capacity
        table = self._tables.get(endpoint_id)
        if table is None:
            table = self._tables[endpoint_id] = _Table(cap)
            self._blocks[endpoint_id] = self._external.get(endpoint_id, table.blocks)
        table.capacity = cap

    def use_table(self, endpoint_id: str, table: dict[int, int] | None) -> None:
        """Match ``endpoint_id`` against ``table`` — block hash → anything, kept exact by its
        owner (the engine's KV events, ``kvroute.kvevents``) — instead of this index's own LRU
        estimate; None switches back. Inserts keep feeding the estimate either way, so it is warm
        when the exact table is lost. ``clear`` leaves an attached table alone."""
        if table is None:
            self._external.pop(endpoint_id, None)
        else:
            self._external[endpoint_id] = table
        own = self._tables.get(endpoint_id)
        if own is not None:
            self._blocks[endpoint_id] = own.blocks if table is None else table

    def remove_endpoint(self, endpoint_id: str) -> None:
        """Stop tracking an endpoint and drop everything it held."""
        self._tables.pop(endpoint_id, None)
        self._blocks.pop(endpoint_id, None)
        self._external.pop(endpoint_id, None)

    def clear(self, endpoint_id: str) -> None:
        """Forget what an endpoint holds (e.g. it restarted and lost its cache)."""
        if endpoint_id in self._tables:
            cap = self._tables[endpoint_id].capacity
            external = self._external.get(endpoint_id)
            self.remove_endpoint(endpoint_id)
            if external is not None:
                self._external[endpoint_id] = external
            self.add_endpoint(endpoint_id, cap)

    @property
    def endpoints(self) -> list[str]:
        """Ids of the tracked endpoints."""
        return list(self._tables)

    def blocks(self, endpoint_id: str) -> int:
        """Number of blocks the index believes the endpoint holds."""
        return len(self._blocks.get(endpoint_id, ()))

    def capacity(self, endpoint_id: str) -> int:
        """The endpoint's capacity in blocks (older inserts are evicted beyond it)."""
        return self._tables[endpoint_id].capacity

    def __len__(self) -> int:
        return sum(len(b) for b in self._blocks.values())

    # -- updates ------------------------------------------------------------------------------
    def insert(self, endpoint_id: str, hashes: Sequence[int]) -> int:
        """Record that ``endpoint_id`` now holds the chain ``hashes`` (most recently used).
        Returns the insert's tick (0 for an empty chain), which ``forget`` takes."""
        table = self._tables.get(endpoint_id)
        if table is None:
            self.add_endpoint(endpoint_id)
            table = self._tables[endpoint_id]
        if not hashes:
            return 0
        cap = table.capacity
        limit = self.max_blocks
        if not limit or limit > cap:
            limit = cap
        if len(hashes) > limit:
            hashes = hashes[:limit]  # keep the head: it is what others reuse
        self._tick = tick = self._tick + 1
        blocks = table.blocks
        for h in hashes:  # no temporary dict (dict.fromkeys + update costs more)
            blocks[h] = tick
        log = table.log
        log.append((tick, hashes))
        logged = table.logged + len(hashes)
        if len(blocks) > cap or logged > 2 * cap:  # over capacity: evict (attributes read once, in locals)
            get = blocks.get
            while len(blocks) > cap or logged > 2 * cap:
                old_tick, old = log.popleft()
                logged -= len(old)
                if old_tick == tick:  # only the chain just inserted is left
                    log.appendleft((old_tick, old))
                    logged += len(old)
                    break
                # drop the record's blocks whose tick is still its own (a plain loop: fewer
                # instructions than compress/map/deque for the few blocks of one record)
                for h in old:
                    if get(h) == old_tick:
                        del blocks[h]
        table.logged = logged
        return tick

    def forget(self, endpoint_id: str, hashes: Sequence[int], start: int, tick: int) -> None:
        """Undo insert ``tick`` for the blocks it added (``hashes[start:]``, those that were not
        cached before), where no later insert has stamped them since. The blocks before
        ``start`` stay: they were cached already. Removing a chain's tail keeps every chain
        prefix-closed, since any later chain through these blocks would have re-stamped them."""
        table = self._tables.get(endpoint_id)
        if table is None:
            return
        blocks = table.blocks
        limit = min(table.capacity, self.max_blocks or table.capacity)
        for h in hashes[start:limit]:
            if blocks.get(h) == tick:
                del blocks[h]

    # -- queries ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], endpoint_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Longest cached prefix, in blocks, per endpoint; endpoints with none are omitted.

        Without ``endpoint_ids`` every endpoint is matched: callers read only their candidates,
        and scanning all tables avoids building an id list on the hot path.
        """
        if not hashes:
            return {}
        if self.max_blocks and len(hashes) > self.max_blocks:
            hashes = hashes[: self.max_blocks]
        first, last, n = hashes[0], hashes[-1], len(hashes)
        tables: Iterable[tuple[str, dict[int, int]]]
        if endpoint_ids is None:
            tables = self._blocks.items()
        else:
            tables = [(eid, self._blocks[eid]) for eid in endpoint_ids if eid in self._blocks]
        out: dict[str, int] = {}
        guess = 0  # endpoints sharing a system prompt usually match equally: try the last answer
        for eid, table in tables:
            if first not in table:
                continue
            if last in table:
                out[eid] = n
                continue
            # invariant: hashes[lo-1] held, hashes[hi] not held
            if 0 < guess < n:
                if hashes[guess - 1] in table:
                    if hashes[guess] not in table:
                        out[eid] = guess
                        continue
                    lo, hi = guess + 1, n - 1
                else:
                    lo, hi = 1, guess - 1
            else:
                lo, hi = 1, n - 1
            out[eid] = guess = _bisect(hashes, table, lo, hi)
        return out

    def match_one(self, endpoint_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of hashes cached on one endpoint (the same bound as match)."""
        table = self._blocks.get(endpoint_id)
        if table is None:
            return 0
        return cached_prefix(hashes[: self.max_blocks] if self.max_blocks else hashes, table)

    def holders(self, block_hash: int) -> list[str]:
        """Endpoints believed to hold ``block_hash``."""
        return [eid for eid, t in self._blocks.items() if block_hash in t]
