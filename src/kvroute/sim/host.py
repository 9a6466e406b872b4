"""Engines sharing one machine's CPU cores (``Host``, a deployment property).
Split out of sim/engine.py (issue 22)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvroute.perf.profile import NewcomerPoint


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
    0.265-0.409 s (mean 1.39x) with three. Processor sharing predicts max(1, 3/2) = 1.5x.

    Other work on the machine (``background``: cores' worth of CPU the gateway, the clients, the
    kernel and the engines' HTTP threads use while it serves; `kvroute bench fidelity` measures
    it per live run, bench/fidelity_cpu.py) shares the cores too: while ``n`` engines step at
    once, each step takes ``max(1, n / (cores - background))`` times its profile time. Issue
    21g: over the fourth round's fidelity run the engines were busy 1.61x the profile's work
    where sharing the cores among the engines alone allows 1.40x at that run's occupancy; the
    background measured in later runs was 0.12-0.19 cores.

    Linux schedules per core, so an engine that starts a step while both others step shares one
    core with one of them (issue 21g, `quiet`): a warm ~100-token prefill took 2.02x its time alone
    while the other two ran prefills back to back (1.82x while they decoded), not 1.5x; its own CPU
    time rose only 6-10 % (``/proc/.../schedstat``: the rest was run-queue wait). Over longer spans
    the kernel's balancing evens this out (decode phases in the fourth round's logs: 1.45-1.86x),
    and a per-core model without that rotation (k engines on a core: k x) matched two quiet
    fidelity runs worse than processor sharing (15 and 9 of 20 ratios within 10 % against 17 and
    13). So the transient alone is modelled (issue 21i): an engine's first step after it starts
    stepping beside others takes :func:`newcomer_factor` times the sharing above, the factor measured
    by `kvroute calibrate` (profile ``newcomer_slowdown``; the engine applies it, sim/engine.py).
    The engines already stepping keep processor sharing meanwhile (per core, one of them would
    slow down as much and another speed up: not measured, not modelled)."""

    __slots__ = ("cores", "background", "engines", "stepping")

    def __init__(self, cores: int, background: float = 0.0):
        if cores < 1:
            raise ValueError(f"a host needs at least one core, got {cores}")
        if not 0 <= background < cores:
            raise ValueError(f"a host's background load must be at least 0 and below its {cores} core(s), "
                             f"got {background}")
        self.cores = cores
        self.background = background
        self.engines: list[Stepping] = []
        self.stepping = 0  # engines with a step in progress

    @property
    def slowdown(self) -> float:
        """How much slower a step runs now than on a machine of its own."""
        free = self.cores - self.background
        return self.stepping / free if self.stepping > free else 1.0

    def front_end_s(self, overhead_s: float) -> float:
        """A request's time outside the engine's loop (the profile's ``ttft_overhead_s``: HTTP,
        tokenizing, an API server) on this host now: it runs on the shared cores too, so it stretches
        as a step does. Calibration divides it by the sweep's sharing as it divides the steps
        (calibrate/fit.py); left undivided here, vLLM's 6-7 ms came out ~half the live one (issue
        21f: with it the replay of a quiet two-engine run went from 11 to 16 of 20 ratios within 20 %)."""
        return overhead_s * self.slowdown

    def slowdown_of(self, engine: Stepping) -> float:
        """``engine``'s slowdown now (processor sharing: every stepping engine's is the same)."""
        return self.slowdown

    def stepping_changed(self, engine: Stepping, busy: bool) -> None:
        """``engine`` starts (``busy``) or stops stepping: re-time the others' steps in progress."""
        before = self.slowdown
        self.stepping += 1 if busy else -1
        if self.slowdown != before:
            for other in self.engines:
                if other is not engine and other._busy:
                    other._rescale()


def newcomer_factor(points: Sequence[NewcomerPoint], others: int, solo_s: float) -> float:
    """The measured slowdown beyond processor sharing of a step of ``solo_s`` seconds alone whose
    engine started stepping while ``others`` engines of its host stepped (perf/profile.py
    ``newcomer_slowdown``; 1 where nothing was measured or ``others`` is 0). Points for the largest
    measured count up to ``others``; between two step lengths the factor is interpolated linearly;
    below the shortest it is the shortest's (the kernel's transient outlasts it); beyond the longest
    the longest's excess time stays the same (a transient of fixed length: a long step dilutes it)."""
    if others < 1 or not points:
        return 1.0
    counts = [p.others for p in points if p.others <= others]
    if not counts:
        return 1.0
    k = max(counts)
    row = sorted((p.solo_s, p.factor) for p in points if p.others == k)
    if solo_s <= row[0][0]:
        return row[0][1]
    for (t0, f0), (t1, f1) in zip(row, row[1:]):
        if solo_s <= t1:
            return f0 + (f1 - f0) * (solo_s - t0) / (t1 - t0)
    t, f = row[-1]
    return 1.0 + (f - 1.0) * t / solo_s
