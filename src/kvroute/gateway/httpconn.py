"""One client connection of the gateway's HTTP server (``gateway/http.py`` describes the limits
and rules it enforces): llhttp callbacks build requests, deadlines are set per phase and enforced
by the server's sweep, and every refusal is answered, counted and the connection closed. How the
requests are answered, one at a time in order (pipelining), is ``gateway/httpwork.py``."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from typing import Final, cast

import httptools

from kvroute.gateway import httpmsg
from kvroute.gateway.httpmsg import (
    REASONS,
    BadRequest,
    Request,
    Responder,
    ServerState,
    error_body,
)
from kvroute.gateway.httpwork import _BODY, _BUSY, _HEAD, _NEW, Answering

LINGER_S: Final = 1.0  # a refused connection is read and discarded this long, so the refusal is not lost to a reset
MAX_LINGERING: Final = 256  # refused connections lingering at once; beyond, they are closed at once
# a read this large: the client has more queued; others get a turn first (else up to 32 such reads a turn)
_BIG_READ: Final = 64 * 1024
_DETACHED: Final = httptools.HttpRequestParser(object())  # a closed connection's parser: holds no callbacks


class _Connection(Answering):
    """One client connection: llhttp callbacks build requests; handlers run one at a time, in
    order (pipelining); deadlines are set per phase and enforced by ``HTTPServer._sweep`` (``gateway/http.py``)."""

    def __init__(self, server: ServerState):
        super().__init__(server)
        self.parser = httptools.HttpRequestParser(self)  # holds our callbacks: dropped by connection_lost
        self.client = ""  # the peer's address
        self.lingering = False  # refused: reading and discarding until LINGER_S passes
        self._url = b""  # the request being parsed: its target, fields, body
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._n_headers = 0
        self._head_seen = 0  # raw bytes received while a head is incomplete (unterminated fields)
        self._stall = 0  # raw bytes of a body since its last data: chunk framing, trailers
        self._in_trailers = False
        self._body: list[bytes] = []
        self._body_len = 0
        self._req: Request | None = None
        self._names = httpmsg.FieldNames()  # the last request's field names, in order (a cache)

    # -- transport events ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.loop = asyncio.get_running_loop()  # once: asking for it costs a getpid system call
        server, limits = self.server, self.limits
        peer = transport.get_extra_info("peername")
        self.client = client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not server.clients.add(client, limits.max_connections_per_client):
            self._refuse(503, "too_many_client_connections", httpmsg.TOO_MANY_CLIENT_CONNECTIONS,
                         f"the address holds its limit of {limits.max_connections_per_client} connections")
            return
        if len(server.connections) >= limits.max_connections:
            # at the cap, a connection holding no request (silent since its accept, or idle between requests)
            # makes room, the longest-held first, as nginx reuses its idle keep-alive connections: a flood of
            # silent connections from many addresses cannot lock new clients out; all mid-request: 503
            victim = next(iter(server.idle), None)
            if victim is None:
                server.clients.remove(client)
                self._refuse(503, "too_many_connections", httpmsg.TOO_MANY_CONNECTIONS,
                             f"the gateway holds its limit of {limits.max_connections} connections, all busy")
                return
            victim.evict()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server.connections.add(self)
        server.idle[self] = None
        self.counted = True
        self.phase, self.deadline = _NEW, server.now + limits.header_timeout_s  # not the keep-alive time

    def _refuse(self, status: int, reason: str, body: bytes, detail: str) -> None:
        """Answer a connection over a limit before reading anything, then close it. The answer goes
        out with a FIN while what the client sends meanwhile is read and dropped (for ``LINGER_S``),
        so a client that wrote its request first still reads the refusal instead of a reset."""
        server, transport = self.server, self.transport
        server.rejections.record(status, reason, self.client, detail, time.monotonic())
        self.closed = True  # nothing is parsed or answered on this connection
        transport.write(b"HTTP/1.1 %d %b\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%b"
                        % (status, REASONS[status].encode(), len(body), body))
        if server.lingering < MAX_LINGERING and transport.can_write_eof():
            transport.write_eof()
            self.lingering = True
            server.lingering += 1
            asyncio.get_running_loop().call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def evict(self) -> None:
        """Close a connection that holds no request to make room for a new one (counted as
        ``kvroute_http_rejected{status="0",reason="evicted_idle"}``: closed without an answer)."""
        self.server.rejections.record(0, "evicted_idle", self.client, "a connection holding no request was "
                                      "closed to admit a new one at the connection limit", time.monotonic())
        self._uncount()
        self.closed = True
        self.transport.close()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            server = self.server
            server.connections.discard(self)
            server.clients.remove(self.client)
            server.idle.pop(self, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        server = self.server
        self._uncount()
        if self.lingering:
            self.lingering = False
            server.lingering -= 1
        # the parser holds this connection's callbacks (a cycle): drop it and any partial body now, not at a GC
        self.parser = _DETACHED
        self._body = []
        self._req = None
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: stop working for it
        exchange = self.exchange
        if exchange is not None:  # and give up the one its callbacks were finishing
            self.exchange = self._current = None
            exchange.cancel()
            self._end_one()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        elif self.held and not self.closed:  # an answer sent by callbacks was read: the next request
            self.held = False
            self.deadline = math.inf
            self._next()

    def data_received(self, data: bytes) -> None:
        if self.rejection is not None or self.upgraded or self.closed:
            return  # the stream is out of sync, or the connection refused: what follows is never read
        limits = self.limits
        if self.phase == _BODY:
            self._stall += len(data)  # back to 0 at each piece of body data (on_body)
        else:
            self._head_seen += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, BadRequest) else BadRequest(400, "malformed request"))
            return
        except httptools.HttpParserUpgrade:
            self.upgraded = True  # protocol upgrades are not offered: answer, then close
            self._stop_reading()
            return
        except httptools.HttpParserError as bad:
            self._fail(BadRequest(400, f"malformed HTTP request: {bad}", "malformed"))
            return
        phase = self.phase
        if len(data) >= _BIG_READ and self.reading and not self.closed and self.rejection is None:
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._take_turn)
        if phase == _HEAD and self._head_seen > limits.max_head_bytes:
            self._fail(BadRequest(431, f"request head larger than {limits.max_head_bytes} bytes", "head_too_large"))
        elif phase == _BODY and self._stall > limits.max_head_bytes:
            # an unterminated trailer field or chunk extension: without this it is bounded only by
            # the body deadline, and llhttp's partial fields are joined at a cost that grows with them
            self._fail(BadRequest(431, f"chunk framing or trailer section larger than {limits.max_head_bytes} "
                                       "bytes", "trailer_too_large"))

    def _take_turn(self) -> None:
        """Read on after one turn of the loop, unless reading was paused for a reason of its own."""
        if self.reading and not self.closed and self.rejection is None:
            self.transport.resume_reading()

    # -- llhttp callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.server.idle.pop(self, None)  # it holds a request now
        if self.phase != _NEW:  # a new connection's head deadline runs from the accept
            self.deadline = self.server.now + self.limits.header_timeout_s
        self.phase = _HEAD
        self._url = b""
        self._headers = {}
        self._head_bytes = 0
        self._n_headers = 0
        self._in_trailers = False
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.limits
        self._head_bytes += len(name) + len(value) + 4  # _count_head, written out: once per field
        if self._head_bytes > limits.max_head_bytes:
            raise BadRequest(431, f"request head larger than {limits.max_head_bytes} bytes", "head_too_large")
        self._n_headers += 1
        if self._n_headers > limits.max_headers:
            raise BadRequest(431, f"more than {limits.max_headers} header fields", "too_many_headers")
        if self._in_trailers:
            return  # legal, counted against the head limits, not used
        key = self._names.key(self._n_headers - 1, name)
        text = value.decode("latin-1")
        prior = self._headers.get(key)
        if prior is not None:
            if key == "host":
                raise BadRequest(400, "more than one Host header", "host")
            # RFC 9110 §5.3: repeated fields are one comma-joined list; Cookie is joined with "; "
            # (RFC 6265 §5.4), since a comma may be part of a cookie's value
            text = f"{prior}; {text}" if key == "cookie" else f"{prior}, {text}"
        self._headers[key] = text

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_head_bytes:
            raise BadRequest(431, f"request head larger than {self.limits.max_head_bytes} bytes", "head_too_large")

    def on_headers_complete(self) -> None:
        parser, headers, limits = self.parser, self._headers, self.limits
        keep_alive = parser.should_keep_alive()
        # kept alive with neither Connection nor Proxy-Connection: HTTP/1.1 alone among llhttp's versions (RFC 9112
        # §9.3, llhttp_should_keep_alive); asking formats a string (~2,200 instructions: docs/hot-path.md, 25i)
        version = "1.1" if keep_alive and "connection" not in headers and "proxy-connection" not in headers \
            else parser.get_http_version()
        if version not in ("1.1", "1.0"):  # 0.9 means a request line without a version
            raise BadRequest(505 if version >= "2" else 400, f"HTTP/{version} is not supported; use HTTP/1.1",
                             "version")
        if version == "1.1" and "host" not in headers:
            raise BadRequest(400, "HTTP/1.1 request without a Host header", "host")
        te = headers.get("transfer-encoding")
        if te is not None and te.strip().lower() != "chunked":
            raise BadRequest(501, f"unsupported Transfer-Encoding {te[:40]!r}; only 'chunked' is accepted",
                             "transfer_coding")
        length = headers.get("content-length")
        if length is not None and int(length) > limits.max_body_bytes:  # llhttp checked the digits
            raise BadRequest(413, f"request body exceeds the limit of {limits.max_body_bytes} bytes", "body_too_large")
        self._in_trailers = True
        self._head_seen = self._stall = 0
        self.phase = _BODY
        self.deadline = self.server.now + limits.body_timeout_s
        self._req = Request(httpmsg.method_name(parser.get_method()), self._url.decode("latin-1"), headers, keep_alive)
        if (te is not None or (length is not None and length != "0")) and \
                headers.get("expect", "").lower() == "100-continue" and not self.busy:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, data: bytes) -> None:
        self._stall = 0
        self._body_len += len(data)
        if self._body_len > self.limits.max_body_bytes:
            raise BadRequest(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes",
                             "body_too_large")
        self._body.append(data)

    def on_message_complete(self) -> None:
        req = self._req
        assert req is not None  # llhttp completes only messages whose head it reported
        self._req = None
        req.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self._head_seen = 0
        self.pending.append(req)
        self.phase, self.deadline = _BUSY, math.inf
        if not self.busy:
            self._next()
        else:
            self._stop_reading()  # a complete request already waits: read no further ahead

    # -- failures -------------------------------------------------------------------------------
    def _fail(self, exc: BadRequest) -> None:
        """Stop reading; answer the error after the requests before it, then close. A partial body
        is dropped now: it is never used."""
        self.rejection = exc
        self._body = []
        self.server.rejections.record(exc.status, exc.reason, self.client, str(exc), time.monotonic())
        self._stop_reading()
        if not self.busy:
            self._next()

    def _stop_reading(self) -> None:
        if self.reading and not self.closed:
            self.reading = False
            self.transport.pause_reading()

    def expire(self) -> None:
        """A deadline passed: a half-sent request gets 408; an idle or silent connection, or one
        whose client left an answer unread, is just closed."""
        if self.phase in (_HEAD, _BODY) and not self.busy:
            what = "head" if self.phase == _HEAD else "body"
            self.server.rejections.record(408, f"{what}_timeout", self.client,
                                          f"the request {what} did not arrive in time", time.monotonic())
            Responder(self, keep_alive=False).send(408, error_body(f"request {what} not received in time"))
        self.closed = True
        self._body = []
        self.transport.close()
