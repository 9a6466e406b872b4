"""Region-to-region round-trip times, applied to client→LB, LB→replica and LB→LB hops.

Defaults (SkyWalker §2 and public inter-region latencies): US–EU ~80 ms, US–Asia ~150 ms,
EU–Asia ~200 ms, within a region 2 ms (1–3 ms). A hop costs half the RTT each way.
"""

from __future__ import annotations

DEFAULT_RTT_MS = {("us", "eu"): 80.0, ("us", "asia"): 150.0, ("eu", "asia"): 200.0}
DEFAULT_IN_REGION_MS = 2.0
DEFAULT_CROSS_MS = 150.0  # regions with no configured pair


class Network:
    """Symmetric RTT matrix between regions, with an in-region RTT and a default for unlisted pairs."""

    def __init__(self, rtt_ms: dict[tuple[str, str], float] | None = None,
                 in_region_ms: float = DEFAULT_IN_REGION_MS, default_ms: float = DEFAULT_CROSS_MS):
        self.in_region_ms = in_region_ms
        self.default_ms = default_ms
        self._rtt: dict[tuple[str, str], float] = {}
        for (a, b), ms in (DEFAULT_RTT_MS if rtt_ms is None else rtt_ms).items():
            self._rtt[(a, b)] = self._rtt[(b, a)] = ms
        self._one_way: dict[tuple[str, str], float] = {}  # memo: one_way runs several times per request

    def rtt(self, a: str, b: str) -> float:
        """Round-trip time in seconds."""
        if a == b:
            return self.in_region_ms / 1000.0
        return self._rtt.get((a, b), self.default_ms) / 1000.0

    def one_way(self, a: str, b: str) -> float:
        """One-way delay in seconds (half the RTT), memoised."""
        v = self._one_way.get((a, b))
        if v is None:
            v = self._one_way[(a, b)] = self.rtt(a, b) / 2.0
        return v
