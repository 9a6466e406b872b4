"""HTTP messages of the gateway's server (``gateway/http.py``): the parsed :class:`Request`, the
:class:`Responder` that writes its answer (whole, or chunked for streams), the client limits
(:class:`HTTPLimits`), the refusal a parser callback raises (:class:`BadRequest`) and the one
place the OpenAI error shape is built (:func:`error_object`)."""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvroute.errors import ClientError
from kvroute.gateway.limits import ClientCounts, Rejections

log = logging.getLogger("kvroute.gateway")

REASONS = {100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
           404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout", 411: "Length Required",
           413: "Payload Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported"}


# response heads are assembled from bytes: the status lines and the usual content types made once
_STATUS_LINES: Final = {status: f"HTTP/1.1 {status} {reason}\r\n".encode() for status, reason in REASONS.items()}
_CONTENT_TYPES: Final = {t: f"Content-Type: {t}\r\n".encode() for t in ("application/json", "text/event-stream")}

# a field name as it came → its lowered text: clients send the same few names on every request, and a lookup
# costs less than a decode and a lower (and the key's hash is then cached). Bounded: later names are lowered each time
_NAMES: Final[dict[bytes, str]] = {}
_NAMES_MAX: Final = 256


def field_name(name: bytes) -> str:
    """A request header field's name as the handlers see it: decoded (latin-1) and lowered."""
    key = _NAMES.get(name)
    if key is None:
        key = name.decode("latin-1").lower()
        if len(_NAMES) < _NAMES_MAX:
            _NAMES[name] = key
    return key


def method_name(raw: bytes) -> str:
    """A request's method as llhttp read it (it accepts only its known methods, ASCII), as text: ``POST``,
    the proxied endpoints' method, without a decode (~230 instructions in the compiled build; eleventh round)."""
    return "POST" if raw == b"POST" else raw.decode("ascii")


class FieldNames:
    """A connection's request field names as handlers see them (:func:`field_name`), with the names of
    its last request's head in order: a kept-alive client sends the same names in the same order every
    time, so a name is first compared with the one at its place last time — a memory comparison, where
    ``field_name``'s lookup hashes each new bytes object (~440 instructions a field in the compiled
    build; eleventh round, docs/hot-path.md). Only a cache, at most one entry per field of a head."""

    __slots__ = ("names", "keys")

    def __init__(self) -> None:
        self.names: list[bytes] = []
        self.keys: list[str] = []

    def key(self, i: int, name: bytes) -> str:
        """The handlers' name of the head's ``i``-th field (from 0), named ``name`` as it came."""
        names = self.names
        if i < len(names) and names[i] == name:
            return self.keys[i]
        key = field_name(name)
        if i < len(names):
            names[i] = name
            self.keys[i] = key
        elif i == len(names):
            names.append(name)
            self.keys.append(key)
        return key


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


# the answers to a connection refused at the connection limits (gateway/httpconn.py)
TOO_MANY_CONNECTIONS = error_body("too many connections to the gateway; retry shortly", "server_error",
                                  code="too_many_connections")
TOO_MANY_CLIENT_CONNECTIONS = error_body("too many connections from this address; close some or retry shortly",
                                         "server_error", code="too_many_client_connections")


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


class Sink(Protocol):
    """Where a :class:`Responder` writes: a client connection (``gateway/httpconn.py``)."""

    paused: bool  # the client's socket buffer is full

    def write(self, data: bytes) -> None:
        """Queue bytes to the client."""

    async def drained(self) -> None:
        """Wait until the client has read enough to write on."""


