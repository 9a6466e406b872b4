"""What the gateway's HTTP server refuses, and how it accounts for it: connections per client
address, and every refusal counted by status and reason and logged without flooding the log.

Kept apart from ``gateway/http.py`` so the protocol stays about bytes and phases; nothing here
does I/O beyond one log call (the caller passes the clock).
"""

from __future__ import annotations

import logging


class ClientCounts:
    """Open connections per client address (the peer's IP; a Unix socket or an unknown peer counts
    as the address ``""``). ``add`` refuses once an address holds ``limit`` connections: one
    address cannot take every slot of ``max_connections`` (nginx's ``limit_conn`` by
    ``$binary_remote_addr`` does the same). Behind a front proxy every connection has the proxy's
    address, so there the limit should equal ``max_connections``."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def add(self, client: str, limit: int) -> bool:
        """Count one more connection from ``client``; False (nothing counted) at ``limit``."""
        n = self.open.get(client, 0)
        if n >= limit:
            return False
        self.open[client] = n + 1
        return True

    def remove(self, client: str) -> None:
        """One connection from ``client`` closed."""
        n = self.open.get(client, 0) - 1
        if n > 0:
            self.open[client] = n
        else:
            self.open.pop(client, None)  # an address with no connection holds no memory


class Rejections:
    """Refused requests and connections, counted by ``(status, reason)`` for ``/metrics``
    (``kvroute_http_rejected``), and logged at most once per ``interval_s`` per reason; the line
    says how many more of that reason were refused since the last one, so a flood costs a bounded
    number of log lines and none goes unaccounted."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.counts: dict[tuple[int, str], int] = {}
        self.log = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}  # reason → when it was last logged
        self._quiet: dict[str, int] = {}  # reason → refusals not logged since

    def record(self, status: int, reason: str, client: str, detail: str, now: float) -> None:
        """Count one refusal; log it unless this reason was logged less than ``interval_s`` ago."""
        key = (status, reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        if now - self._last.get(reason, -self.interval_s) < self.interval_s:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        self._last[reason] = now
        quiet = self._quiet.pop(reason, 0)
        more = f" ({quiet} more refused for this reason since the last line)" if quiet else ""
        self.log.warning("refused %s from %s: %s%s", f"{status} {reason}", client or "an unknown address", detail,
                         more)
