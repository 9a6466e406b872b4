"""Region-to-region round-trip times, applied to client→LB, LB→replica and LB→LB hops.

Defaults (SkyWalker §2 and public inter-region latencies): US–EU ~80 ms, US–Asia ~150 ms,
EU–Asia ~200 ms, within a region 2 ms (1–3 ms). A hop costs half the RTT each way.

Load balancers see RTTs the way the gateway does: as an EWMA (α = 0.3, GORGO's smoothing and
the gateway's default) of probe round trips. A probe's round trip is the configured RTT, varied
by ``jitter`` (a uniform ±share, seeded) when set; with no jitter the EWMA is the RTT itself.
"""

from __future__ import annotations

import random

from pydantic import Field, field_validator

from kvroute.schema import StrictModel

DEFAULT_RTT_MS = {("us", "eu"): 80.0, ("us", "asia"): 150.0, ("eu", "asia"): 200.0}
DEFAULT_IN_REGION_MS = 2.0
DEFAULT_CROSS_MS = 150.0  # regions with no configured pair
RTT_EWMA = 0.3  # weight of a new probe round trip in a balancer's RTT estimate


class Network:
    """Symmetric RTT matrix between regions, with an in-region RTT and a default for unlisted
    pairs; ``jitter`` varies each probe's round trip by up to ± that share (seeded)."""

    def __init__(self, rtt_ms: dict[tuple[str, str], float] | None = None,
                 in_region_ms: float = DEFAULT_IN_REGION_MS, default_ms: float = DEFAULT_CROSS_MS,
                 jitter: float = 0.0, seed: int = 0):
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.jitter = jitter
        self._rng = random.Random(seed)
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

    def probe_rtt(self, a: str, b: str) -> float:
        """One probe's measured round trip in seconds (the RTT, ± jitter)."""
        rtt = self.rtt(a, b)
        return rtt * (1.0 + self.jitter * (2.0 * self._rng.random() - 1.0)) if self.jitter else rtt

    def one_way(self, a: str, b: str) -> float:
        """One-way delay in seconds (half the RTT), memoised."""
        v = self._one_way.get((a, b))
        if v is None:
            v = self._one_way[(a, b)] = self.rtt(a, b) / 2.0
        return v


class NetworkSpec(StrictModel):
    """Round-trip times between regions as a user file gives them (a scenario's or a deployment's
    ``network:``); :meth:`model` turns them into a :class:`Network`."""

    rtt_ms: dict[str, float] = Field(default_factory=lambda: {"us-eu": 80.0, "us-asia": 150.0, "eu-asia": 200.0},
                                     description="round-trip time per region pair, keys `regionA-regionB`; a pair "
                                     "not listed costs 150 ms")
    in_region_ms: float = Field(2.0, ge=0, description="round-trip time within a region")

    @field_validator("rtt_ms")
    @classmethod
    def _pairs(cls, v: dict[str, float]) -> dict[str, float]:
        for k, ms in v.items():
            if k.count("-") != 1 or ms < 0:
                raise ValueError(f"rtt_ms keys are 'regionA-regionB' with a non-negative value; got {k!r}: {ms}")
        return v

    def model(self) -> Network:
        """The RTT matrix as the simulator's ``Network`` (pairs split at their one dash)."""
        pairs = {}
        for key, ms in self.rtt_ms.items():
            a, _, b = key.partition("-")
            pairs[(a, b)] = ms
        return Network(pairs, self.in_region_ms)
