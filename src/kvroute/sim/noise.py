"""Engine timing noise and request reordering, optional and off by default (issue 21, item 5).

A real engine does not take the same time twice for the same step, and requests a router sends
in one order can reach the engine's scheduler in another. The LMetric paper (§4.6, "Cons #2")
names both as why a simulator-based router (llm-d) mispredicts: "even with a well-tuned
simulator, there are still about 10% of requests with more than 20% prediction error. Such
errors mainly come from two sources: request reordering at the vLLM API server, and
inaccuracies in latency prediction." Without noise, the simulator's engines are exactly the
model a predictor like ``llm_d`` holds, so such a policy can look better simulated than it is.

Two mechanisms, each a number measured by ``kvroute calibrate`` (:mod:`kvroute.calibrate.noise`):

* **Step noise** (``step_sigma``): every engine step's time is multiplied by a factor drawn from
  a log-normal distribution with mean 1 and log-space standard deviation ``step_sigma``. A decode
  jump of K steps draws one factor with ``step_sigma / sqrt(K)``: the mean of K independent
  step factors has that spread (to first order), and the jump stays one event.
* **API-server delay** (``api_delay_s``): between a balancer's dispatch and the engine's queue,
  every request spends an extra, exponentially distributed time with this mean (on top of the
  profile's fixed ``ttft_overhead_s``): HTTP parsing, tokenizing and the server's event loop,
  which take longer for some requests than others. Two requests dispatched to one engine closer
  together than that spread can reach its queue in the other order: the reordering. The
  exponential shape is kvroute's choice (a non-negative delay with one parameter, fitted to its
  measured mean); the calibration reports the measured quantiles beside it.

Each mechanism draws from its own seeded stream, so switching noise on changes nothing else's
random draws, and with noise off (the default) no draw is made at all: fixed-seed runs are
identical to a simulator without this module.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class NoiseSpec:
    """How noisy the simulated engines are: log-space std of a step's time factor, and the mean
    extra API-server delay per request (seconds). Both 0: off."""

    step_sigma: float = 0.0
    api_delay_s: float = 0.0

    @property
    def active(self) -> bool:
        """Whether either mechanism is on."""
        return self.step_sigma > 0 or self.api_delay_s > 0


class StepNoise:
    """Draws the time factor of engine steps (one stream per engine, seeded)."""

    __slots__ = ("sigma", "rng")

    def __init__(self, sigma: float, seed: str):
        self.sigma = sigma
        self.rng = random.Random(seed)

    def factor(self, steps: int = 1) -> float:
        """A mean-one log-normal factor for ``steps`` consecutive steps timed as one (see the
        module docstring)."""
        s = self.sigma / math.sqrt(steps) if steps > 1 else self.sigma
        return math.exp(self.rng.gauss(-s * s / 2, s))


class ApiDelay:
    """Draws each request's extra delay at the engine's API server (one stream per run, seeded)."""

    __slots__ = ("mean", "rng")

    def __init__(self, mean_s: float, seed: str):
        self.mean = mean_s
        self.rng = random.Random(seed)

    def draw(self) -> float:
        """Seconds (exponential with the configured mean)."""
        return self.rng.expovariate(1 / self.mean)
