"""GORGO v2's online tuner: a (1+1) evolution strategy on the p95 TTFT of a rolling window.

GORGO v2 §2.2 (003_d2195008674d8fa4.txt) tunes the cost weights of its router while it serves:

* fitness is the p95 TTFT of a rolling window of the last 128 samples (a completed request's
  TTFT each, fed by the plugin as GORGO's proxy records them), evaluated every 32
  (§4 "Tuning and evaluation windows"); the first evaluation, at 128 samples, scores the
  starting weights (the parent), and every later one scores the offspring served during the
  last hop — 18 steps therefore take 128 + 17·32 = 672 samples, the paper's convergence point;
* an offspring perturbs each weight multiplicatively in log space,
  ``x' = clip(exp(ln x + σ·z), lo, hi)`` with z ~ N(0, 1) (Equation 4);
* it replaces the parent when it "beats" it (§2.2), and σ is "adjusted to maintain Rechenberg's
  1/5 success rule"; the details are those of the paper's released tuner (GORGO's
  gorgo/tuner.py, ``GaussianESTuner`` as ``OnlineTuner`` builds it): σ starts at 0.5, moves
  only once eight outcomes are recorded, then by their success rate (above 1/5: σ ÷ 0.817,
  below: σ × 0.817, exactly 1/5: unchanged), and the search stops (converges) once σ < 0.05;
* frozen mode serves fixed weights (the held-out evaluation: weights learned in one window,
  fixed in the next) and only keeps measuring the window's p95.

Choices where the paper is vague (also in ARCHITECTURE.md):

* ``judge``: the paper judges each step on "the p95 TTFT of a rolling 128-request window with
  hop size 32" (§4), so an offspring's score is the p95 of the whole window — its own 32 first
  tokens and the 96 served before it under earlier weights. That is the default
  (``judge="window"``). ``judge="hop"`` scores each offspring on its own hop only (the parent
  on the last hop before its first offspring): the window still carries 96 first tokens of the
  weights before an offspring, so one bad offspring's tail weighs on the next three judgements;
  the hop score is kvroute's alternative, not the paper's (GORGO's tuner.py scores the trailing
  window too). Steps come at 128 samples and then every 32 either way.
* "Beats" is the released tuner's test, ``score > best_score * (1 + 0.005)`` on score = −p95:
  with a negative score that admits an offspring whose p95 is below 1.005 × the parent's — ties
  and regressions under 0.5 % pass (``margin``; a negative margin demands an improvement).
* The parent's score is not re-measured after it is accepted (a classic (1+1)-ES).
* Lower bounds must be positive (log space); a range that "may reach 0" uses a tiny bound.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from kvroute.stats import percentile_sorted

SUCCESS_FACTOR = 0.817  # σ multiplier of the 1/5 rule (GORGO v2 tuner)
SUCCESS_HISTORY = 8  # outcomes the 1/5 rule looks back on
SUCCESS_TARGET = 0.2  # Rechenberg's 1/5


@dataclass(frozen=True, slots=True)
class WeightRange:
    """A tuned weight: where it starts and the interval it is clipped to (lo > 0)."""

    start: float
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not 0 < self.lo <= self.start <= self.hi:
            raise ValueError(f"weight range needs 0 < lo <= start <= hi, got "
                             f"lo={self.lo}, start={self.start}, hi={self.hi}")


# GORGO v2 §4: w_rtt starts at 0.5 in [0.05, 2.0], w_queue at 0.1 in [0.05, 0.5]
GORGO_RANGES: dict[str, WeightRange] = {"w_rtt": WeightRange(0.5, 0.05, 2.0),
                                        "w_queue": WeightRange(0.1, 0.05, 0.5)}


class OnePlusOneES:
    """(1+1)-ES over named positive weights, driven by observed TTFTs; deterministic under a seed.

    ``weights`` are the ones to serve now (the offspring under evaluation while tuning, the
    parent once converged or frozen). Call :meth:`observe` with every sample's TTFT.
    """

    def __init__(self, ranges: Mapping[str, WeightRange] = GORGO_RANGES, *, window: int = 128,
                 hop: int = 32, quantile: float = 0.95, sigma0: float = 0.5, sigma_min: float = 0.05,
                 margin: float = 0.005, seed: int = 0, frozen: Mapping[str, float] | None = None,
                 judge: str = "window"):
        if hop < 1 or window < hop:
            raise ValueError(f"need 1 <= hop <= window, got window={window}, hop={hop}")
        if judge not in ("window", "hop"):
            raise ValueError(f"judge must be window or hop, got {judge!r}")
        self.judge = judge
        self.ranges = dict(ranges)
        self.window_size, self.hop, self.quantile = window, hop, quantile
        self.sigma, self.sigma_min, self.margin = sigma0, sigma_min, margin
        self.rng = random.Random(seed)
        self.frozen = frozen is not None
        start = {k: r.start for k, r in self.ranges.items()}
        if frozen is not None:
            start.update(frozen)
        self.parent: dict[str, float] = start
        self.weights: dict[str, float] = dict(start)
        self.parent_p95: float | None = None  # the parent's score (None until the first window)
        self.window: deque[float] = deque(maxlen=window)
        self.window_p95 = 0.0
        self.samples = 0
        self.steps = 0  # window evaluations so far
        self.since_step = 0
        self.proposed = 0
        self.accepted = 0
        self.outcomes: deque[bool] = deque(maxlen=SUCCESS_HISTORY)
        self.converged = False
        self.converged_at = 0  # samples seen when σ fell below sigma_min (0: not yet)

    @property
    def searching(self) -> bool:
        """Whether an offspring is being served and evaluated (not frozen, not converged)."""
        return not self.frozen and not self.converged

    def observe(self, ttft_s: float) -> None:
        """One sample's TTFT; every ``hop`` of them, once the window is full, is a step."""
        self.window.append(ttft_s)
        self.samples += 1
        self.since_step += 1
        if len(self.window) < self.window_size or (self.steps and self.since_step < self.hop):
            return
        self.since_step = 0
        self.steps += 1
        self.window_p95 = percentile_sorted(sorted(self.window), self.quantile)
        if self.searching:
            if self.judge == "window":  # the paper's rolling-window fitness
                self._step(self.window_p95)
            else:  # first tokens served under the current weights only
                hop = list(self.window)[-self.hop:]
                self._step(percentile_sorted(sorted(hop), self.quantile))

    def _step(self, p95: float) -> None:
        if self.parent_p95 is None:  # the first full window scores the starting weights
            self.parent_p95 = p95
        else:  # the window scored the offspring served during the last hop
            won = p95 < self.parent_p95 * (1.0 + self.margin)  # tuner.py: −p95 > −parent·(1 + tol)
            if won:
                self.parent, self.parent_p95 = dict(self.weights), p95
                self.accepted += 1
            self.outcomes.append(won)
            if len(self.outcomes) == SUCCESS_HISTORY:  # tuner.py adapts σ only with a full history
                rate = sum(self.outcomes) / SUCCESS_HISTORY
                if rate > SUCCESS_TARGET:
                    self.sigma /= SUCCESS_FACTOR
                elif rate < SUCCESS_TARGET:
                    self.sigma *= SUCCESS_FACTOR
            if self.sigma < self.sigma_min:
                self.converged, self.converged_at = True, self.samples
                self.weights = dict(self.parent)
                return
        self.weights = self._offspring()
        self.proposed += 1

    def _offspring(self) -> dict[str, float]:
        out = {}
        for k, x in self.parent.items():
            r = self.ranges[k]
            out[k] = min(r.hi, max(r.lo, math.exp(math.log(x) + self.sigma * self.rng.gauss(0.0, 1.0))))
        return out

    def state(self) -> dict[str, float]:
        """Served and parent weights, σ, the last window's p95, accepted/proposed, mode."""
        s: dict[str, float] = {f"{k}": v for k, v in self.weights.items()}
        s.update({f"parent_{k}": v for k, v in self.parent.items()})
        s.update(sigma=self.sigma, window_p95_s=self.window_p95, accepted=float(self.accepted),
                 proposed=float(self.proposed), samples=float(self.samples),
                 converged=float(self.converged), converged_at=float(self.converged_at),
                 frozen=float(self.frozen))
        return s
