"""A minimal discrete-event loop: a heap of (time, sequence, callback, argument)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any, Protocol


class Scheduler(Protocol):
    """What the engine model asks of its loop: the time, and running a callback later. The
    simulator's :class:`EventLoop` and the emulator's real-time loop both provide it."""

    @property
    def now(self) -> float:
        """Current time in seconds."""

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at time ``t``."""


class EventLoop:
    """The simulator's discrete-event loop: a heap of (time, sequence, callback, argument)."""
    __slots__ = ("now", "_heap", "_seq", "events")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        # tie-breaker: events at one time run in scheduling order (the counter's bound
        # ``__next__``: ``at`` runs about ten times per simulated request)
        self._seq = itertools.count(1).__next__
        self.events = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at time ``t`` (never before now); ties run in scheduling order."""
        now = self.now
        heappush(self._heap, (t if t > now else now, self._seq(), fn, arg))

    def run(self, until: float = float("inf"), stop: Callable[[], bool] | None = None) -> None:
        """Run events in time order up to ``until``, or until ``stop()`` returns true."""
        heap, pop = self._heap, heappop
        n = 0
        try:
            if stop is None:  # the simulator's case: no per-event check
                while heap and heap[0][0] <= until:
                    t, _, fn, arg = pop(heap)
                    self.now = t
                    n += 1
                    fn(arg)
            else:
                while heap:
                    if heap[0][0] > until:
                        break
                    t, _, fn, arg = pop(heap)
                    self.now = t
                    n += 1
                    fn(arg)
                    if stop():
                        break
        finally:
            self.events += n

    def __len__(self) -> int:
        return len(self._heap)
