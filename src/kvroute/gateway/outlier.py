"""Stall detection: eject an engine that stopped making progress, from the progress of the
requests it is serving (pure: the caller passes the clock).

A frozen engine — a GPU hang, an NCCL stall, vLLM's engine core stopped while its API server
lives on — still answers 200 on /health, /metrics and /v1/models (shared/design/real-vllm-cpu.md),
so probes see it healthy, and its requests wait out the first-byte timeout (60 s) while the
breaker, which counts failures, never opens. Only request progress shows it. Envoy's outlier
detection ejects a host from what its traffic shows rather than from health checks; this module
does the same with *progress* as the signal:

- every streamed attempt on a replica is watched; a **token event** it receives is progress (a
  response head or a chat role announcement is not: vLLM's API server sends those without its
  engine core);
- the replica is **stalled** when it has watched attempts and none of them has progressed for
  longer than its threshold: ``factor ×`` the longest gap between progress events it normally
  shows (a peak that decays with a half-life of ``PEAK_HALF_LIFE_S``), bounded to
  [``min_s``, ``max_s``], plus the prefill time the prompts still waiting for their first token
  are expected to take at the replica's learned seconds per prompt token (never assumed faster
  than ``PRIOR_S_PER_TOKEN``) — a long prompt is allowed its prefill, a short one on a frozen
  engine is not. The rate is learned only from the first tokens of prompts of at least
  ``RATE_MIN_TOKENS``, as the median of the last ``RATE_SAMPLES``: a short prompt's time to first
  token is its fixed costs (scheduling, a forward pass, a cold engine's warm-up), not prefill — a
  vLLM CPU engine's cold first reply to a short prompt read as 0.12-0.14 s per token, and
  allowed a short prompt on the frozen engine 1.7 s more (tests/test_vllm_streams.py missed its
  5 s bound 1 run in 4 at load 14). Until a long prompt has
  taught a rate, a waiting long prompt is allowed the short prompts' time to first token per
  token (an upper bound: it errs toward waiting) and a waiting short one only the prior: the base
  threshold already covers its fixed costs. A replica that has never produced a first token is
  not judged while all its streams wait for one: nothing says yet how long its prefill takes (a
  CPU engine's first 1,500-token prompt took seconds here);
- a stalled replica is ejected (its breaker held open) and every watched attempt on it aborted
  — unless no other replica could take its requests (Envoy's ``max_ejection_percent`` in its
  simplest form: ejecting the last one only turns slow answers into errors);
  those without a byte out are retried elsewhere, those mid-stream continued elsewhere
  (``gateway/continuation.py``);
- it is re-admitted when it progresses again: a tiny canary request is sent to it every
  ``canary_interval_s`` while it is out, and the first one answered 200 re-admits it.

An engine that is busy but alive always shows progress: continuous batching gives every running
sequence a token per step, so only a frozen engine goes silent on all its streams at once.
Non-streamed attempts are not watched (they show nothing until they end; ``timeouts.non_stream_s``
bounds them).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any

PEAK_HALF_LIFE_S = 60.0  # how fast a long gap seen once stops widening the threshold
PRIOR_S_PER_TOKEN = 1e-4  # prefill assumed no faster than 10,000 tokens/s: 100 K tokens are allowed 10 s
# a prompt this long is prefill-dominated on the engines measured here (a loaded CPU llama-server took
# ~1 ms per token over its first 1,500, dd9185f); a shorter one's prefill fits in stall.min_s (1 s) at
# any speed above 128 tokens/s, so its time to first token is mostly fixed costs and teaches no rate
RATE_MIN_TOKENS = 128
RATE_SAMPLES = 5  # the rate is the median of this many recent samples: one cold or queued reply moves it little

Abort = Callable[[Any], None]  # raises the exception it is given in whoever waits on the attempt


@dataclass(eq=False, slots=True)
class Attempt:
    """One watched attempt: when it last progressed, whether its first token came, how to abort it."""

    watch: ReplicaWatch
    started: float
    prompt_tokens: int
    last: float = 0.0
    first_token: bool = False
    abort: Abort | None = None  # closes the upstream connection; set once the request is sent

    def attach(self, abort: Abort) -> None:
        """The request is on its way; ``abort`` gives up on it."""
        self.abort = abort

    def progressed(self, now: float) -> None:
        """A token event arrived."""
        self.last = now
        self.watch.progressed(self, now)


@dataclass(slots=True)
class ReplicaWatch:
    """The watched attempts of one replica and what its progress normally looks like."""

    attempts: set[Attempt] = field(default_factory=set)
    busy_since: float = 0.0  # when it last went from no watched attempt to one
    last_progress: float = 0.0
    peak_gap_s: float = 0.0  # the longest recent gap between progress events while busy (decaying)
    peak_at: float = 0.0
    s_per_token: float | None = None  # learned prefill seconds per prompt token (long prompts only)
    short_s_per_token: float | None = None  # short prompts' time to first token per token: an upper bound
    first_tokens: int = 0  # first tokens seen from it
    stalled: bool = False  # ejected for stalling, until it progresses again
    stalls: int = 0  # times ejected
    _samples: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))
    _short: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def begin(self, attempt: Attempt, now: float) -> None:
        """An attempt was sent."""
        if not self.attempts:
            self.busy_since = now
        self.attempts.add(attempt)

    def end(self, attempt: Attempt) -> None:
        """An attempt ended, however."""
        self.attempts.discard(attempt)

    def silent_since(self) -> float:
        """Since when the replica has shown no progress on its current attempts."""
        return max(self.busy_since, self.last_progress)

    def progressed(self, attempt: Attempt, now: float) -> None:
        """Fold one progress event into the replica's normal gaps (and its prefill speed)."""
        gap = now - self.silent_since()
        decayed = self.peak_gap_s * 0.5 ** ((now - self.peak_at) / PEAK_HALF_LIFE_S)
        if gap >= decayed:
            self.peak_gap_s, self.peak_at = gap, now
        if not attempt.first_token:
            attempt.first_token = True
            self.first_tokens += 1
            if attempt.prompt_tokens > 0:
                sample = (now - attempt.started) / attempt.prompt_tokens
                if attempt.prompt_tokens >= RATE_MIN_TOKENS:
                    self._samples.append(sample)
                    self.s_per_token = median(self._samples)
                else:  # mostly fixed costs: kept only as a bound for long prompts until one teaches the rate
                    self._short.append(sample)
                    self.short_s_per_token = median(self._short)
        self.last_progress = now

    def threshold(self, now: float, factor: float, min_s: float, max_s: float) -> float:
        """How long the replica may stay silent now (see the module docstring)."""
        peak = self.peak_gap_s * 0.5 ** ((now - self.peak_at) / PEAK_HALF_LIFE_S)
        base = min(max_s, max(min_s, factor * peak))
        if self.first_tokens == 0 and all(not a.first_token for a in self.attempts):
            return math.inf  # no first token seen from it yet: its prefill speed is unknown
        rate = self.s_per_token
        long_rate = max(rate if rate is not None else self.short_s_per_token or 0.0, PRIOR_S_PER_TOKEN)
        short_rate = max(rate or 0.0, PRIOR_S_PER_TOKEN)
        allowance = 0.0
        for a in self.attempts:
            if not a.first_token:
                allowance += a.prompt_tokens * (long_rate if a.prompt_tokens >= RATE_MIN_TOKENS else short_rate)
        return base + allowance


