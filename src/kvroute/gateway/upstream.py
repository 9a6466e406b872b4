"""A lean HTTP/1.1 client for upstream engines: keep-alive pools, llhttp parsing, asyncio protocols.

The gateway's only client-side needs are: POST a JSON body, get the status and headers, then the
body as it arrives (Content-Length, chunked, or until close), with connect / first-byte / idle
timeouts, and closing the connection to cancel an abandoned request. aiohttp's general client
spends several times more CPU per request on features a proxy hop does not use (cookies,
redirects, tracing, multidict headers); this one keeps the hop cheap. Responses are parsed by
llhttp (``httptools``) in strict mode, so a malformed status line, a negative or non-numeric
Content-Length, Content-Length with Transfer-Encoding or a bad chunk size is an
``UpstreamProtocolError``, never an exception inside the protocol. A response's head (status line,
fields, and a trailer section) is held to ``MAX_HEAD_BYTES``, bytes of an unfinished field
included: beyond it, an ``UpstreamProtocolError`` (a 502 or a retry), not memory spent on an
endless field.

Pooled connections: real engines close kept-alive connections on their own (llama-server after
every streamed response, while still advertising ``Keep-Alive``). A connection is reused only if
the upstream neither closed it nor said ``Connection: close``; a reused connection found dead
before any byte of the response is the pool's business (the request is sent again on a fresh
one), not a replica failure. ``UpstreamPool.quick`` sends on a kept-alive connection and answers
by a callback once the whole response is in (no future, no coroutine: issue 25's callback path).
Errors are the tree in ``gateway/upstream_errors.py`` (the gateway retries them by kind).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from kvroute.gateway.upstream_conn import _BROKEN, _DONE, _EOF, _IDLE, _IDLE_MESSAGE, _STARTS_MAX, _take_bytes
from kvroute.gateway.upstream_conn import MAX_HEAD_BYTES as MAX_HEAD_BYTES
from kvroute.gateway.upstream_conn import Headers as Headers
from kvroute.gateway.upstream_conn import RawHeaders as RawHeaders
from kvroute.gateway.upstream_conn import _Conn as _Conn
from kvroute.gateway.upstream_conn import _deadlines as _deadlines
from kvroute.gateway.upstream_errors import UpstreamConnectError as UpstreamConnectError
from kvroute.gateway.upstream_errors import UpstreamError as UpstreamError
from kvroute.gateway.upstream_errors import UpstreamProtocolError as UpstreamProtocolError
from kvroute.gateway.upstream_errors import UpstreamTimeout as UpstreamTimeout
from kvroute.gateway.upstream_errors import _StaleConnection as _StaleConnection


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
        pool = cast(UpstreamPool, conn.pool)  # typed here: the connection module cannot import the pool
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

    def has_idle(self) -> bool:
        """Whether a kept-alive connection is idle (dead ones at the top are dropped on the way)."""
        idle = self._idle
        while idle and (idle[-1].closed or idle[-1].state != _IDLE):
            idle.pop()
        return bool(idle)

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

    def _request(self, path: str, body: bytes, headers: Headers) -> tuple[bytes, bytes]:
        """The request's head and body, for one ``writelines``."""
        start = self._starts.get(path)
        if start is None:  # the request line and Host, the same for every request to this path: made once
            start = b"".join((b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", self.authority,
                              b"\r\nContent-Length: "))
            if len(self._starts) < _STARTS_MAX:
                self._starts[path] = start
        # the fields as one str, encoded once (not two encodes and four list items a field)
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers])
        return b"".join((start, str(len(body)).encode(), b"\r\n", lines.encode("latin-1"), b"\r\n")), body

    def quick(self, path: str, body: bytes, headers: Headers, done: Callable[[UpstreamError | None], None], *,
              first_byte_s: float, idle_s: float) -> _Conn | None:
        """Send on a kept-alive connection; ``done(None)`` once the whole response is in (read it with
        ``UpstreamResponse(conn, conn.status, ...)``), ``done(err)`` on a failure (a ``_StaleConnection``:
        the connection had died; send again). None, and nothing sent, when no connection is idle."""
        conn = self._pooled()
        if conn is None:
            return None
        conn.begin_quick(done, idle_s)
        conn.transport.writelines(self._request(path, body, headers))
        _deadlines(conn.loop).add(conn, first_byte_s, "no response within {:g} s")
        return conn

    async def post(self, path: str, body: bytes, headers: Headers, *, connect_s: float,
                   first_byte_s: float, idle_s: float,
                   on_send: Callable[[Callable[[UpstreamError], None]], None] | None = None) -> UpstreamResponse:
        """Send the request; returns once the response head arrived (within ``first_byte_s``).
        ``on_send`` is handed the exchange's abort function once the request is on its way."""
        request = self._request(path, body, headers)
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
