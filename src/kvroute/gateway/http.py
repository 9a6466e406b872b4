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
import ssl
from typing import Any

from kvroute.gateway.httpconn import _Connection
from kvroute.gateway.httpmsg import (
    REASONS,
    BadRequest,
    Handler,
    HTTPLimits,
    Request,
    Responder,
    ServerState,
    error_body,
    error_object,
    log,
    origin_form,
)

__all__ = ["REASONS", "BadRequest", "HTTPLimits", "HTTPServer", "Handler", "Request", "Responder", "ServerState",
           "_Connection", "error_body", "error_object", "origin_form"]


class HTTPServer(ServerState):
    """Accepts connections and hands each complete request to ``handler``."""

    def __init__(self, handler: Handler, limits: HTTPLimits | None = None):
        super().__init__(handler, limits or HTTPLimits())
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
        server: Any = self._server  # its sockets: a list under uvloop, a tuple under asyncio
        bound: int = server.sockets[0].getsockname()[1]
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
        workers = []
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
            if conn.task is not None and not conn.task.done():
                conn.task.cancel()  # its worker, idle between requests or working
                workers.append(conn.task)
        if workers:  # let them end before the loop may
            await asyncio.wait(workers, timeout=1.0)
        if self._server is not None:
            await self._server.wait_closed()
