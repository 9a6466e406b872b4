"""Decentralised bid-ask load balancing within a stage, CascadeInfer §4.4.

* **Trigger.** An instance is an overloaded outlier when its memory demand (KV tokens of its
  sequences) is more than 25 % above its stage's average; a hand-over to the next stage runs the
  same protocol.
* **Ask.** The sender tells every candidate receiver about one request, piggybacking its load
  (total length of the requests it has buffered for migration).
* **Bid.** Each receiver replies with its load and its earliest start: the tokens it has
  buffered to receive divided by its measured throughput.
* **Choose.** The sender drops the more loaded half of the bidders, keeps the three with the
  earliest start, and takes the one whose reply came first.
* **Receive.** A receiver queues the requests it won by the sender's load (highest first) and
  starts the first whose sender is not busy transmitting; a request skipped more than a
  threshold number of times is starving: the receiver then waits for that one only.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

OVERLOAD = 0.25  # §4.4: memory demand 25 % above the stage average
KEEP_EARLIEST = 3  # §4.4: the sender keeps the three earliest starts
STARVATION = 3  # skipped attempts before a request starves (choice: the paper names no number)


def overloaded(demand: float, stage_demands: Sequence[float], threshold: float = OVERLOAD) -> bool:
    """Whether ``demand`` is more than ``threshold`` above the stage's mean demand."""
    if not stage_demands:
        return False
    mean = sum(stage_demands) / len(stage_demands)
    return demand > (1 + threshold) * mean


def earliest_start(buffered_tokens: float, throughput_tok_s: float) -> float:
    """A receiver's earliest transmission start: buffered tokens over measured throughput."""
    return buffered_tokens / throughput_tok_s if throughput_tok_s > 0 else float("inf")


@dataclass(frozen=True)
class Bid:
    """One receiver's reply: its load, earliest start and when the reply reached the sender."""

    receiver: str
    load: float
    earliest_start: float
    reply_at: float


def choose(bids: Sequence[Bid], keep: int = KEEP_EARLIEST) -> Bid | None:
    """The sender's pick: drop the more loaded half, keep ``keep`` earliest starts, first reply."""
    if not bids:
        return None
    by_load = sorted(bids, key=lambda b: (b.load, b.receiver))
    light = by_load[:(len(by_load) + 1) // 2]
    early = sorted(light, key=lambda b: (b.earliest_start, b.receiver))[:keep]
    return min(early, key=lambda b: (b.reply_at, b.receiver))


def shed(demand: float, mean: float, lengths: Sequence[tuple[str, float]]) -> list[str]:
    """Requests an overloaded sender asks about: newest first (*choice*: the least progressed,
    as Llumnix prefers) until what remains is at the stage mean; ``lengths`` in admission order."""
    out, excess = [], demand - mean
    for rid, length in reversed(lengths):
        if excess <= 0:
            break
        out.append(rid)
        excess -= length
    return out


@dataclass(order=True)
class _Entry:
    key: tuple[float, int]
    rid: str = field(compare=False)
    sender: str = field(compare=False)
    failures: int = field(default=0, compare=False)


class ReceiverQueue:
    """The requests a receiver won, highest sender load first (FIFO among equal loads)."""

    def __init__(self, starvation: int = STARVATION):
        self.starvation = starvation
        self._heap: list[_Entry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, rid: str, sender: str, sender_load: float) -> None:
        """Queue request ``rid`` from ``sender``, whose load was ``sender_load`` when it asked."""
        heapq.heappush(self._heap, _Entry((-sender_load, next(self._seq)), rid, sender))

    def starving(self) -> tuple[str, str] | None:
        """(rid, sender) of the request the receiver is waiting for, if one starves."""
        for e in sorted(self._heap):
            if e.failures > self.starvation:
                return e.rid, e.sender
        return None

    def next(self, sender_busy: Callable[[str], bool]) -> tuple[str, str] | None:
        """Dequeue the highest-priority request whose sender is free, as (rid, sender).

        Requests passed over because their sender is transmitting count a failed attempt; once
        one has failed more than ``starvation`` times the receiver takes nothing else.
        """
        starving = self.starving()
        if starving is not None:
            if sender_busy(starving[1]):
                return None
            self._remove(starving[0])
            return starving
        for e in sorted(self._heap):
            if sender_busy(e.sender):
                e.failures += 1
                continue
            self._remove(e.rid)
            return e.rid, e.sender
        return None

    def drop(self, rid: str) -> bool:
        """Forget ``rid`` (it finished or left its sender meanwhile); whether it was queued."""
        return self._remove(rid)

    def _remove(self, rid: str) -> bool:
        for i, e in enumerate(self._heap):
            if e.rid == rid:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False
