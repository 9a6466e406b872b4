"""Engines sharing one machine's CPU cores (``Host``, a deployment property).
Split out of sim/engine.py (issue 22)."""

from __future__ import annotations

from typing import Protocol


class Stepping(Protocol):
    """What a host needs of its engines (sim/engine.py ``Engine``)."""

    _busy: bool

    def _rescale(self) -> None:
        """The host's slowdown changed while this engine steps: re-time the step in progress."""


class Host:
    """CPU cores shared by the engines of one machine.

    Measured on a 2-core machine with three llama-servers (``-t 1 -tb 1``, one thread each): a
    ~1,080-token prefill took 0.111 s alone, 0.098-0.118 s with two engines prefilling at once,
    and 0.106-0.184 s (mean 0.158 s, 1.42x) with all three; ~1,910 tokens: 0.243 s alone,
    0.265-0.409 s (mean 1.39x) with three. Processor sharing predicts max(1, 3/2) = 1.5x. So
    while ``n`` engines step at once, each step takes ``max(1, n / cores)`` times its profile
    time. What a step does not count: the gateway's and the clients' own CPU (3-5 % and 2-4 % of
    a core in the same measurement)."""

    __slots__ = ("cores", "engines", "stepping")

    def __init__(self, cores: int):
        if cores < 1:
            raise ValueError(f"a host needs at least one core, got {cores}")
        self.cores = cores
        self.engines: list[Stepping] = []
        self.stepping = 0  # engines with a step in progress

    @property
    def slowdown(self) -> float:
        """How much slower a step runs now than on a machine of its own."""
        return self.stepping / self.cores if self.stepping > self.cores else 1.0

    def stepping_changed(self, engine: Stepping, busy: bool) -> None:
        """``engine`` starts (``busy``) or stops stepping: re-time the others' steps in progress."""
        before = self.slowdown
        self.stepping += 1 if busy else -1
        if self.slowdown != before:
            for other in self.engines:
                if other is not engine and other._busy:
                    other._rescale()
