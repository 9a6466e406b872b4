"""Consistent-hash ring with virtual nodes (SkyWalker-CH, SGLang consistent_hashing/prefix_hash).

Each endpoint owns ``vnodes`` points at ``xxh64(f"{endpoint}{i}", seed=0)`` (SkyWalker's scheme),
so an endpoint's points do not depend on who else is on the ring and a join or leave remaps only
the keys whose nearest point changed owner (about 1/N of them). Lookup is a clockwise search
that skips endpoints the caller's filter removed.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Container, Iterable, Iterator

import xxhash

DEFAULT_VNODES = 1024


def ring_hash(key: str | bytes | int) -> int:
    """64-bit xxh64 of a ring key (ints as 8 little-endian bytes, strings as UTF-8)."""
    if isinstance(key, int):
        key = key.to_bytes(8, "little", signed=False)
    elif isinstance(key, str):
        key = key.encode("utf-8", "surrogatepass")
    return xxhash.xxh64_intdigest(key, 0)


class HashRing:
    """Consistent-hash ring with ``vnodes`` points per endpoint; lookups walk clockwise."""

    def __init__(self, endpoint_ids: Iterable[str] = (), vnodes: int = DEFAULT_VNODES):
        if vnodes <= 0:
            raise ValueError(f"vnodes must be positive, got {vnodes}")
        self.vnodes = vnodes
        self._members: set[str] = set()
        self._pairs: list[tuple[int, str]] = []
        self._points: list[int] = []
        self._owners: list[str] = []
        self.add_many(endpoint_ids)

    def _publish(self) -> None:
        self._points = [p for p, _ in self._pairs]
        self._owners = [o for _, o in self._pairs]

    def add_many(self, endpoint_ids: Iterable[str]) -> None:
        """Add endpoints (ones already present are ignored) in one merge of the sorted points."""
        new = [eid for eid in dict.fromkeys(endpoint_ids) if eid not in self._members]
        if not new:
            return
        self._members.update(new)
        fresh = sorted((ring_hash(f"{eid}{i}"), eid) for eid in new for i in range(self.vnodes))
        self._pairs = list(heapq.merge(self._pairs, fresh))
        self._publish()

    def add(self, endpoint_id: str) -> None:
        """Add one endpoint; only about 1/N of keys move to it."""
        self.add_many((endpoint_id,))

    def remove(self, endpoint_id: str) -> None:
        """Remove an endpoint; only its keys move (to their clockwise successors)."""
        if endpoint_id in self._members:
            self._members.discard(endpoint_id)
            self._pairs = [pair for pair in self._pairs if pair[1] != endpoint_id]
            self._publish()

    def __contains__(self, endpoint_id: object) -> bool:
        return endpoint_id in self._members

    def __len__(self) -> int:
        return len(self._members)

    @property
    def points(self) -> int:
        """Number of points on the ring (members × vnodes)."""
        return len(self._points)

    def lookup(self, key: str | bytes | int, allowed: Container[str] | None = None) -> str | None:
        """Owner of the first point clockwise from ``hash(key)`` that ``allowed`` admits."""
        n = len(self._points)
        if not n:
            return None
        i = bisect_right(self._points, ring_hash(key))
        owners = self._owners
        if allowed is None:
            return owners[i % n]
        rejected: set[str] = set()
        for step in range(n):
            owner = owners[(i + step) % n]
            if owner in allowed:
                return owner
            if owner not in rejected:
                rejected.add(owner)
                if len(rejected) == len(self._members):
                    return None
        return None

    def successors(self, key: str | bytes | int) -> Iterator[str]:
        """Distinct owners clockwise from ``hash(key)``: the order bounded-load hashing walks."""
        n = len(self._points)
        if not n:
            return
        i = bisect_right(self._points, ring_hash(key))
        seen: set[str] = set()
        for step in range(n):
            owner = self._owners[(i + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return