class Responder:
    """Writes the response to one request: either ``send`` (whole body) or ``start`` / ``write``
    / ``end`` (chunked stream). The response to a HEAD request (``head_only``) is its head alone,
    with the headers a GET would get (RFC 9110 §9.3.2): a body there would be read by a kept-alive
    client as the next response."""

    __slots__ = ("_conn", "keep_alive", "head_only", "status", "started", "finished", "extra_headers", "id_line")

    def __init__(self, conn: Sink, keep_alive: bool, head_only: bool = False):
        self._conn = conn
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.status = 0
        self.started = False
        self.finished = False
        self.extra_headers: list[tuple[str, str]] = []
        # the x-request-id header line (access log on), made once as bytes: not a tuple in extra_headers
        # formatted and encoded when the head is written (tenth round, docs/hot-path.md)
        self.id_line = b""

    def _head(self, status: int, headers: Iterable[tuple[str, str]], content_type: str | None,
              length: int | None, fields: bytes, body: bytes = b"") -> bytes:
        """The response head, followed by ``body`` (joined once: no second copy to append it)."""
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Status\r\n" % status]
        if content_type:
            parts.append(_CONTENT_TYPES.get(content_type) or f"Content-Type: {content_type}\r\n".encode("latin-1"))
        for name, value in headers:
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
        parts.append(fields)
        if self.id_line:
            parts.append(self.id_line)
        for name, value in self.extra_headers:
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
        parts.append(b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length)
        parts.append(b"\r\n" if self.keep_alive else b"Connection: close\r\n\r\n")
        if body:
            parts.append(body)
        return b"".join(parts)

    def send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = (),
             content_type: str | None = "application/json", fields: bytes = b"") -> None:
        """The whole response at once; ``fields``: more header lines, formatted (``Name: value\\r\\n``)."""
        if self.started:
            raise RuntimeError("response already started")
        self.status, self.started, self.finished = status, True, True
        self._conn.write(self._head(status, headers, content_type, len(body), fields,
                                    b"" if self.head_only else body))

    def send_error(self, status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: Iterable[tuple[str, str]] = ()) -> None:
        """An OpenAI-style error response."""
        self.send(status, error_body(message, type_, param, code), headers)

    def start(self, status: int, headers: Iterable[tuple[str, str]] = (), content_type: str | None = None,
              fields: bytes = b"") -> None:
        """Begin a chunked response."""
        self.status, self.started = status, True
        self._conn.write(self._head(status, headers, content_type, None, fields))

    async def write(self, data: bytes) -> None:
        """One chunk of a started response; waits while the client's socket buffer is full."""
        if data and not self.head_only:
            conn = self._conn
            conn.write(b"%x\r\n%b\r\n" % (len(data), data))
            if conn.paused:
                await conn.drained()

    def push(self, data: bytes) -> bool:
        """One chunk of a started response, without waiting (a stream relayed from the upstream's
        read callback); True when the client's socket buffer is full: then ``drain`` before more."""
        conn = self._conn
        if data and not self.head_only:
            conn.write(b"%x\r\n%b\r\n" % (len(data), data))
        return conn.paused

    async def drain(self) -> None:
        """Wait until the client has read enough to write on (at once if it has)."""
        if self._conn.paused:
            await self._conn.drained()

    async def end(self) -> None:
        """The last chunk."""
        if not self.finished:
            self.finished = True
            if not self.head_only:
                self._conn.write(b"0\r\n\r\n")


class ServerState:
    """What a server's connections share (``gateway/http.py``'s ``HTTPServer`` adds listening,
    the deadline sweep and closing): the handler, limits, open and idle connections, counters."""

    def __init__(self, handler: Handler, limits: HTTPLimits):
        self.handler = handler
        self.limits = limits
        self.connections: set[Any] = set()  # its _Connection objects (gateway/httpconn.py)
        self.active = 0
        self.closing = False
        self.clients = ClientCounts()  # open connections per client address
        self.idle: dict[Any, None] = {}  # connections holding no request, longest-held first
        self.rejections = Rejections(log)  # refusals by (status, reason), logged at a bounded rate
        self.lingering = 0  # refused connections still being read and discarded
        self.errors = 0  # handler exceptions answered 500
        self.idle_waiter: asyncio.Future[None] | None = None
        self.now = 0.0  # the loop's clock as of the last sweep: deadlines need no finer grain


class Pending(ABC):
    """What a handler returns when callbacks, not a coroutine, finish its response (the proxy's
    callback path for a non-streamed answer: issue 25, docs/hot-path.md). The connection sets
    ``resume``, which the handler calls once: with None when the response is sent, or with a
    coroutine for the connection to await for the rest (a retry, say). If the client goes away
    first, the connection calls ``cancel`` instead, and ``resume`` is never called. Abstract: a
    subclass says how to give its exchange up (mypyc compiles an ``ABC``: docs/compiled.md)."""

    def __init__(self) -> None:
        self.resume: Callable[[Awaitable[None] | None], None] | None = None

    @abstractmethod
    def cancel(self) -> None:
        """The client went away: give the exchange up and account for it (a 499)."""


# a handler answers at once (and returns None), returns what the connection awaits, or a Pending
Handler = Callable[[Request, Responder], Awaitable[None] | Pending | None]
