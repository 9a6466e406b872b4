"""How a client connection of the gateway's HTTP server answers its requests (``gateway/httpconn.py``
reads them): one at a time, in order (pipelining). Each handler runs as soon as its request is
complete, in the connection's read callback: what it answers at once goes out without waking a
task, a coroutine it returns is awaited by the connection's worker task, and a ``Pending`` it
returns is finished by callbacks (the proxy's callback path for non-streamed answers: issue 25,
docs/hot-path.md)."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable
from typing import Final

from kvroute.gateway.httpmsg import BadRequest, Pending, Request, Responder, ServerState, error_body, log

# connection phases, for deadlines (Final: a compiled build inlines them; a module global is a dict lookup per use)
_IDLE: Final = 0  # waits between kept-alive requests
_HEAD: Final = 1
_BODY: Final = 2
_BUSY: Final = 3
_NEW: Final = 4  # has sent nothing yet: held to the head deadline, counted from the accept


class Answering(asyncio.Protocol):
    """The answering half of a client connection (its reading half is ``httpconn._Connection``)."""

    transport: asyncio.Transport  # set by connection_made
    loop: asyncio.AbstractEventLoop  # set by connection_made

    def __init__(self, server: ServerState):
        self.server = server
        self.limits = server.limits
        self.counted = False  # in server.connections and server.clients
        self.pending: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None  # the worker (_work), awaiting ``arrival`` when idle
        self.arrival: asyncio.Future[None] | None = None
        self.busy = False  # a request is being answered
        self.job: tuple[Request, Responder, Awaitable[None] | None] | None = None  # for the worker
        self.exchange: Pending | None = None  # a request finished by callbacks (httpmsg.Pending)
        self._current: tuple[Request, Responder] | None = None  # its request and responder
        self.held = False  # an answer unread by the client: the next request waits for resume_writing
        self.closed = False
        self.paused = False
        self.reading = True
        self._drain: asyncio.Future[None] | None = None
        self.phase = _IDLE
        self.deadline = math.inf
        self.rejection: BadRequest | None = None  # answered once the requests before it are
        self.upgraded = False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    async def drained(self) -> None:
        """Wait until the client has read enough of what was written."""
        if self.closed:
            raise ConnectionResetError("client disconnected")
        self._drain = asyncio.get_running_loop().create_future()
        await self._drain

    def _idle(self) -> None:
        if self.counted:
            self.server.idle[self] = None  # the newest idle one: evicted last
        self.phase = _IDLE
        self.deadline = self.server.now + self.limits.keepalive_timeout_s

    # -- handling ---------------------------------------------------------------------------------
    def _next(self) -> None:
        """Answer the pending requests in order. Each handler runs here, at once: what it answers at once is
        sent without waking a task; a coroutine it returns goes to the worker task; a ``Pending`` is finished
        by its callbacks (``_resume``). None pending: answer a rejection, or read on and idle."""
        server = self.server
        while self.pending and not self.closed:
            if self.transport.is_closing():  # a write found it reset: answer no more of its run (connection_lost
                return  # comes at the loop's next turn, which answers made in a row never give)
            req = self.pending.popleft()
            self.busy = True
            self.phase, self.deadline = _BUSY, math.inf
            resp = Responder(self, req.keep_alive and not server.closing and not self.upgraded, req.method == "HEAD")
            server.active += 1
            try:
                work = server.handler(req, resp)
            except Exception:
                self._crashed(req, resp)
                self._end_one()
                return
            if work is None and resp.finished:
                self._end_one()
                if not self._after(resp):
                    return
            elif isinstance(work, Pending):
                self.exchange, self._current = work, (req, resp)
                work.resume = self._resume
                return
            else:  # a coroutine to await, or a response the handler began and left open: the worker's
                self._hand(req, resp, work)
                return
        if self.closed:
            self.busy = False
            return
        self.busy = False
        if self.rejection is not None:
            exc = self.rejection
            Responder(self, keep_alive=False).send(
                exc.status, error_body(str(exc), code="body_too_large" if exc.status == 413 else None))
            self.closed = True
            self.transport.close()
        elif self.upgraded:
            self.closed = True
            self.transport.close()
        elif not self.reading:
            self.reading = True
            self.transport.resume_reading()
        if self.phase == _BUSY:
            self._idle()

    def _after(self, resp: Responder) -> bool:
        """One request answered: may the next one start now? No when the connection closes, or while the
        client has not read this answer (then ``resume_writing`` goes on; a client that pipelines without
        reading would have every answer buffered here; it has the keep-alive time)."""
        if not resp.keep_alive:
            self.closed = True
            self.transport.close()
            return False
        if self.paused and not self.closed:
            self.held = True
            self.deadline = self.server.now + self.limits.keepalive_timeout_s
            return False
        return True

    def _end_one(self) -> None:
        server = self.server
        server.active -= 1
        if server.idle_waiter is not None and server.active == 0 and not server.idle_waiter.done():
            server.idle_waiter.set_result(None)

    def _crashed(self, req: Request, resp: Responder) -> None:
        log.exception("unhandled error on %s %s", req.method, req.path)
        self.server.errors += 1
        if not resp.started:
            resp.keep_alive = False
            resp.send(500, error_body("internal gateway error", "server_error"))
        self.transport.close()

    def _resume(self, work: Awaitable[None] | None) -> None:
        """A ``Pending`` exchange ended: answered (None), or its rest is a coroutine for the worker."""
        current = self._current
        self.exchange = self._current = None
        if current is None or self.closed:
            return
        req, resp = current
        if work is not None or not resp.finished:
            self._hand(req, resp, work)
            return
        self._end_one()
        if self._after(resp):
            self._next()

    def _hand(self, req: Request, resp: Responder, work: Awaitable[None] | None) -> None:
        """Give a request's coroutine to the worker: woken, started, or (when it is the caller) picked up."""
        self.job = (req, resp, work)
        arrival = self.arrival
        if arrival is not None:  # the worker waits: this one
            self.arrival = None
            arrival.set_result(None)
        elif self.task is None or self.task.done():
            self.task = self.loop.create_task(self._work())

    def _take(self) -> tuple[Request, Responder, Awaitable[None] | None] | None:
        """The worker's next job, taken (a method: a compiled build would read ``self.job`` as None
        after ``self._next()`` had it narrowed to None by an assignment in the same function)."""
        job, self.job = self.job, None
        return job

    async def _work(self) -> None:
        """The requests whose handlers returned a coroutine, awaited here; between them it waits for the next:
        a task per connection, not per request (one costs ~10,000 instructions to make and drop)."""
        while True:
            job = self._take()
            if job is not None:
                req, resp, work = job
                try:
                    if work is not None:
                        await work
                    if not resp.started:
                        raise RuntimeError(f"handler for {req.method} {req.path} returned without answering")
                    if not resp.finished:
                        await resp.end()
                except asyncio.CancelledError:
                    return  # the client disconnected; nothing more to write
                except ConnectionResetError:
                    self.transport.close()
                    return
                except Exception:
                    self._crashed(req, resp)
                    return
                finally:
                    self._end_one()
                if not self._after(resp):
                    if not self.held:
                        return
                    try:
                        await self.drained()
                    except ConnectionResetError:
                        return
                    self.held = False
                    self.deadline = math.inf
                self._next()  # the next ones, or read on and idle; a coroutine among them is picked up here
                if self.job is not None:
                    continue
            if self.closed:
                return
            self.arrival = arrival = self.loop.create_future()
            try:
                await arrival
            except asyncio.CancelledError:  # connection_lost, while idle
                return
