"""A coarse deadline clock for the gateway's upstream waits (``gateway/upstream.py``)."""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

TICK: Final = 0.05  # seconds; module level, so a compiled build reads it like the pure one


class Waiter(Protocol):
    """What the clock can time out: an asyncio future, or a quick exchange's connection
    (``gateway/upstream_conn.py``), which fails its exchange when its deadline passes."""

    def done(self) -> bool: ...

    def set_exception(self, exc: Exception) -> None: ...


class Deadlines:
    """One coarse clock for every upstream wait on an event loop (the first byte, the idle time
    between body pieces), like the HTTP server's deadline sweep: a wait is an entry in a dict,
    checked every ``TICK`` seconds by one timer that runs only while some wait is pending, instead
    of a timer handle made and cancelled per wait — per streamed chunk, that was a TimerHandle, a
    libuv timer start and stop, and a cancel (and the message formatted per wait: now only when
    one expires). A deadline fires up to ``TICK`` late, never early; the timeouts it enforces are
    seconds long."""

    __slots__ = ("loop", "error", "waits", "handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, error: type[Exception]):
        self.loop = loop
        self.error = error  # raised in an expired wait
        self.waits: dict[Waiter, tuple[float, float, str]] = {}  # → (deadline, seconds, message)
        self.handle: asyncio.TimerHandle | None = None

    def add(self, fut: Waiter, seconds: float, message: str) -> None:
        """Fail ``fut`` with ``error(message.format(seconds))`` unless it is done, or popped from
        ``waits``, within ``seconds``."""
        now = self.loop.time()
        self.waits[fut] = (now + seconds, seconds, message)
        if self.handle is None:
            self.handle = self.loop.call_at(now + TICK, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        waits = self.waits
        for fut, (_, seconds, message) in [item for item in waits.items() if item[1][0] <= now]:
            del waits[fut]
            if not fut.done():
                fut.set_exception(self.error(message.format(seconds)))
        self.handle = self.loop.call_at(now + TICK, self._tick) if waits else None
