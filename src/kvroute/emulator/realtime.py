"""Drive the simulator's engine model from the asyncio clock instead of virtual time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class RealtimeLoop:
    """The two things the engine model asks of its event loop — ``now`` and ``at`` — on asyncio.

    ``slowdown`` stretches modelled time (a fault knob: the replica becomes N times slower).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, slowdown: float = 1.0):
        self._loop = loop
        self._t0 = time.monotonic()
        self.slowdown = slowdown

    @property
    def now(self) -> float:
        return (time.monotonic() - self._t0) / self.slowdown

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        loop = self._loop or asyncio.get_running_loop()
        delay = max(0.0, (t - self.now) * self.slowdown)
        loop.call_later(delay, fn, arg)
