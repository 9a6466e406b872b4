"""The upstream client's errors, from general to specific (the gateway retries them by kind)::

    UpstreamError
    ├── UpstreamConnectError    could not connect: nothing reached the engine
    ├── UpstreamTimeout         connect, first byte or idle time ran out
    └── UpstreamProtocolError   not valid HTTP, or closed before the response was complete

``gateway/upstream.py`` raises them (and re-exports them, where callers import them from).
"""

from __future__ import annotations

from kvroute.errors import ServiceError


class UpstreamError(ServiceError):
    """An upstream attempt failed."""


class UpstreamConnectError(UpstreamError):
    """The connection could not be opened."""


class UpstreamTimeout(UpstreamError):
    """Connect, first byte or idle time ran out."""


class UpstreamProtocolError(UpstreamError):
    """The upstream sent something that is not valid HTTP, or closed before the response ended."""


class _StaleConnection(UpstreamProtocolError):
    """A reused keep-alive connection was closed by the upstream before any response byte."""
