"""GET over the gateway's lean upstream client (``gateway/upstream.py``): what its probes read of a
replica (the metrics page, /v1/models), on the replica's own keep-alive pool.

Why: over aiohttp a probe cost about 360 k instructions of the gateway's CPU, against about 150 k
for a whole proxied request (issue 25, docs/hot-path.md "Seventh round"); at the default 100 ms
probe interval that was ~3.5 % of the gateway's CPU per request at 1,400 requests/s. This
exchange is the request path's own: one request head written out, llhttp parsing the answer.

What the probes had from aiohttp and keep:

- one **total** timeout over connecting, every redirect and the whole body: ``TimeoutError``
  when it runs out, as aiohttp's ``ClientTimeout(total=…)`` raised;
- **redirects** followed (301, 302, 303, 307, 308; up to 10, aiohttp's default), since a
  Starlette mount such as vLLM's ``/metrics`` can answer 307 to ``/metrics/``; a redirect to
  another origin (scheme, host, port) is not followed — the probe sees the 3xx and fails;
- the pool's TLS context, and a reused connection found closed before any byte answered
  retried once on a fresh one (the pool's rule for requests);
- errors by kind: nothing listening is an ``UpstreamConnectError`` (aiohttp's
  ``ClientConnectorError``), anything malformed or cut short an ``UpstreamProtocolError``.

The text is decoded as aiohttp's ``text()`` does: the charset the Content-Type names (one
Python does not know: UTF-8), else UTF-8, strictly (``UnicodeDecodeError``).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from typing import NamedTuple
from urllib.parse import quote, urljoin, urlsplit

from kvroute.gateway.upstream import RawHeaders, UpstreamPool, UpstreamProtocolError, UpstreamResponse
from kvroute.gateway.upstream import _StaleConnection as StaleConnection

REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 10  # aiohttp's default
# RFC 3986 reserved and sub-delimiter characters stay as written, '%' too (already escaped); the
# rest (the ``[]`` of vLLM's ``name[]=`` filter, spaces) is percent-encoded, as aiohttp's URL did
_SAFE = "/?#&=:@!$'()*+,;%~"


class Fetched(NamedTuple):
    """One GET's answer: status, fields as they came, the whole body."""

    status: int
    headers: RawHeaders
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        """The first field named ``name`` (lower case), or None."""
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None

    def text(self) -> str:
        """The body decoded by the Content-Type's charset, else UTF-8 (strict)."""
        encoding = "utf-8"
        ctype = self.header(b"content-type")
        if ctype is not None:
            for param in ctype.decode("latin-1").split(";")[1:]:
                key, _, value = param.partition("=")
                if key.strip().lower() == "charset" and value.strip():
                    with contextlib.suppress(LookupError):  # a charset Python does not know: UTF-8
                        encoding = codecs.lookup(value.strip().strip('"')).name
        return self.body.decode(encoding)


async def get(pool: UpstreamPool, path: str, timeout_s: float,
              fields: bytes = b"Accept-Encoding: identity\r\n") -> Fetched:
    """GET ``path`` (with its query) from ``pool``'s upstream, following same-origin redirects,
    all within ``timeout_s`` (else ``TimeoutError``). ``fields``: extra request head lines."""
    async with asyncio.timeout(timeout_s):
        got = await _once(pool, path, timeout_s, fields)
        for _ in range(MAX_REDIRECTS):
            if got.status not in REDIRECTS:
                break
            location = got.header(b"location")
            target = _same_origin(pool, path, location.decode("latin-1")) if location else None
            if target is None:
                break
            path = target
            got = await _once(pool, path, timeout_s, fields)
        return got


def _same_origin(pool: UpstreamPool, path: str, location: str) -> str | None:
    """``location`` (relative to ``path``) as a path and query on ``pool``'s origin; None when it
    points elsewhere."""
    scheme = "https" if pool.tls is not None else "http"
    url = urlsplit(urljoin(f"{scheme}://{pool.authority.decode()}{path}", location))
    if url.scheme != scheme or (url.hostname or "") != pool.host or (url.port or pool.port) != pool.port:
        return None
    return (url.path or "/") + (f"?{url.query}" if url.query else "")


async def _once(pool: UpstreamPool, path: str, timeout_s: float, fields: bytes) -> Fetched:
    """One request and its whole answer; the caller's ``asyncio.timeout`` bounds it."""
    head = b"".join((b"GET ", quote(path, safe=_SAFE).encode("ascii"), b" HTTP/1.1\r\nHost: ", pool.authority,
                     b"\r\n", fields, b"\r\n"))
    conn = pool._pooled()
    reused = conn is not None
    if conn is None:
        conn = await pool._connect(timeout_s)
    while True:
        head_fut = conn.begin(reused)
        conn.transport.write(head)
        try:
            status, headers = await head_fut
        except StaleConnection:  # the upstream had closed it: once more, on a new connection
            pool.stale_retries += 1
        except BaseException:  # cancelled (the total timeout) or failed: the connection is done with
            conn.abort(UpstreamProtocolError("probe abandoned"))
            raise
        else:
            resp = UpstreamResponse(conn, status, headers, timeout_s)
            try:
                return Fetched(status, headers, await resp.read(timeout_s))
            finally:
                resp.release()  # back to the pool when read to its end, else closed
        conn, reused = await pool._connect(timeout_s), False
