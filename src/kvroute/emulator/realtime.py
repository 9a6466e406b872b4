"""Drive the simulator's engine model from the asyncio clock instead of virtual time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class RealtimeLoop:
    """The two things the engine model asks of its event loop — ``now`` and ``at`` — on asyncio.

    ``slowdown`` stretches modelled time (a fault knob: the replica becomes N times slower).

    An event runs at its own model time, as in the simulator: while the callback of ``at(t, ...)``
    runs, ``now`` reads ``t`` (never less than a time already read), not the later moment the event
    loop woke up. The engine times its next step from ``now``, so a late wake-up no longer delays
    every step after it: on a loaded machine each emulated decode step otherwise ended late by the
    loop's wake-up latency, step after step (a 5.8 ms step measured as 9.6 ms at load ~7,
    tests/test_calibrate.py), and the emulated engine fell behind its own profile.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, slowdown: float = 1.0):
        self._loop = loop
        self._wall0 = time.monotonic()  # model time ``_model0`` was reached at wall time ``_wall0``
        self._model0 = 0.0
        self._slowdown = slowdown
        self._event: float | None = None  # the model time of the event whose callback runs now
        self._seen = 0.0  # the latest model time ``now`` has read: it never goes back

    @property
    def slowdown(self) -> float:
        """Wall seconds per model second."""
        return self._slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        """Change the pace from now on; model time never jumps (nor runs backwards)."""
        if value <= 0:
            raise ValueError(f"slowdown must be > 0, got {value}")
        self._model0, self._wall0 = self._wall_now(), time.monotonic()
        self._slowdown = value

    def _wall_now(self) -> float:
        """Model time by the wall clock."""
        return self._model0 + (time.monotonic() - self._wall0) / self._slowdown

    @property
    def now(self) -> float:
        """Model time: the running event's own time inside its callback, else the wall clock's;
        monotonic, and continuous across slowdown changes."""
        t = self._event if self._event is not None else self._wall_now()
        if t < self._seen:
            return self._seen
        self._seen = t
        return t

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Call ``fn(arg)`` when model time reaches ``t`` by the wall clock (at once if it has passed);
        while it runs, ``now`` reads ``t``."""
        loop = self._loop or asyncio.get_running_loop()
        delay = max(0.0, (t - self._wall_now()) * self._slowdown)
        loop.call_later(delay, self._run, t, fn, arg)

    def _run(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        self._event = t
        try:
            fn(arg)
        finally:
            self._event = None
