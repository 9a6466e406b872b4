"""The gateway's HTTP/1.1 server: llhttp (via ``httptools``) behind a lean asyncio protocol.

Parsing is llhttp in its strict default mode, the parser behind uvicorn and Node.js, so the
framing rules that stop request smuggling are the ones the rest of the ecosystem applies:
Content-Length together with Transfer-Encoding, duplicate or malformed Content-Length, a
Transfer-Encoding whose last coding is not ``chunked``, obs-fold, bare CR or LF, NUL and other
control characters in a header, malformed chunk sizes — each is a 400 and the connection is
closed. On top of llhttp this module adds what a parser cannot know: a transfer coding other than
plain ``chunked`` is refused (501), HTTP/1.1 without exactly one Host header is a 400, a version
other than 1.0/1.1 is a 505.

Every resource a client can hold is bounded (defaults in ``HTTPLimits``): head bytes and header
count (counted from the parsed fields, so independent of how reads arrive; bytes of a field not
yet complete count too), the chunk framing and trailer section of a body under the same limit,
body bytes, the time to send a head (slowloris; a new connection that sends nothing is held to
it too), the time to send a body, idle keep-alive time, concurrent connections in all (at the cap, the
longest-held connection that holds no request makes room) and per client address
(``gateway/limits.py``), and pipelining: reading pauses while a complete request
waits behind a running one, and the next request is not started while the client leaves the
last answer unread (uvicorn's flow control does the same), so a client that sends without
reading costs one answer, not one per request. Deadlines are checked by one sweep per server
rather than a timer per request, which keeps the per-request cost at assigning one float.

A closed connection lets go of its parser and any partial body at once: the parser holds the
connection's callbacks, a reference cycle that would otherwise keep an aborted body alive until
the cyclic GC happens to run. Every refusal (400/408/413/429/431/501/503/505) is counted by status
and reason and logged at a bounded rate (``limits.Rejections``).

Why not aiohttp's web server: on this project's 2-core machines it spends about 50 µs of CPU per
trivial request against about 20 µs here, most of a proxy hop's budget (``kvroute bench
gateway``). aiohttp still serves the engine emulator and carries the gateway's probes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import cast

import httptools

from kvroute.errors import ClientError
from kvroute.gateway.limits import ClientCounts, Rejections

log = logging.getLogger("kvroute.gateway")

REASONS = {100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
           404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required",
           413: "Payload Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported"}


@dataclass(frozen=True)
class HTTPLimits:
    """What one client may hold. Defaults follow the common servers: 64 KiB of head and 100
    header fields (nginx/uvicorn allow less or about as much), 10 s to send a head (nginx's
    client_header_timeout is 60 s; a proxy for API clients needs far less), 60 s for a body,
    30 s idle keep-alive (uvicorn 5 s, nginx 75 s); a quarter of the connections per client address."""

    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    max_body_bytes: int = 16 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 30.0
    max_connections: int = 4096
    max_connections_per_client: int = 1024


def error_object(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict[str, dict[str, str | None]]:
    """The OpenAI error shape, ``{"error": {message, type, param, code}}``: the one place every
    component (gateway, continuation, emulator, controller) builds it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> bytes:
    """:func:`error_object` as a JSON response body."""
    return json.dumps(error_object(message, type_, param, code)).encode()


class BadRequest(ClientError):
    """The request cannot be read to its end: answer ``status`` and close the connection.
    ``reason`` is the short label it is counted under (``kvroute_http_rejected``)."""

    def __init__(self, status: int, message: str, reason: str = "malformed"):
        super().__init__(message, status)
        self.reason = reason


class Request:
    """One parsed request: method, path and query, lower-cased header names, the whole body."""

    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive")

    def __init__(self, method: str, target: str, headers: dict[str, str], keep_alive: bool):
        self.method = method
        if target[:1] != "/" and target[:8].lower().startswith(("http://", "https://")):
            target = origin_form(target)
        self.path, _, self.query = target.partition("?")
        self.headers = headers
        self.body = b""
        self.keep_alive = keep_alive


