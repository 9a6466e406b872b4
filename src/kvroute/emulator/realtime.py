"""Drive the simulator's engine model from the asyncio clock instead of virtual time."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

LATENESS_KEPT = 4096  # the most recent timer wake-ups whose lateness Timers.summary's quantiles use


class RealtimeLoop:
    """The two things the engine model asks of its event loop — ``now`` and ``at`` — on asyncio.

    ``slowdown`` stretches modelled time (a fault knob: the replica becomes N times slower).

    An event runs at its own model time, as in the simulator: while the callback of ``at(t, ...)``
    runs, ``now`` reads ``t`` (never less than a time already read), not the later moment the event
    loop woke up. The engine times its next step from ``now``, so a late wake-up no longer delays
    every step after it: on a loaded machine each emulated decode step otherwise ended late by the
    loop's wake-up latency, step after step (a 5.8 ms step measured as 9.6 ms at load ~7,
    tests/test_calibrate.py), and the emulated engine fell behind its own profile.

    What is left of a late wake-up is what a client sees: the token of that step leaves late. So
    every callback's lateness (wall clock at its run minus the wall time it was due) is recorded in
    :attr:`timers`, and each request's first token's in :attr:`first_tokens` (:meth:`first_token`:
    the wall time from taking the request to its first token, less the model's time to first
    token, so the emulator's own work on the request counts too). The emulator reports both
    (``GET /_timers``), so that a test timing it on a loaded machine can tell the emulator's
    lateness from an error of its own.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, slowdown: float = 1.0):
        self._loop = loop
        self._wall0 = time.monotonic()  # model time ``_model0`` was reached at wall time ``_wall0``
        self._model0 = 0.0
        self._slowdown = slowdown
        self._event: float | None = None  # the model time of the event whose callback runs now
        self._seen = 0.0  # the latest model time ``now`` has read: it never goes back
        self.timers = Timers()  # every timer callback's wake-up
        self.first_tokens = Timers()  # every request's first token (first_token)

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
        loop.call_later(delay, self._run, t, fn, arg, time.monotonic() + delay)

    def first_token(self, mark: tuple[float, float] | None, t: float) -> None:
        """A request's first token is ready at model time ``t``; ``mark`` is (the wall clock when the
        emulator took the request, the model time it was submitted to the engine at). Records how
        much later than the model says it is ready (nothing when ``mark`` is None)."""
        if mark is not None:
            entered, submitted = mark
            self.first_tokens.record(time.monotonic() - entered - (t - submitted) * self._slowdown)

    def _run(self, t: float, fn: Callable[[Any], None], arg: Any, due: float) -> None:
        self.timers.record(time.monotonic() - due)
        self._event = t
        try:
            fn(arg)
        finally:
            self._event = None


class Timers:
    """How late the emulator's timers woke up (or its first tokens came): each lateness in wall
    seconds, never below 0 (asyncio may run a timer up to its clock's resolution early). Counts and the maximum
    cover every wake-up; the quantiles the last ``LATENESS_KEPT``."""

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.recent: deque[float] = deque(maxlen=LATENESS_KEPT)

    def record(self, late_s: float) -> None:
        """One wake-up, ``late_s`` after it was due."""
        late_s = max(0.0, late_s)
        self.count += 1
        self.total_s += late_s
        self.max_s = max(self.max_s, late_s)
        self.recent.append(late_s)

    def summary(self) -> dict[str, float | int]:
        """``timers`` (wake-ups so far), ``mean_s``, ``max_s``, and ``p50_s``/``p90_s`` of the recent ones."""
        q = statistics.quantiles(self.recent, n=10, method="inclusive") if len(self.recent) > 1 else None
        one = self.recent[0] if self.recent else 0.0
        return {"timers": self.count, "mean_s": self.total_s / self.count if self.count else 0.0,
                "p50_s": q[4] if q else one, "p90_s": q[8] if q else one, "max_s": self.max_s}


def timers_handler(clock: RealtimeLoop) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /_timers``: the clock's ``wakeups`` and ``first_tokens`` (:meth:`Timers.summary` each)
    as JSON, a test's view as /_fault is."""
    async def timers(request: web.Request) -> web.Response:
        return web.json_response({"wakeups": clock.timers.summary(), "first_tokens": clock.first_tokens.summary()})
    return timers
