"""Synthetic prompt contexts with chained block hashes and no text.

A context is a sequence of segments (id, tokens). Block i's hash chains over the segment pieces
that cover tokens [i·bt, (i+1)·bt), so two contexts share exactly the block hashes of their
common prefix — like real prompts hashed by kvroute or vLLM — at a cost proportional to the new
blocks only when a context is extended.
"""

from __future__ import annotations

import struct
from array import array

import xxhash

_xxh = xxhash.xxh3_64_intdigest
_one = struct.Struct("<qqq")  # the common block: one piece of one segment


class Context:
    __slots__ = ("hashes", "tokens", "tail", "bt")

    def __init__(self, bt: int, hashes: tuple[int, ...] = (), tokens: int = 0,
                 tail: tuple[tuple[int, int, int], ...] = ()):
        self.bt = bt
        self.hashes = hashes
        self.tokens = tokens
        self.tail = tail  # pieces (segment id, start, length) of the unfinished last block

    def extend(self, segment: int, n: int) -> "Context":
        """A new context: this one followed by ``n`` tokens of ``segment``."""
        if n <= 0:
            return self
        bt = self.bt
        new: list[int] = []
        last = self.hashes[-1] if self.hashes else 0
        tail = list(self.tail)
        filled = self.tokens - len(self.hashes) * bt
        start = 0
        while start < n:
            take = min(n - start, bt - filled)
            tail.append((segment, start, take))
            filled += take
            start += take
            if filled == bt:
                data = (_one.pack(*tail[0]) if len(tail) == 1
                        else array("q", [x for piece in tail for x in piece]).tobytes())
                last = _xxh(data, last)
                new.append(last)
                tail, filled = [], 0
        hashes = self.hashes + tuple(new) if new else self.hashes
        return Context(bt, hashes, self.tokens + n, tuple(tail))
