"""The client's response as a continuation leg sees it (``gateway/continuation.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


class LegResponder:
    """The client's response as a continuation leg writes to it: already started, so a leg's
    ``start`` is a no-op and what would have been an error response is kept (``refusal``) for
    the gateway to end the stream with as an SSE error event."""

    def __init__(self, resp: Any):
        self.resp = resp
        self.started = True
        self.refusal: tuple[str, str] | None = None  # (message, code)
        self.extra_headers = resp.extra_headers
        self._on_first: Callable[[], None] | None = None

    def next_leg(self, on_first: Callable[[], None]) -> None:
        """A new leg begins: ``on_first`` runs once, when it passes its first bytes on (or at
        ``begun``), so what counts the continuation does so before the client sees that leg."""
        self._on_first = on_first

    def begun(self) -> None:
        """The leg has started its stream: run ``next_leg``'s callback if it has not run yet."""
        on_first, self._on_first = self._on_first, None
        if on_first is not None:
            on_first()

    @property
    def status(self) -> int:
        """The status the client got (the first leg's)."""
        return int(self.resp.status)

    @property
    def finished(self) -> bool:
        """Whether the client's response has ended."""
        return bool(self.resp.finished)

    def start(self, status: int, headers: Any = (), content_type: str | None = None, fields: bytes = b"") -> None:
        """Already started: nothing to do."""

    async def write(self, data: bytes) -> None:
        """Pass a chunk to the client's stream."""
        if self._on_first is not None:
            self.begun()
        await self.resp.write(data)

    def push(self, data: bytes) -> bool:
        """Pass a chunk on without waiting; True when the client's buffer is full."""
        if self._on_first is not None:
            self.begun()
        return bool(self.resp.push(data))

    async def drain(self) -> None:
        """Wait until the client has read enough to write on."""
        await self.resp.drain()

    async def end(self) -> None:
        """End the client's stream."""
        await self.resp.end()

    def send(self, status: int, body: bytes, headers: Any = (), content_type: str | None = None,
             fields: bytes = b"") -> None:
        """A whole response cannot follow a started one: keep its message as the refusal."""
        try:
            error = json.loads(body).get("error") or {}
            message, code = str(error.get("message")), str(error.get("code") or "upstream_error")
        except (ValueError, AttributeError):
            message, code = body[:200].decode("utf-8", "replace"), "upstream_error"
        self.refusal = (f"continuation answered {status}: {message}", code)

    def send_error(self, status: int, message: str, type_: str = "server_error", param: str | None = None,
                   code: str | None = None, headers: Any = ()) -> None:
        """Keep an error the gateway would have answered with as the refusal."""
        self.refusal = (message, code or "continuation_failed")
