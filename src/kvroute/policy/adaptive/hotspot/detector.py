"""LMetric's KV-hotspot detector: when P-tokens × BS would pile a class of requests onto the
few instances that cache its prefix, filter those instances out.

LMetric §5.2 (002_8c097f52e4fa5054.txt, "Benign and Failure Cases Analysis of
Multiplication-based Scheduling Score") groups requests into classes that share a KV prefix
and, per class c, splits the instances into M (they cache c's prefix) and M̄ (the rest). If
every class-c request goes to M, the batch sizes evolve as (Equation 1)

    BS_t / BS̄_t = (BS₀ + x·QPS/|M|·t) / (BS₀ + x̄·QPS/|M̄|·t)

where x is c's share of the arrivals in a window (x̄ = 1 − x). M's batch can outgrow the others'
only if x / x̄ > |M| / |M̄| (Equation 2 violated). The detector has two phases:

1. **Alarm** when Equation 2 is violated for the class of the request being routed (measured
   live: x over a window of recent decisions, |M| and |M̄| from the prefix index);
2. **Filter** once, under that alarm, more than 2·|M| *consecutive* class-c requests would
   still score better on a hotspot instance than on any other (Equation 4:
   P-token_t × BS_t ≤ P-token_t̄ × BS_t̄): then M is taken out of the targets for class c, and
   the request is placed among M̄ — where it has no cache, so the multiplicative score reduces
   to load balancing (the paper's load-balancing-only fallback).

Choices where the paper is vague (also in ARCHITECTURE.md):

* A request's class is the longest prefix of it cached anywhere (the deepest block any
  eligible instance holds), and M the instances holding that whole prefix — the instances
  whose P-token the cache lowers most. Requests with nothing cached belong to no class.
* The window is the last ``window`` routed requests (default 256), not a minute: the policy
  layer has no clock. The detector stays silent until the window is full.
* An alarm (and any filtering) clears as soon as Equation 2 holds again for the class, e.g.
  once filtering has spread its prefix to enough instances. Before filtering starts, the run
  of consecutive requests resets whenever a class request would go to M̄ anyway.
* Only classes under alarm are tracked beyond the window's counts, which bounds memory (the
  paper tracks only the classes with the highest hit rates).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass


@dataclass(slots=True)
class _Alarm:
    run: int = 0  # consecutive class requests that preferred a hotspot instance
    filtering: bool = False


class HotspotDetector:
    """Two-phase detector over request classes; :meth:`record` once per routed request."""

    def __init__(self, window: int = 256):
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.window_size = window
        self._recent: deque[int] = deque()
        self._counts: Counter[int] = Counter()
        self._alarms: dict[int, _Alarm] = {}
        self.phase1_alarms = 0  # requests routed while their class was under a phase-1 alarm
        self.filtered = 0  # requests whose hotspot instances were filtered out (phase 2)
        self.filter_events = 0  # times a class entered phase 2

    def _count(self, klass: int) -> tuple[float, bool]:
        """Record this request's class in the window; return the class's share x and whether
        the window is full."""
        recent, counts = self._recent, self._counts
        recent.append(klass)
        counts[klass] += 1
        if len(recent) > self.window_size:
            old = recent.popleft()
            counts[old] -= 1
            if not counts[old]:
                del counts[old]
        return counts[klass] / len(recent), len(recent) >= self.window_size

    def _share_after(self, klass: int) -> tuple[float, bool]:
        """What :meth:`_count` would return, without recording."""
        recent = self._recent
        n, c = len(recent) + 1, self._counts.get(klass, 0) + 1
        if n > self.window_size:
            n -= 1
            if recent[0] == klass:
                c -= 1
        return c / n, n >= self.window_size

    def peek(self, klass: int | None, holders: int, others: int, prefers_holder: bool) -> bool:
        """What :meth:`record` would answer for this request, changing nothing (the routing
        decision; the Router records when it commits the dispatch)."""
        return self._step(klass, holders, others, prefers_holder, apply=False)

    def record(self, klass: int | None, holders: int, others: int, prefers_holder: bool) -> bool:
        """Count this routed request and answer whether to filter its class's hotspot instances out.

        ``klass``: the request's class (its longest cached prefix), None when nothing is cached;
        ``holders`` = |M| and ``others`` = |M̄| among the eligible instances; ``prefers_holder``:
        the best multiplicative score lies in M (Equation 4).
        """
        return self._step(klass, holders, others, prefers_holder, apply=True)

    def _step(self, klass: int | None, holders: int, others: int, prefers_holder: bool, apply: bool) -> bool:
        key = -1 if klass is None else klass  # no cached prefix: counts in the window, never alarms
        x, full = self._count(key) if apply else self._share_after(key)
        if klass is None:
            return False
        alarm = self._alarms.get(klass)
        # Equation 2 violated: x / x̄ > |M| / |M̄|, i.e. x·|M̄| > x̄·|M| (no division by zero)
        if not (full and others > 0 and holders > 0 and x * others > (1.0 - x) * holders):
            if alarm is not None and apply:
                del self._alarms[klass]
            return False
        run, filtering = (alarm.run, alarm.filtering) if alarm is not None else (0, False)
        if apply:
            if alarm is None:
                alarm = self._alarms[klass] = _Alarm()
            self.phase1_alarms += 1
        if not filtering:
            run = run + 1 if prefers_holder else 0
            if apply:
                assert alarm is not None
                alarm.run = run
            if not prefers_holder or run <= 2 * holders:
                return False
            if apply:
                assert alarm is not None
                alarm.filtering = True
                self.filter_events += 1
        if apply:
            self.filtered += 1
        return True

    def state(self) -> dict[str, float]:
        """Counters of both phases and the classes under alarm now."""
        return {"classes_alarmed": float(len(self._alarms)),
                "classes_filtering": float(sum(a.filtering for a in self._alarms.values())),
                "phase1_requests": float(self.phase1_alarms),
                "filter_events": float(self.filter_events),
                "filtered_requests": float(self.filtered)}