def origin_form(target: str) -> str:
    """``http://host:port/p?q`` → ``/p?q``: a server must accept a request target in absolute form
    (RFC 9112 §3.2.2); the authority names this gateway, so only the path and query matter."""
    rest = target[target.index("//") + 2:]
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    tail = rest[cut:]
    return tail if tail.startswith("/") else "/" + tail


class Responder:
    """Writes the response to one request: either ``send`` (whole body) or ``start`` / ``write``
    / ``end`` (chunked stream). The response to a HEAD request (``head_only``) is its head alone,
    with the headers a GET would get (RFC 9110 §9.3.2): a body there would be read by a kept-alive
    client as the next response."""

    __slots__ = ("_conn", "keep_alive", "head_only", "status", "started", "finished", "extra_headers")

    def __init__(self, conn: _Connection, keep_alive: bool, head_only: bool = False):
        self._conn = conn
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.status = 0
        self.started = False
        self.finished = False
        self.extra_headers: list[tuple[str, str]] = []

    def _head(self, status: int, headers: Iterable[tuple[str, str]], content_type: str | None,
              length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
        if content_type:
            lines.append(f"Content-Type: {content_type}")
        for name, value in (*headers, *self.extra_headers):
            lines.append(f"{name}: {value}")
        lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
        if not self.keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = (),
             content_type: str | None = "application/json") -> None:
        """The whole response at once."""
        if self.started:
            raise RuntimeError("response already started")
        self.status, self.started, self.finished = status, True, True
        head = self._head(status, headers, content_type, len(body))
        self._conn.write(head if self.head_only else head + body)

    def send_error(self, status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: Iterable[tuple[str, str]] = ()) -> None:
        """An OpenAI-style error response."""
        self.send(status, error_body(message, type_, param, code), headers)

    def start(self, status: int, headers: Iterable[tuple[str, str]] = (), content_type: str | None = None) -> None:
        """Begin a chunked response."""
        self.status, self.started = status, True
        self._conn.write(self._head(status, headers, content_type, None))

    async def write(self, data: bytes) -> None:
        """One chunk of a started response; waits while the client's socket buffer is full."""
        if data and not self.head_only:
            conn = self._conn
            conn.write(b"%x\r\n%b\r\n" % (len(data), data))
            if conn.paused:
                await conn.drained()

    async def end(self) -> None:
        """The last chunk."""
        if not self.finished:
            self.finished = True
            if not self.head_only:
                self._conn.write(b"0\r\n\r\n")


Handler = Callable[[Request, Responder], Awaitable[None]]

# connection phases, for deadlines: _NEW has sent nothing yet (held to the head deadline, counted
# from the accept); _IDLE waits between kept-alive requests
_IDLE, _HEAD, _BODY, _BUSY, _NEW = 0, 1, 2, 3, 4
LINGER_S = 1.0  # a refused connection is read and discarded this long, so the refusal is not lost to a reset
MAX_LINGERING = 256  # refused connections lingering at once; beyond, they are closed at once
# a read this large means the client has more queued: let the other connections (and new ones) have
# a turn before reading on; otherwise the loop reads up to 32 such buffers per connection per turn
_BIG_READ = 64 * 1024
_DETACHED = httptools.HttpRequestParser(object())  # a closed connection's parser: holds no callbacks


