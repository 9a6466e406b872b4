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
        self._wall0 = time.monotonic()  # model time ``_model0`` was reached at wall time ``_wall0``
        self._model0 = 0.0
        self._slowdown = slowdown

    @property
    def slowdown(self) -> float:
        """Wall seconds per model second."""
        return self._slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        """Change the pace from now on; model time never jumps (nor runs backwards)."""
        if value <= 0:
            raise ValueError(f"slowdown must be > 0, got {value}")
        self._model0, self._wall0 = self.now, time.monotonic()
        self._slowdown = value

    @property
    def now(self) -> float:
        """Model time: monotonic, continuous across slowdown changes."""
        return self._model0 + (time.monotonic() - self._wall0) / self._slowdown

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Call ``fn(arg)`` when model time reaches ``t`` (at once if it has passed)."""
        loop = self._loop or asyncio.get_running_loop()
        delay = max(0.0, (t - self.now) * self._slowdown)
        loop.call_later(delay, fn, arg)
