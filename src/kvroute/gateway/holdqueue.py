"""The gateway's hold queue: requests the policy holds (selective pushing) wait here in FIFO order
and leave, at most one per pacer tick, when the policy admits them — or a peer does, or their
wait runs out. Routing itself, and undoing a dispatch a waiter gave up, are the runtime's
(callables handed in), so this module knows nothing of replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.errors import ServiceError
from kvroute.gateway.settings import QueueConfig
from kvroute.model import Decision, DecisionKind, Request
from kvroute.policy import DispatchPacer


@dataclass
class Waiter:
    """A request the policy held, waiting in the gateway queue for a replica (its future gets the Decision)."""

    request: Request
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class QueueFull(ServiceError):
    """The LB queue is at its configured length; the gateway answers 429."""


class QueueTimeout(ServiceError):
    """No replica took the request within the queue's max wait; the gateway answers 503."""


class PolicyError(ServiceError):
    """The routing policy raised; logged with its traceback, answered 503 without details."""


class HoldQueue:
    """FIFO of held requests. ``route`` decides and commits one request (raises PolicyError);
    ``on_hold(request, behind)`` may forward a held request elsewhere (a peer) and returns that
    decision or None; ``undo(request, decision)`` takes back a dispatch nobody will use;
    ``waited(seconds)`` observes each request's time in the queue; ``settings`` gives the
    current limits (a reload may change them)."""

    def __init__(self, settings: Callable[[], QueueConfig], route: Callable[[Request], Decision],
                 on_hold: Callable[[Request, int], Decision | None], undo: Callable[[Request, Decision], None],
                 waited: Callable[[float], None]):
        self.waiting: deque[Waiter] = deque()
        self.pacer: DispatchPacer | None = None  # set by the runtime: only policies that hold are paced
        self._settings, self._route, self._on_hold, self._undo, self._waited = settings, route, on_hold, undo, waited
        self._wake: asyncio.TimerHandle | None = None  # a paced drain already scheduled

    async def admit(self, req: Request) -> Decision:
        """Route now, or wait in FIFO order while the policy holds (selective pushing)."""
        d = self.try_now(req)
        return d if d is not None else await self.wait(req)

    def try_now(self, req: Request) -> Decision | None:
        """:meth:`admit`'s first step, without a coroutine (the proxy's hot path): the decision
        when nobody waits and the policy does not hold; None when ``req`` must :meth:`wait`."""
        if not self.waiting:
            d = self._route(req)
            if d.kind is not DecisionKind.HOLD:
                return d
        return None

    async def wait(self, req: Request) -> Decision:
        """Queue ``req`` behind those waiting and return its decision once the policy admits it."""
        qc = self._settings()
        if len(self.waiting) >= qc.max_len:
            raise QueueFull(f"LB queue is full ({qc.max_len} waiting)")
        waiter = Waiter(req, asyncio.get_running_loop().create_future())
        self.waiting.append(waiter)
        self.drain()
        try:
            async with asyncio.timeout(qc.max_wait_s):  # unlike wait_for on 3.11, a cancel after
                return await waiter.future  # set_result still cancels: _abandon undoes the dispatch
        except TimeoutError:
            self._abandon(waiter)
            raise QueueTimeout(f"no replica could take the request within {qc.max_wait_s:g} s") from None
        except asyncio.CancelledError:  # the client went away while queued
            self._abandon(waiter)
            raise

    def _abandon(self, w: Waiter) -> None:
        """A waiter gave up: leave the queue, or undo a dispatch it can no longer use."""
        if not w.future.done():
            w.future.cancel()  # drain skips it
        elif not w.future.cancelled() and w.future.exception() is None and (d := w.future.result()).dispatched:
            self._undo(w.request, d)

    def drain(self) -> None:
        """Dispatch queued requests, oldest first, while the policy admits them — at most one
        per pacer tick, so a replica that looked free at the last probe is not handed the whole
        queue at once (SkyWalker's LB pops one request per 10 ms). Requests that arrive to an
        empty queue route at once; the admission gate counts them against the probed room."""
        queue, pacer = self.waiting, self.pacer
        while queue:
            w = queue[0]
            if w.future.done():
                queue.popleft()
                continue
            if pacer is not None:
                now = time.monotonic()
                if not pacer.ready(now):
                    self._wake_later(pacer.wait_s(now))
                    return
            try:
                d = self._route(w.request)
            except PolicyError as exc:
                queue.popleft()
                w.future.set_exception(exc)
                continue
            if d.kind is DecisionKind.HOLD:
                forward = self._on_hold(w.request, len(queue) - 1)  # SkyWalker: a peer that admits it
                if forward is None:
                    return
                d = forward
            queue.popleft()
            if pacer is not None and d.kind is DecisionKind.DISPATCH:
                pacer.dispatched(time.monotonic())
            self._waited(time.monotonic() - w.enqueued)
            w.future.set_result(d)

    def _wake_later(self, delay_s: float) -> None:
        if self._wake is None:
            self._wake = asyncio.get_running_loop().call_later(delay_s, self._paced_drain)

    def _paced_drain(self) -> None:
        self._wake = None
        self.drain()

    def stop_pacing(self) -> None:
        """Shutting down: no more paced drains."""
        if self._wake is not None:
            self._wake.cancel()

    def close(self) -> None:
        """Shutting down: every waiter fails with QueueTimeout."""
        for w in self.waiting:
            if not w.future.done():
                w.future.set_exception(QueueTimeout("gateway is shutting down"))