class _Connection(asyncio.Protocol):
    """One client connection: llhttp callbacks build requests; handlers run one at a time, in
    order (pipelining); deadlines are set per phase and enforced by ``HTTPServer._sweep``."""

    transport: asyncio.Transport  # set by connection_made

    def __init__(self, server: HTTPServer):
        self.server = server
        self.limits = server.limits
        self.parser = httptools.HttpRequestParser(self)  # holds our callbacks: dropped by connection_lost
        self.client = ""  # the peer's address
        self.counted = False  # in server.connections and server.clients
        self.lingering = False  # refused: reading and discarding until LINGER_S passes
        self.pending: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.paused = False
        self.reading = True
        self._drain: asyncio.Future[None] | None = None
        self.phase = _IDLE
        self.deadline = math.inf
        self.rejection: BadRequest | None = None  # answered once the requests before it are
        self.upgraded = False
        # the request being parsed
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._n_headers = 0
        self._head_seen = 0  # raw bytes received while a head is incomplete (unterminated fields)
        self._stall = 0  # raw bytes of a body since its last data: chunk framing, trailers
        self._in_trailers = False
        self._body: list[bytes] = []
        self._body_len = 0
        self._req: Request | None = None

    # -- transport events ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        server, limits = self.server, self.limits
        peer = transport.get_extra_info("peername")
        self.client = client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not server.clients.add(client, limits.max_connections_per_client):
            self._refuse(503, "too_many_client_connections", _TOO_MANY_CLIENT,
                         f"the address holds its limit of {limits.max_connections_per_client} connections")
            return
        if len(server.connections) >= limits.max_connections:
            # at the cap, a connection that holds no request (silent since its accept, or idle
            # between requests) makes room, the longest-held first, as nginx reuses its idle
            # keep-alive connections: a flood of silent connections from many addresses cannot
            # lock new clients out; only when every connection is mid-request is the answer 503
            victim = next(iter(server.idle), None)
            if victim is None:
                server.clients.remove(client)
                self._refuse(503, "too_many_connections", _TOO_MANY,
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
        # the parser holds this connection's callbacks (a reference cycle): drop it, and any partial
        # body, now rather than whenever the cyclic GC runs
        self.parser = _DETACHED
        self._body = []
        self._req = None
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: stop working for it
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drained(self) -> None:
        """Wait until the client has read enough of what was written."""
        if self.closed:
            raise ConnectionResetError("client disconnected")
        self._drain = asyncio.get_running_loop().create_future()
        await self._drain

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

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
        except httptools.HttpParserError as exc:
            self._fail(BadRequest(400, f"malformed HTTP request: {exc}", "malformed"))
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
        self._count_head(len(name) + len(value) + 4)
        self._n_headers += 1
        if self._n_headers > limits.max_headers:
            raise BadRequest(431, f"more than {limits.max_headers} header fields", "too_many_headers")
        if self._in_trailers:
            return  # legal, counted against the head limits, not used
        key = name.decode("latin-1").lower()
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
        version = parser.get_http_version()
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
            raise BadRequest(413, f"request body exceeds the limit of {limits.max_body_bytes} bytes",
                             "body_too_large")
        self._in_trailers = True
        self._head_seen = 0
        self._stall = 0
        self.phase = _BODY
        self.deadline = self.server.now + limits.body_timeout_s
        self._req = Request(parser.get_method().decode("ascii"), self._url.decode("latin-1"), headers,
                            parser.should_keep_alive())
        if (te is not None or (length is not None and length != "0")) and \
                headers.get("expect", "").lower() == "100-continue" and self.task is None:
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
        if self.task is None:
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
        if self.task is None:
            self._next()

    def _stop_reading(self) -> None:
        if self.reading and not self.closed:
            self.reading = False
            self.transport.pause_reading()

    def _idle(self) -> None:
        if self.counted:
            self.server.idle[self] = None  # the newest idle one: evicted last
        self.phase = _IDLE
        self.deadline = self.server.now + self.limits.keepalive_timeout_s

    def expire(self) -> None:
        """A deadline passed: a half-sent request gets 408; an idle or silent connection, or one
        whose client left an answer unread, is just closed."""
        if self.phase in (_HEAD, _BODY) and self.task is None:
            what = "head" if self.phase == _HEAD else "body"
            self.server.rejections.record(408, f"{what}_timeout", self.client,
                                          f"the request {what} did not arrive in time", time.monotonic())
            Responder(self, keep_alive=False).send(408, error_body(f"request {what} not received in time"))
        self.closed = True
        self._body = []
        self.transport.close()

    # -- handling ---------------------------------------------------------------------------------
    def _next(self) -> None:
        if self.closed:
            self.task = None
            return
        if not self.pending:
            self.task = None
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
            return
        req = self.pending.popleft()
        self.phase, self.deadline = _BUSY, math.inf
        self.task = asyncio.get_running_loop().create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        server = self.server
        keep_alive = req.keep_alive and not server.closing and not self.upgraded
        resp = Responder(self, keep_alive, req.method == "HEAD")
        server.active += 1
        try:
            await server.handler(req, resp)
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
            log.exception("unhandled error on %s %s", req.method, req.path)
            server.errors += 1
            if not resp.started:
                resp.keep_alive = False
                resp.send(500, error_body("internal gateway error", "server_error"))
            self.transport.close()
            return
        finally:
            server.active -= 1
            if server.idle_waiter is not None and server.active == 0 and not server.idle_waiter.done():
                server.idle_waiter.set_result(None)
        if not resp.keep_alive:
            self.closed = True
            self.transport.close()
            return
        if self.paused and not self.closed:
            # the client has not read this answer: start no other one until it does (a client that
            # pipelines without reading would otherwise have every answer buffered here), and give
            # it the keep-alive time to read
            self.deadline = server.now + self.limits.keepalive_timeout_s
            try:
                await self.drained()
            except ConnectionResetError:
                return
            self.deadline = math.inf
        self._next()


_TOO_MANY = error_body("too many connections to the gateway; retry shortly", "server_error",
                       code="too_many_connections")
_TOO_MANY_CLIENT = error_body("too many connections from this address; close some or retry shortly",
                              "server_error", code="too_many_client_connections")


class HTTPServer:
    """Accepts connections and hands each complete request to ``handler``."""

    def __init__(self, handler: Handler, limits: HTTPLimits | None = None):
        self.handler = handler
        self.limits = limits or HTTPLimits()
        self.connections: set[_Connection] = set()
        self.active = 0
        self.closing = False
        self.clients = ClientCounts()  # open connections per client address
        self.idle: dict[_Connection, None] = {}  # connections holding no request, longest-held first
        self.rejections = Rejections(log)  # refusals by (status, reason), logged at a bounded rate
        self.lingering = 0  # refused connections still being read and discarded
        self.errors = 0  # handler exceptions answered 500
        self.idle_waiter: asyncio.Future[None] | None = None
        self.now = 0.0  # the loop's clock as of the last sweep: deadlines need no finer grain
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen (with TLS when given a context); returns the bound port."""
        loop = asyncio.get_running_loop()
        self.now = loop.time()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                backlog=1024, ssl=tls,  # a silent TLS client: the head deadline
                                                ssl_handshake_timeout=self.limits.header_timeout_s if tls else None)
        self._sweeper = loop.create_task(self._sweep())
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def _sweep(self) -> None:
        """Close connections whose deadline passed; granularity is a quarter of the shortest
        timeout, capped at 0.5 s."""
        loop = asyncio.get_running_loop()
        lim = self.limits
        step = min(0.5, lim.header_timeout_s / 4, lim.body_timeout_s / 4, lim.keepalive_timeout_s / 4)
        while True:
            await asyncio.sleep(step)
            self.now = now = loop.time()
            for conn in [c for c in self.connections if c.deadline <= now]:
                if not conn.closed:
                    conn.expire()

    async def stop_accepting(self) -> None:
        """Close the listening socket; open connections keep being served."""
        self.closing = True
        if self._server is not None:
            self._server.close()

    async def wait_idle(self, timeout: float) -> None:
        """Wait (bounded) until no handler is running."""
        if self.active:
            self.idle_waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self.idle_waiter, timeout)
            except TimeoutError:
                log.warning("drain timed out with %d request(s) still running", self.active)

    async def close(self) -> None:
        """Stop accepting and close every connection."""
        await self.stop_accepting()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