class StallDetector:
    """Every replica's watch; :meth:`sweep` names the replicas that stalled just now."""

    def __init__(self, factor: float = 10.0, min_s: float = 1.0, max_s: float = 3.0):
        self.factor, self.min_s, self.max_s = factor, min_s, max_s
        self.watches: dict[str, ReplicaWatch] = {}

    def watch(self, replica: str) -> ReplicaWatch:
        """The replica's watch (created on first use)."""
        w = self.watches.get(replica)
        if w is None:
            w = self.watches[replica] = ReplicaWatch()
        return w

    def forget(self, replica: str) -> None:
        """The replica was removed."""
        self.watches.pop(replica, None)

    def begin(self, replica: str, prompt_tokens: int, now: float) -> Attempt:
        """Watch a streamed attempt to ``replica`` from now on."""
        w = self.watch(replica)
        attempt = Attempt(w, now, prompt_tokens, now)
        w.begin(attempt, now)
        return attempt

    def sweep(self, now: float, may_eject: Callable[[str], bool] = lambda _name: True,
              ) -> Iterator[tuple[str, ReplicaWatch, float]]:
        """(replica, watch, silent seconds) for every replica that has just stalled: watched
        attempts and none progressed within its threshold, and ``may_eject`` allows it (another
        replica can take its requests). The caller ejects it and aborts them."""
        for name, w in self.watches.items():
            if w.stalled or not w.attempts:
                continue
            silent = now - w.silent_since()
            if silent > w.threshold(now, self.factor, self.min_s, self.max_s) and may_eject(name):
                w.stalled = True
                w.stalls += 1
                yield name, w, silent

    @staticmethod
    def readmit(w: ReplicaWatch, now: float) -> None:
        """The replica progressed again: watch it afresh."""
        w.stalled = False
        w.busy_since = w.last_progress = now
