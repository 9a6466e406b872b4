"""One upstream connection of the gateway's lean HTTP/1.1 client (``gateway/upstream.py`` holds the
pool and the response reader, and describes the rules): llhttp callbacks turn bytes into a head
(a future, or a quick exchange's callback) and body pieces; the coarse deadline clock per loop."""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, Final, cast

import httptools

from kvroute.gateway.deadlines import Deadlines
from kvroute.gateway.upstream_errors import UpstreamError, UpstreamProtocolError, UpstreamTimeout, _StaleConnection

_IDLE_MESSAGE: Final = "upstream sent nothing for {:g} s"
MAX_HEAD_BYTES: Final = 64 * 1024  # an upstream response's head, or its trailer section (nginx: 4-32 KiB)
_EOF: Final = object()
_USUAL: Final = (b"Content-Length", b"content-length", b"Transfer-Encoding", b"transfer-encoding")  # engines' spelling
_STARTS_MAX: Final = 64  # request heads' first lines kept per upstream (one per path: the API has a few)
# connection states (Final: a compiled build inlines them)
_IDLE: Final = 0
_WAIT_HEAD: Final = 1
_BODY: Final = 2
_DONE: Final = 3
_BROKEN: Final = 4


Headers = list[tuple[str, str]]
RawHeaders = list[tuple[bytes, bytes]]  # a response's fields as they came: passed on without decoding


_clock: Deadlines | None = None  # the running loop's (one loop per thread; a new loop gets a new one)


def _deadlines(loop: asyncio.AbstractEventLoop) -> Deadlines:
    """The coarse clock (``gateway/deadlines.py``) of ``loop``, the running one: a connection
    keeps its loop, since asking asyncio for the running loop costs a ``getpid`` system call. A
    wait registers ``fut`` with ``add`` and, however it ends, pops it from ``waits``; on expiry
    ``fut`` gets ``UpstreamTimeout(message.format(seconds))``."""
    global _clock
    clock = _clock
    if clock is None or clock.loop is not loop:
        clock = _clock = Deadlines(loop, UpstreamTimeout)
    return clock


def _take_bytes(chunks: deque[bytes | object]) -> bytes:
    """The body pieces at the front of ``chunks`` (its first is one), joined: what already arrived
    goes on in one write. Only the last entry can be something else (the end, or an error)."""
    last = chunks[-1]
    if last.__class__ is bytes:
        if len(chunks) == 1:
            return cast(bytes, chunks.pop())
        data = b"".join(cast("deque[bytes]", chunks))
        chunks.clear()
        return data
    chunks.pop()
    data = b"".join(cast("deque[bytes]", chunks))
    chunks.clear()
    chunks.append(last)
    return data


