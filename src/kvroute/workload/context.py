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
    """A prompt as the router sees it, built up segment by segment: chained block hashes of its full blocks,
    its token count, and the pieces of the unfinished last block (so two prompts that share a prefix share
    hashes)."""

    __slots__ = ("hashes", "tokens", "tail", "bt")

    def __init__(self, bt: int, hashes: tuple[int, ...] = (), tokens: int = 0,
                 tail: tuple[tuple[int, int, int], ...] = ()):
        self.bt = bt
        self.hashes = hashes
        self.tokens = tokens
        self.tail = tail  # pieces (segment id, start, length) of the unfinished last block

    def extend(self, segment: int, n: int) -> Context:
        """A new context: this one followed by ``n`` tokens of ``segment``."""
        if n <= 0:
            return self
        bt = self.bt
        new: list[int] = []
        last = self.hashes[-1] if self.hashes else 0
        tail = self.tail
        start = 0
        filled = self.tokens - len(self.hashes) * bt
        if filled:  # complete the unfinished block first: several pieces
            take = min(n, bt - filled)
            tail = (*tail, (segment, 0, take))
            start = take
            if filled + take == bt:
                last = _xxh(array("q", [x for piece in tail for x in piece]).tobytes(), last)
                new.append(last)
                tail = ()
        pack = _one.pack
        while n - start >= bt:  # whole blocks of this segment: one piece each
            last = _xxh(pack(segment, start, bt), last)
            new.append(last)
            start += bt
        if start < n:
            tail = (*tail, (segment, start, n - start))
        hashes = self.hashes + tuple(new) if new else self.hashes
        return Context(bt, hashes, self.tokens + n, tail)
