"""Dispatch pacing: how fast a load balancer may push requests out of its queue.

SkyWalker's load balancer does not drain its queue in one go when a replica frees up: a queue
processor wakes every 10 ms and pops at most one request (skypilot ``serve-multi-region-lb``,
``load_balancer.py``; reproduction.md "Implementation facts"). Between two probes (100 ms) the
balancer therefore pushes at most ten requests, however many replicas looked free at the last
probe. Without that pace, a replica that showed no waiting request receives the whole queue
in one instant (kvroute issue 7 measured 1,252 requests sent to one replica in one drain).

This module is pure: it never reads a clock or sleeps. The caller passes ``now`` (simulated or
monotonic seconds) and schedules its own wake-up with :meth:`DispatchPacer.wait_s`.
"""

from __future__ import annotations

DEFAULT_TICK_S = 0.010  # SkyWalker's queue-processor period


class DispatchPacer:
    """At most one dispatch per ``tick_s`` for a load balancer whose policy can hold requests.

    Use: before routing a request (a queued one or a new arrival), ask :meth:`ready`; if it says
    no, keep the request queued and come back after :meth:`wait_s`. After a request was actually
    dispatched, call :meth:`dispatched`. A tick of 0 disables pacing. Held decisions and failures
    do not consume a tick: only requests that leave for a replica or a peer do.
    """

    __slots__ = ("tick_s", "next_at", "dispatches")

    def __init__(self, tick_s: float = DEFAULT_TICK_S):
        if tick_s < 0:
            raise ValueError(f"dispatch tick must be >= 0 seconds, got {tick_s}")
        self.tick_s = tick_s
        self.next_at = float("-inf")  # earliest time of the next dispatch
        self.dispatches = 0

    def ready(self, now: float) -> bool:
        """Whether a dispatch may happen at ``now``."""
        return now >= self.next_at - 1e-12

    def wait_s(self, now: float) -> float:
        """Seconds from ``now`` until the next dispatch may happen (0 when it may now)."""
        return max(0.0, self.next_at - now)

    def dispatched(self, now: float) -> None:
        """Record that a request left the balancer at ``now``; the next may go one tick later."""
        self.next_at = now + self.tick_s
        self.dispatches += 1
