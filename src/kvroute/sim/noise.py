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
  every request spends an exponentially distributed time with this mean: HTTP parsing,
  tokenizing and the server's event loop, which take longer for some requests than others. It
  replaces that much of the profile's ``ttft_overhead_s`` (the fitted mean overhead), so the mean
  delay is unchanged: ``max(0, ttft_overhead_s - api_delay_s) + Exp(api_delay_s)``. Two requests
  dispatched to one engine closer together than that spread can reach its queue in the other
  order: the reordering. The exponential shape is kvroute's choice (a non-negative delay with
  one parameter, fitted to its measured mean); the calibration reports measured quantiles
  beside it. Prefill/decode disaggregated legs (sim/disagg.py) keep the fixed overhead.

Each mechanism draws from its own seeded stream, so switching noise on changes nothing else's
random draws, and with noise off (the default) no draw is made at all: fixed-seed runs are
identical to a simulator without this module.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from kvroute.schema import StrictModel

if TYPE_CHECKING:
    from kvroute.perf.profile import HardwareProfile
    from kvroute.sim.engine import Engine


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


class NoiseConfig(StrictModel):
    """A scenario's ``engine_noise`` given as numbers (else ``profile``: each replica's measured ones)."""

    step_sigma: float = Field(0.0, ge=0, le=2, description="log-normal sigma of every engine step's time "
                              "(mean-one factor; `kvroute calibrate` measures it)")
    api_delay_s: float = Field(0.0, ge=0, description="mean of the exponential part of each request's delay "
                               "before the engine's queue: requests dispatched closer than it may overtake")


def resolve(config: NoiseConfig | Literal["profile"] | None, profile: HardwareProfile) -> NoiseSpec | None:
    """One replica's noise from a scenario's ``engine_noise`` (None: off)."""
    if config is None:
        return None
    if config == "profile":
        spec = NoiseSpec(profile.noise_step_sigma, profile.noise_api_delay_s)
    else:
        assert isinstance(config, NoiseConfig)
        spec = NoiseSpec(config.step_sigma, config.api_delay_s)
    return spec if spec.active else None


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
    """Draws each request's delay between dispatch and the engine's queue (one stream per run,
    seeded), for engines whose noise has an API-server delay."""

    __slots__ = ("means", "rng")

    def __init__(self, means: dict[str, float], seed: str):
        self.means = means  # replica id → mean extra delay (s); absent: the fixed overhead only
        self.rng = random.Random(seed)

    def delay(self, replica: str, overhead_s: float) -> float:
        """Seconds from dispatch to the engine's queue, less the network: the profile's overhead
        ``overhead_s``, with ``api_delay_s`` of it drawn from an exponential (module docstring)."""
        mean = self.means.get(replica)
        if mean is None:
            return overhead_s
        fixed = overhead_s - mean
        return (fixed if fixed > 0 else 0.0) + self.rng.expovariate(1 / mean)


def attach(engines: dict[str, Engine], noise: dict[str, NoiseSpec | None], seed: int) -> ApiDelay | None:
    """Give every engine with step noise its own seeded factor stream (``engine.step_noise``);
    the run's API-server delays, or None when no engine has one."""
    means = {}
    for rid, spec in noise.items():
        if spec is None or not spec.active:
            continue
        if spec.step_sigma > 0:
            engines[rid].step_noise = StepNoise(spec.step_sigma, f"step-noise-{seed}-{rid}").factor
        if spec.api_delay_s > 0:
            means[rid] = spec.api_delay_s
    return ApiDelay(means, f"api-delay-{seed}") if means else None
