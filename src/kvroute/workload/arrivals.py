"""Open-loop arrival times: Poisson, or Poisson with bursts (a two-state modulated process).

Production LLM traffic is not a steady Poisson stream: BurstGPT (Wang et al., 2024) measures
bursts of several times the mean rate lasting seconds, and the Azure traces show the same. The
bursty process here is the textbook Markov-modulated Poisson process with two states: *burst*
(rate × ``factor``) for a share ``share`` of the time, in episodes of mean ``mean_s`` seconds, and
*calm* the rest, at the rate that keeps the long-run mean equal to ``rate`` — so scaling ``rate``
(what a capacity sweep does) scales both states and the bursts stay bursts.

Without bursts the gaps are drawn exactly as before (``rng.expovariate(rate)``), so a workload
that gained this option replays the same requests for the same seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Bursts:
    """Burst episodes: ``factor`` × the mean rate for ``share`` of the time, ``mean_s`` long on average."""

    factor: float = 4.0
    share: float = 0.2
    mean_s: float = 5.0

    def __post_init__(self) -> None:
        if self.factor < 1 or not 0 < self.share < 1 or self.mean_s <= 0:
            raise ValueError("bursts: factor must be ≥ 1, share in (0, 1) and mean_s > 0")
        if self.factor * self.share > 1:
            raise ValueError(f"bursts: factor × share = {self.factor * self.share:g} > 1 leaves no traffic "
                             "for the calm periods (the mean rate would be exceeded)")


class ArrivalClock:
    """Successive arrival times at mean ``rate`` requests/s, Poisson or with ``bursts``."""

    def __init__(self, rng: random.Random, rate: float, bursts: Bursts | None = None):
        self.rng, self.rate, self.bursts = rng, rate, bursts
        self.t = 0.0
        self.burst = False
        self.until = 0.0  # when the current state ends (bursty only)
        if bursts is not None:
            self.until = self._episode()

    def _episode(self) -> float:
        b = self.bursts
        assert b is not None
        mean = b.mean_s if self.burst else b.mean_s * (1 - b.share) / b.share
        return self.t + self.rng.expovariate(1.0 / mean)

    def _state_rate(self) -> float:
        b = self.bursts
        assert b is not None
        if self.burst:
            return self.rate * b.factor
        return self.rate * (1 - b.share * b.factor) / (1 - b.share)

    def next(self) -> float:
        """The next arrival time (seconds from the start)."""
        if self.bursts is None:
            self.t += self.rng.expovariate(self.rate)
            return self.t
        while True:
            lam = self._state_rate()
            gap = self.rng.expovariate(lam) if lam > 0 else float("inf")
            if self.t + gap <= self.until:
                self.t += gap
                return self.t
            # memoryless: jump to the state change and draw afresh in the new state
            self.t = self.until
            self.burst = not self.burst
            self.until = self._episode()
