"""A lean HTTP/1.1 client for upstream engines: keep-alive pools on raw asyncio protocols.

The gateway's only client-side needs are: POST a JSON body, get the status and headers, then
the body as it arrives (Content-Length, chunked, or until close), with connect / first-byte /
idle timeouts, and closing the connection to cancel an abandoned request. aiohttp's general
client spends several times more CPU per request on features a proxy hop does not use
(cookies, redirects, tracing, multidict headers); this one keeps the hop cheap.
"""

from __future__ import annotations

import asyncio
from collections import deque
from urllib.parse import urlsplit


class UpstreamError(Exception):
    """The upstream connection failed or sent something that is not HTTP."""


class UpstreamTimeout(UpstreamError):
    """Connect, first byte or idle time ran out."""


_EOF = object()


def _expire(fut: asyncio.Future, message: str) -> None:
    if not fut.done():
        fut.set_exception(UpstreamTimeout(message))


async def _within(fut: asyncio.Future, seconds: float, message: str):
    """``await fut`` with a deadline; a timer handle is far cheaper than ``asyncio.wait_for``."""
    timer = asyncio.get_running_loop().call_later(seconds, _expire, fut, message)
    try:
        return await fut
    finally:
        timer.cancel()


class _Conn(asyncio.Protocol):
    __slots__ = ("pool", "transport", "buf", "head", "chunks", "state", "remaining", "reusable",
                 "closed", "wakeup")

    def __init__(self, pool: "UpstreamPool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: asyncio.Future | None = None
        self.chunks: deque = deque()
        self.wakeup: asyncio.Future | None = None
        self.state = "idle"
        self.remaining = 0
        self.reusable = True
        self.closed = False

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.state == "body-close":  # body delimited by the connection's end
            self._deliver(_EOF)
        elif self.state in ("head", "body", "chunk-size", "chunk-data", "chunk-crlf", "trailer"):
            err = UpstreamError(f"connection closed by upstream ({exc or 'EOF'})")
            if self.head is not None and not self.head.done():
                self.head.set_exception(err)
            else:
                self._deliver(err)
        self.state = "closed"

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            self._parse()
        except UpstreamError as exc:
            self.transport.close()
            if self.head is not None and not self.head.done():
                self.head.set_exception(exc)
            else:
                self._deliver(exc)

    # -- parsing ------------------------------------------------------------------------------------
    def _deliver(self, item) -> None:
        self.chunks.append(item)
        w = self.wakeup
        if w is not None and not w.done():
            w.set_result(None)

    def _parse(self) -> None:
        buf = self.buf
        while True:
            st = self.state
            if st == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > 65536:
                        raise UpstreamError("response head larger than 64 KiB")
                    return
                lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
                del buf[: end + 4]
                parts = lines[0].split(" ", 2)
                if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
                    raise UpstreamError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
                status = int(parts[1])
                headers = []
                length, chunked = None, False
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    name, value = name.strip(), value.strip()
                    low = name.lower()
                    if low == "content-length":
                        length = int(value)
                    elif low == "transfer-encoding" and "chunked" in value.lower():
                        chunked = True
                    elif low == "connection" and value.lower() == "close":
                        self.reusable = False
                    headers.append((name, value))
                if parts[0] == "HTTP/1.0":
                    self.reusable = False
                if chunked:
                    self.state = "chunk-size"
                elif length is not None:
                    self.state, self.remaining = "body", length
                else:
                    self.state, self.reusable = "body-close", False
                self.head.set_result((status, headers))
                if self.state == "body" and length == 0:
                    self._finish()
            elif st == "body":
                if not buf:
                    return
                if self._take() == 0:
                    self._finish()
            elif st == "body-close":
                if buf:
                    self._deliver(bytes(buf))
                    buf.clear()
                return
            elif st == "chunk-size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                try:
                    size = int(bytes(buf[:end]).split(b";", 1)[0], 16)
                except ValueError:
                    raise UpstreamError("bad chunk size in chunked body") from None
                del buf[: end + 2]
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.remaining = "chunk-data", size
            elif st == "chunk-data":
                if not buf:
                    return
                if self._take() == 0:
                    self.state = "chunk-crlf"
            elif st == "chunk-crlf":
                if len(buf) < 2:
                    return
                del buf[:2]
                self.state = "chunk-size"
            elif st == "trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                line = bytes(buf[:end])
                del buf[: end + 2]
                if not line:
                    self._finish()
            else:  # idle or finished: unexpected bytes
                if buf:
                    raise UpstreamError("unexpected bytes from upstream between responses")
                return

    def _take(self) -> int:
        """Deliver what has arrived of the current sized piece; returns what is still missing."""
        take = min(len(self.buf), self.remaining)
        self._deliver(bytes(self.buf[:take]))
        del self.buf[:take]
        self.remaining -= take
        return self.remaining

    def _finish(self) -> None:
        self.state = "done"
        self._deliver(_EOF)


class UpstreamResponse:
    def __init__(self, conn: _Conn, status: int, headers: list[tuple[str, str]], idle_s: float):
        self._conn = conn
        self.status = status
        self.headers = headers
        self._idle_s = idle_s
        self._done = False

    async def next_chunk(self) -> bytes | None:
        """The next piece of body as it arrives; None at the end."""
        conn = self._conn
        while not conn.chunks:
            conn.wakeup = asyncio.get_running_loop().create_future()
            try:
                await _within(conn.wakeup, self._idle_s, f"upstream sent nothing for {self._idle_s:g} s")
            finally:
                conn.wakeup = None
        chunks = conn.chunks
        item = chunks.popleft()
        if item is _EOF:
            self._done = True
            return None
        if isinstance(item, Exception):
            raise item
        if chunks and chunks[0].__class__ is bytes:  # pass on, in one write, what already arrived
            parts = [item]
            while chunks and chunks[0].__class__ is bytes:
                parts.append(chunks.popleft())
            item = b"".join(parts)
        return item

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Give the connection back when the body was read to the end; otherwise close it,
        which tells the upstream engine to stop working on the request."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._done and conn.reusable and not conn.closed and not conn.buf:
            conn.state = "idle"
            conn.pool._idle.append(conn)
        else:
            conn.transport.close()


class UpstreamPool:
    """Keep-alive connections to one upstream ``http://host:port``."""

    def __init__(self, url: str, max_idle: int = 256):
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"the lean upstream client speaks plain http, got {url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.authority = parts.netloc.encode()
        self.max_idle = max_idle
        self._idle: deque[_Conn] = deque()

    async def _connect(self, timeout: float) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(self), self.host, self.port),
                                             timeout)
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamError(f"connect to {self.host}:{self.port} failed: {exc.strerror or exc}") from None
        return conn

    async def post(self, path: str, body: bytes, headers: list[tuple[str, str]], *, connect_s: float,
                   first_byte_s: float, idle_s: float) -> UpstreamResponse:
        for attempt in (0, 1):
            fresh = not self._idle
            conn = await self._connect(connect_s)
            conn.buf.clear()
            conn.chunks.clear()
            conn.state = "head"
            conn.reusable = True
            conn.head = asyncio.get_running_loop().create_future()
            head = [b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", self.authority,
                    b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
            for name, value in headers:
                head += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
            head.append(b"\r\n")
            conn.transport.writelines((b"".join(head), body))
            try:
                status, resp_headers = await _within(conn.head, first_byte_s,
                                                     f"no response within {first_byte_s:g} s")
            except UpstreamTimeout:
                conn.transport.close()
                raise
            except UpstreamError:
                conn.transport.close()
                if attempt == 0 and not fresh:
                    continue  # a kept-alive connection the upstream had closed: retry once on a new one
                raise
            except asyncio.CancelledError:
                conn.transport.close()
                raise
            return UpstreamResponse(conn, status, resp_headers, idle_s)
        raise UpstreamError("unreachable")

    def close(self) -> None:
        while self._idle:
            self._idle.pop().transport.close()
