"""Profiling runs that fit CascadeInfer's QoE model (§4.1) on the simulated engine.

As the paper profiles a real engine: requests fall into exponentially growing length buckets
([128, 256), [256, 512), … up to the profile's largest context); for each bucket and each batch
size B = 1, 2, 4, … up to what memory holds, one engine runs a closed loop that keeps B requests
in flight (a completion enqueues the next) for a fixed number of completions. Every request
yields its normalized latency (end-to-end time / output tokens) and its batch features averaged
over its lifetime: n, ΣI, ΣI², ΣL over the requests in flight, integrated over time.

*Choices* (the paper leaves them open): the sequence-length feature of a request is its mean
length while decoding, I + O/2; the first B requests of a run (the ramp) are not recorded; each
run stops after max(2B, 16) recorded completions. Validation draws fresh requests (another
seed) over the same grid, as §4.1 applies "the same benchmarking procedure to the validation set".
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.cascade.qoe import Features, QoEModel, fit, mean_relative_error
from kvroute.perf.profile import HardwareProfile
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop

OutputSampler = Callable[[random.Random], int]


def sharegpt_like_output(rng: random.Random) -> int:
    """Output tokens: log-normal, median 256, σ 0.9, 1..4096 (the long-context workload's)."""
    return int(min(4096, max(1, round(256 * math.exp(0.9 * rng.gauss(0, 1))))))


@dataclass
class Profiled:
    """Profiled requests: features and normalized latency, with the (bucket, batch) they ran in."""

    features: list[Features] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    config: list[tuple[int, int]] = field(default_factory=list)


def buckets(max_len: int, first: int = 128) -> list[tuple[int, int]]:
    """[first, 2·first), [2·first, 4·first), … while the bucket starts below ``max_len``."""
    out, lo = [], first
    while lo < max_len:
        out.append((lo, min(2 * lo, max_len)))
        lo *= 2
    return out


def run_config(profile: HardwareProfile, lo: int, hi: int, batch: int, rng: random.Random,
               output: OutputSampler, into: Profiled) -> None:
    """One (length bucket, batch size) run: keep ``batch`` requests in flight, record completions."""
    loop = EventLoop()
    acc = [0.0, 0.0, 0.0, 0.0]  # ∫ n, ΣI, ΣI², ΣL dt
    cur = [0.0, 0.0, 0.0, 0.0]
    last = [0.0]
    started: dict[str, tuple[float, list[float], int, int]] = {}
    target = max(2 * batch, 16)
    done = [0]
    n_sub = [0]

    def advance() -> None:
        dt = loop.now - last[0]
        if dt > 0:
            for k in range(4):
                acc[k] += cur[k] * dt
        last[0] = loop.now

    def submit() -> None:
        advance()
        i = int(lo * (hi / lo) ** rng.random())
        o = output(rng)
        n_sub[0] += 1
        rid = f"p{n_sub[0]}"
        mean_len = i + o / 2
        for k, v in enumerate((1.0, i, i * i, mean_len)):
            cur[k] += v
        started[rid] = (loop.now, list(acc), i, o)
        eng.submit(Seq(rid, i, o, (), 16))

    def finish(seq: Seq, t: float) -> None:
        advance()
        t0, a0, i, o = started.pop(seq.rid)
        mean_len = i + o / 2
        for k, v in enumerate((1.0, i, i * i, mean_len)):
            cur[k] -= v
        if int(seq.rid[1:]) > batch and t > t0:  # past the ramp
            span = t - t0
            avg = [(acc[k] - a0[k]) / span for k in range(4)]
            into.features.append((1.0, avg[0], avg[1], avg[2], avg[3]))
            into.latency.append(span / o)
            into.config.append((lo, batch))
            done[0] += 1
        if done[0] < target:
            submit()

    eng = Engine("profile", profile, loop, lambda seq, t: None, finish)
    for _ in range(batch):
        submit()
    loop.run(stop=lambda: done[0] >= target)


def profile_engine(profile: HardwareProfile, seed: int = 0, output: OutputSampler = sharegpt_like_output,
                   max_len: int = 131_072, max_batch: int | None = None) -> Profiled:
    """Every (bucket, batch size) the profile's memory and batch limit allow."""
    rng = random.Random(seed)
    into = Profiled()
    cap = min(profile.max_running, max_batch or profile.max_running)
    for lo, hi in buckets(max_len):
        b = 1
        while b <= cap and b * (hi + 512) <= profile.kv_tokens:
            run_config(profile, lo, hi, b, rng, output, into)
            b *= 2
    return into


@dataclass(frozen=True)
class QoEFit:
    """A fitted model and its validation on held-back runs."""

    model: QoEModel
    fit_requests: int
    validation_requests: int
    model_error: float  # mean relative error on the validation runs
    static_error: float  # the same for a predictor of the fitting runs' mean latency


_FITS: dict[tuple[str, int, int, int | None], QoEFit] = {}  # by (profile as JSON, seed, max_len, max_batch)


def fit_profile(profile: HardwareProfile, seed: int = 0, max_len: int = 131_072,
                max_batch: int | None = None) -> QoEFit:
    """Fit D_k on one profiling pass and validate on another (fresh requests); cached per process.

    ``max_batch`` bounds the profiled batch sizes (default: what memory and the batch limit
    hold, as the paper does)."""
    key = (profile.model_dump_json(), seed, max_len, max_batch)  # the whole profile: a batch cap changes the fit
    got = _FITS.get(key)
    if got is not None:
        return got
    train = profile_engine(profile, seed, max_len=max_len, max_batch=max_batch)
    test = profile_engine(profile, seed + 1, max_len=max_len, max_batch=max_batch)
    model = fit(train.features, train.latency)
    mean = sum(train.latency) / len(train.latency)
    got = QoEFit(model, len(train.latency), len(test.latency),
                 mean_relative_error([model.request(f) for f in test.features], test.latency),
                 mean_relative_error([mean] * len(test.latency), test.latency))
    _FITS[key] = got
    return got
