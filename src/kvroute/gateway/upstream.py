"""A lean HTTP/1.1 client for upstream engines: keep-alive pools, llhttp parsing, asyncio protocols.

The gateway's only client-side needs are: POST a JSON body, get the status and headers, then the
body as it arrives (Content-Length, chunked, or until close), with connect / first-byte / idle
timeouts, and closing the connection to cancel an abandoned request. aiohttp's general client
spends several times more CPU per request on features a proxy hop does not use (cookies,
redirects, tracing, multidict headers); this one keeps the hop cheap. Responses are parsed by
llhttp (``httptools``) in strict mode, so a malformed status line, a negative or non-numeric
Content-Length, Content-Length with Transfer-Encoding or a bad chunk size is an
``UpstreamProtocolError``, never an exception inside the protocol.

An upstream's response head (status line and fields, and a trailer section) is held to
``MAX_HEAD_BYTES`` like a client's request head, bytes of a field not yet complete included; beyond
it the response is an ``UpstreamProtocolError`` (a 502 or a retry), not memory and CPU spent on
an endless field.

Pooled connections: real engines close kept-alive connections on their own (llama-server after
every streamed response, while still advertising ``Keep-Alive``). A connection is reused only if
the upstream neither closed it nor said ``Connection: close``; and when a reused connection turns
out dead before any byte of the response, the request is sent once more on a fresh connection —
that is the pool's business, not a replica failure.

Its errors are the tree in ``gateway/upstream_errors.py`` (the gateway retries them by kind).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Final, cast
from urllib.parse import urlsplit

import httptools

from kvroute.gateway.deadlines import Deadlines
from kvroute.gateway.upstream_errors import UpstreamConnectError as UpstreamConnectError
from kvroute.gateway.upstream_errors import UpstreamError as UpstreamError
from kvroute.gateway.upstream_errors import UpstreamProtocolError as UpstreamProtocolError
from kvroute.gateway.upstream_errors import UpstreamTimeout as UpstreamTimeout
from kvroute.gateway.upstream_errors import _StaleConnection

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
                 "relay", "relay_idle")

    transport: asyncio.Transport  # set by connection_made
    head: asyncio.Future[tuple[int, RawHeaders]]  # set by begin

    def __init__(self, pool: UpstreamPool, loop: asyncio.AbstractEventLoop | None = None):
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
        self._headers: RawHeaders = []
        self._head_bytes = 0  # raw bytes while a head is incomplete, then field bytes of the trailers
        self._stall = 0  # raw bytes of a body since its last data: chunk framing, trailers

    def begin(self, reused: bool) -> asyncio.Future[tuple[int, RawHeaders]]:
        """Prepare for the next response; returns the future of its head."""
        self.state, self.reused, self.got_bytes, self.interim = _WAIT_HEAD, reused, False, False
        self._head_bytes = self._stall = 0
        if len(self.chunks):  # empty after a response read to its end: no method call then
            self.chunks.clear()
        self.head = self.loop.create_future()
        return self.head

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
        self.state = _BODY
        if not self.head.done():
            self.head.set_result((status, self._headers))

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
        head = getattr(self, "head", None)  # unset until the first request
        if head is not None and not head.done():
            head.set_exception(err)
        elif was == _BODY:
            self._deliver(err)


class UpstreamResponse:
    """The status and headers (names and values as bytes, as they came) of an upstream
    response; the body is read with ``next_chunk``."""

    def __init__(self, conn: _Conn, status: int, headers: RawHeaders, idle_s: float):
        self._conn: _Conn | None = conn
        self.status = status
        self.headers = headers
        self._idle_s = idle_s
        self._done = False

    async def next_chunk(self, timeout_s: float | None = None,
                         relay: Callable[[bytes], bool] | None = None) -> bytes | None:
        """The next piece of body as it arrives (all pieces already received, joined); None at
        the end. Waits at most ``timeout_s`` (default: the idle timeout).

        With a ``relay``, pieces that arrive while this waits are passed to it straight from the
        connection's read callback (joined per read), each restarting the idle timeout, and this
        returns only at the end, on an error (an exception the relay raised included), or with
        ``b""`` once the relay returned False — a stream relayed with no task wake-up per chunk."""
        conn = self._conn
        assert conn is not None, "response already released"
        while not conn.chunks:
            clock = _deadlines(conn.loop)
            conn.wakeup = fut = clock.loop.create_future()
            wait = self._idle_s if timeout_s is None else timeout_s
            clock.add(fut, wait, _IDLE_MESSAGE)
            if relay is not None:
                conn.relay, conn.relay_idle = relay, (clock, self._idle_s)
            try:
                await fut
            finally:
                conn.wakeup = conn.relay = conn.relay_idle = None
                clock.waits.pop(fut, None)
        chunks = conn.chunks
        item = chunks[0]
        if item.__class__ is not bytes:
            chunks.popleft()
            if item is _EOF:
                self._done = True
                return None
            raise cast(Exception, item)
        return _take_bytes(chunks)

    def take(self) -> bytes | None:
        """The whole body when all of it has arrived (a small answer comes with its head), taken
        without an await; None when more is to come (then :meth:`read`). The common case, one
        piece and the end, is tested written out: no copy of the queue, no generator (issue 25's
        ninth round, docs/hot-path.md)."""
        conn = self._conn
        if conn is None or conn.state != _DONE:  # an error is queued only on a broken connection
            return None
        chunks = conn.chunks
        n = len(chunks)
        if n == 0 or chunks[n - 1] is not _EOF:
            return None
        if n == 2:
            body = chunks[0]
            if body.__class__ is not bytes:
                return None
            chunks.clear()
            self._done = True
            return body
        for i in range(n - 1):
            if chunks[i].__class__ is not bytes:
                return None
        chunks.pop()  # the end
        data = b"".join(cast("deque[bytes]", chunks))
        chunks.clear()
        self._done = True
        return data

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The whole body; ``timeout_s`` bounds the wait for its first piece."""
        body = self.take()
        if body is not None:
            return body
        parts = []
        while (chunk := await self.next_chunk(timeout_s)) is not None:
            parts.append(chunk)
            timeout_s = None
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back when the body was read to the end and the upstream keeps it
        alive; otherwise close it, which tells the engine to stop working on the request."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        pool = conn.pool
        if self._done and conn.keep_alive and conn.state == _DONE and not conn.closed \
                and len(pool._idle) < pool.max_idle:
            conn.state = _IDLE
            pool._idle.append(conn)
        elif not conn.closed:
            conn.state = _BROKEN
            conn.transport.close()