class _Conn(asyncio.Protocol):
    """One upstream connection; llhttp callbacks turn bytes into a head future and body pieces."""

    __slots__ = ("pool", "loop", "parser", "transport", "head", "chunks", "wakeup", "state", "closed", "reused",
                 "got_bytes", "keep_alive", "until_close", "interim", "_headers", "_head_bytes", "_stall",
                 "relay", "relay_idle", "quick", "status", "idle_s")

    transport: asyncio.Transport  # set by connection_made
    head: asyncio.Future[tuple[int, RawHeaders]] | None  # set by begin; None for a quick exchange

    def __init__(self, pool: Any, loop: asyncio.AbstractEventLoop | None = None):
        self.pool = pool
        self.loop = loop or asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.chunks: deque[bytes | object] = deque()
        self.wakeup: asyncio.Future[None] | None = None
        # while a reader waits with a relay (UpstreamResponse.next_chunk), body pieces go to it from
        # data_received instead of waking the reader; relay_idle: (clock, idle seconds) to refresh
        self.relay: Callable[[bytes], bool] | None = None
        self.relay_idle: tuple[Deadlines, float] | None = None
        self.state = _IDLE
        self.closed = False
        self.reused = False
        self.got_bytes = False
        self.keep_alive = True
        self.until_close = False
        self.interim = False
        self.head = None
        # a quick exchange (UpstreamPool.quick): called with None once its response is all in, or with the error
        self.quick: Callable[[UpstreamError | None], None] | None = None
        self.status = 0  # a quick exchange's status
        self.idle_s = 0.0  # a quick exchange's idle timeout between body pieces
        self._headers: RawHeaders = []
        self._head_bytes = 0  # raw bytes while a head is incomplete, then field bytes of the trailers
        self._stall = 0  # raw bytes of a body since its last data: chunk framing, trailers

    def begin(self, reused: bool) -> asyncio.Future[tuple[int, RawHeaders]]:
        """Prepare for the next response; returns the future of its head."""
        self.state, self.reused, self.got_bytes, self.interim = _WAIT_HEAD, reused, False, False
        self._head_bytes = self._stall = 0
        if len(self.chunks):  # empty after a response read to its end: no method call then
            self.chunks.clear()
        self.head = head = self.loop.create_future()
        return head

    def begin_quick(self, done: Callable[[UpstreamError | None], None], idle_s: float) -> None:
        """Prepare a reused connection for a response answered by ``done`` (``UpstreamPool.quick``)."""
        self.state, self.reused, self.got_bytes, self.interim = _WAIT_HEAD, True, False, False
        self._head_bytes = self._stall = 0
        if len(self.chunks):
            self.chunks.clear()
        self.head, self.quick, self.idle_s = None, done, idle_s

    def _settle(self, err: UpstreamError | None) -> None:
        """End a quick exchange: off the deadline clock, then its callback (last: it may reuse this connection)."""
        done = self.quick
        if done is not None:
            self.quick = None
            _deadlines(self.loop).waits.pop(self, None)
            done(err)

    def drop(self) -> None:
        """Give a quick exchange up without its callback (its client left): the connection is
        closed, which tells the engine to stop."""
        if self.quick is not None:
            self.quick = None
            _deadlines(self.loop).waits.pop(self, None)
            self._fail(UpstreamProtocolError("the exchange was given up"))

    # a quick exchange on the deadline clock (``Deadlines`` asks a wait whether it is done, and fails it)
    def done(self) -> bool:
        return self.quick is None

    def set_exception(self, exc: Exception) -> None:
        self.abort(cast(UpstreamError, exc))

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state = self.state
        if state == _WAIT_HEAD:
            cls = _StaleConnection if self.reused and not self.got_bytes else UpstreamProtocolError
            self._fail(cls(f"upstream closed the connection before responding ({exc or 'EOF'})"))
        elif state == _BODY:
            if self.until_close:  # the body was delimited by the connection's end
                self.state = _DONE
                self._deliver(_EOF)
                self._settle(None)
            else:
                self._fail(UpstreamProtocolError("upstream closed the connection before the body ended"))

    def data_received(self, data: bytes) -> None:
        if self.state not in (_WAIT_HEAD, _BODY):
            self._fail(UpstreamProtocolError("unexpected bytes from upstream between responses"))
            return
        self.got_bytes = True
        if self.state == _WAIT_HEAD:
            self._head_bytes += len(data)
        else:
            self._stall += len(data)  # back to 0 at each piece of body data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, UpstreamError) else UpstreamProtocolError(str(exc)))
            return
        except httptools.HttpParserError as bad:
            self._fail(UpstreamProtocolError(f"malformed response from upstream: {bad}"))
            return
        if (self._head_bytes if self.state == _WAIT_HEAD else self._stall) > MAX_HEAD_BYTES:
            self._fail(UpstreamProtocolError(f"upstream response head or trailer section larger than "
                                             f"{MAX_HEAD_BYTES} bytes"))
        elif self.relay is not None and self.chunks:
            self._pump()
        elif self.quick is not None:
            if self.state == _DONE:
                self._settle(None)
            elif self.state == _BODY and self.chunks:  # body came: the idle deadline (not the first byte's) runs
                clock = _deadlines(self.loop)
                clock.waits[self] = (self.loop.time() + self.idle_s, self.idle_s, _IDLE_MESSAGE)

    def _pump(self) -> None:
        """Hand the body bytes that arrived to the waiting reader's relay, in one piece, without
        waking the reader; it wakes when the relay says stop, at the end, or on an error."""
        w, chunks, relay = self.wakeup, self.chunks, self.relay
        if w is None or w.done() or relay is None or chunks[0].__class__ is not bytes:
            return  # the reader is already woken: it takes what is queued itself
        data = _take_bytes(chunks)
        idle = self.relay_idle
        if idle is not None:  # progress: the idle deadline starts again
            clock, seconds = idle
            clock.waits[w] = (clock.loop.time() + seconds, seconds, _IDLE_MESSAGE)
        try:
            go = relay(data)
        except Exception as exc:  # raised in the reader, as if it had processed the piece itself
            self.relay = None
            w.set_exception(exc)
            return
        if not go:  # the reader must act (stop, wait for its client): wake it with nothing new
            self.relay = None
            chunks.appendleft(b"")
            w.set_result(None)

    # -- llhttp callbacks ---------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.state != _WAIT_HEAD:
            raise UpstreamProtocolError("upstream sent a second response to one request")
        self._headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state == _BODY:
            return  # a trailer field: not used (its bytes are bounded by ``_stall``)
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        if 100 <= status < 200:  # an interim response (100 Continue, 103 Early Hints): skip it
            self.interim = True
            return
        self.keep_alive = parser.should_keep_alive()
        delimited = status in (204, 304)
        if not delimited:
            for name, _ in self._headers:
                n = len(name)  # lowered (a bytes method: ~600 instr.) only if its length fits and it is spelled oddly
                if (n == 14 or n == 17) and (name in _USUAL or name.lower() in _USUAL[1::2]):
                    delimited = True
                    break
        self.until_close = not delimited
        if self.until_close:
            self.keep_alive = False
        self.state, self.status = _BODY, status
        head = self.head
        if head is not None and not head.done():
            head.set_result((status, self._headers))

    def on_body(self, data: bytes) -> None:  # once per piece of body: _deliver written out
        self._stall = 0
        self.chunks.append(data)
        w = self.wakeup
        if w is not None and self.relay is None and not w.done():
            w.set_result(None)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.state = _DONE
        self._deliver(_EOF)

    # -- delivery -----------------------------------------------------------------------------------
    def _deliver(self, item: bytes | object) -> None:
        self.chunks.append(item)
        w = self.wakeup
        if w is not None and not w.done() and (self.relay is None or item.__class__ is not bytes):
            w.set_result(None)  # body bytes for a relay are handed over after the read (_pump)

    def abort(self, err: UpstreamError) -> None:
        """Give up on the exchange in progress (the engine stopped making progress): close the
        connection and raise ``err`` in whoever waits for its head or body."""
        if self.state in (_WAIT_HEAD, _BODY):
            self._fail(err)

    def _fail(self, err: UpstreamError) -> None:
        """The connection is unusable: close it and hand the error to whoever waits."""
        was = self.state
        self.state, self.keep_alive = _BROKEN, False
        if not self.closed:
            self.transport.close()
        head = self.head
        if head is not None and not head.done():
            head.set_exception(err)
        elif was == _BODY:
            self._deliver(err)
        self._settle(err)