class UpstreamPool:
    """Keep-alive connections to one upstream ``http://host:port``."""

    def __init__(self, url: str, max_idle: int = 256, tls: ssl.SSLContext | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"upstream url must be http:// or https://, got {url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.tls = (tls or ssl.create_default_context()) if parts.scheme == "https" else None
        self.port = parts.port or (443 if self.tls else 80)
        self.authority = parts.netloc.encode()
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()
        self.stale_retries = 0  # reused connections found dead and replaced (not replica failures)
        self._starts: dict[str, bytes] = {}  # path → the request head's first lines, up to Content-Length's value

    def _pooled(self) -> _Conn | None:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.state == _IDLE:
                return conn
        return None

    async def _connect(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(self, loop), self.host, self.port,
                                                                    ssl=self.tls),
                                             timeout)
        except TimeoutError:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} failed: {exc.strerror or exc}") from None
        return conn

    async def post(self, path: str, body: bytes, headers: Headers, *, connect_s: float,
                   first_byte_s: float, idle_s: float,
                   on_send: Callable[[Callable[[UpstreamError], None]], None] | None = None) -> UpstreamResponse:
        """Send the request; returns once the response head arrived (within ``first_byte_s``).
        ``on_send`` is handed the exchange's abort function once the request is on its way."""
        start = self._starts.get(path)
        if start is None:  # the request line and Host, the same for every request to this path: made once
            start = b"".join((b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", self.authority,
                              b"\r\nContent-Length: "))
            if len(self._starts) < _STARTS_MAX:
                self._starts[path] = start
        # the fields as one str, encoded once (not two encodes and four list items a field)
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers])
        request = (b"".join((start, str(len(body)).encode(), b"\r\n", lines.encode("latin-1"), b"\r\n")), body)
        conn = self._pooled()
        reused = conn is not None
        if conn is None:
            conn = await self._connect(connect_s)
        while True:  # the exchange written out here, not a coroutine of its own: one await layer less
            head_fut = conn.begin(reused)
            conn.transport.writelines(request)
            if on_send is not None:
                on_send(conn.abort)
            clock = _deadlines(conn.loop)
            clock.add(head_fut, first_byte_s, "no response within {:g} s")
            try:
                status, fields = await head_fut
                return UpstreamResponse(conn, status, fields, idle_s)
            except _StaleConnection:
                conn.state = _BROKEN
                conn.transport.close()
                self.stale_retries += 1  # the upstream had closed it: once more, on a new connection
            except BaseException:
                conn.state = _BROKEN
                conn.transport.close()
                raise
            finally:
                clock.waits.pop(head_fut, None)
            conn, reused = await self._connect(connect_s), False

    def close(self) -> None:
        """Close every idle connection."""
        while self._idle:
            self._idle.pop().transport.close()
