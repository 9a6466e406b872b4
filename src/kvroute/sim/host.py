"""Engines sharing one machine's CPU cores (``Host``, a deployment property).
Split out of sim/engine.py (issue 22)."""

from __future__ import annotations

import statistics
from typing import Protocol


class Stepping(Protocol):
    """What a host needs of its engines (sim/engine.py ``Engine``)."""

    _busy: bool

    def _rescale(self) -> None:
        """This engine's slowdown changed while it steps: re-time the step in progress."""


class Host:
    """CPU cores shared by the engines of one machine (one compute thread per engine, as the
    test tier's ``-t 1 -tb 1`` llama-servers run).

    Linux schedules per core: each core has its own run queue, and a thread that wakes up while
    no core is idle stays on the core it last ran on (kernel/sched/fair.c
    ``select_task_rq_fair``/``select_idle_sibling`` look for an idle core, else keep the previous
    one), where it shares that core with the threads already there; a core that goes idle pulls
    a waiting thread from a busier one at once (newidle balancing), and periodic balancing evens
    out queues that differ by two or more. So while ``n`` engines step on ``cores`` cores, each
    runs at 1/k of a core, k being the engines on its own core — not the ``n / cores`` of ideal
    processor sharing: with three engines on two cores, two share a core (2x) and one has a core
    to itself (1x).

    Measured (issue 21, 2-core machine, three llama-servers, `quiet`): a warm prefill of ~100
    tokens after ~1,950 cached on engine A took 40 ms with B and C idle, 0.95x that with one of
    them decoding, and 2.02x while both ran the same prefill back to back (1.82x while both
    decoded non-streamed, busy 1.45 of their 2 cores); A's own CPU time rose only 6-10 % (the rest
    was time waiting in its core's run queue, from ``/proc/<pid>/task/<tid>/schedstat``). In the
    fourth-round fidelity run's engine logs, a warm prefill alone in its engine took 1.09x the
    profile with the other engines idle, 1.06x with one stepping and 2.03x with both (decode
    steps: 0.85x, 0.94x, 1.6-2.1x). Earlier (one measurement, three engines starting a
    ~1,080-token prefill together): 0.106-0.184 s against 0.111 s alone, mean 1.42x — one engine
    alone on its core, two sharing until the first finishes.

    ``background``: cores' worth of CPU that other work on the machine takes while it serves (a
    gateway, clients, the kernel's network stack, the engines' HTTP threads; measured per run by
    `kvroute bench fidelity`). It runs wherever a core is idle, so it slows the engines only while
    every core has an engine stepping: then each core gives its engines ``1 - background / cores``
    of itself."""

    __slots__ = ("cores", "background", "engines", "stepping", "_queues", "_core", "_prev")

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
        self._queues: list[list[int]] = [[] for _ in range(cores)]  # engine indices stepping on each core
        self._core: dict[int, int] = {}  # engine index -> its core while it steps
        self._prev: dict[int, int] = {}  # engine index -> the core it last ran on

    def slowdown_of(self, engine: Stepping) -> float:
        """How much slower ``engine``'s step runs now than on a machine of its own: the engines
        stepping on its core (1 while it does not step), over the core's share left by the
        background load while no core is idle."""
        core = self._core.get(self._index(engine))
        if core is None:
            return 1.0
        k = float(len(self._queues[core]))
        if self.background and all(self._queues):
            return k / (1.0 - self.background / self.cores)
        return k

    def _index(self, engine: Stepping) -> int:
        for i, e in enumerate(self.engines):
            if e is engine:
                return i
        raise ValueError("the engine is not on this host")

    def stepping_changed(self, engine: Stepping, busy: bool) -> None:
        """``engine`` starts (``busy``) or stops stepping: place it on a core or take it off,
        rebalance, and re-time the others' steps whose slowdown changed."""
        me = self._index(engine)
        before = [self.slowdown_of(e) for e in self.engines]
        queues = self._queues
        if busy:
            self.stepping += 1
            idle = [c for c in range(self.cores) if not queues[c]]
            prev = self._prev.get(me, me % self.cores)
            core = (prev if prev in idle else idle[0]) if idle else prev
            queues[core].append(me)
            self._core[me] = core
        else:
            self.stepping -= 1
            core = self._core.pop(me)
            queues[core].remove(me)
            self._prev[me] = core
        # an idle core pulls work at once; queues two or more apart are evened out (the engine
        # that joined its core last moves)
        while True:
            hi = max(range(self.cores), key=lambda c: len(queues[c]))
            lo = min(range(self.cores), key=lambda c: len(queues[c]))
            if len(queues[hi]) - len(queues[lo]) < 2:
                break
            moved = queues[hi].pop()
            queues[lo].append(moved)
            self._core[moved] = lo
        for i, other in enumerate(self.engines):
            if i != me and other._busy and i in self._core and self.slowdown_of(other) != before[i]:
                other._rescale()


def simultaneous_slowdown(engines: int, cores: int) -> float:
    """The median slowdown of ``engines`` equal steps started together on ``cores`` shared cores
    (:class:`Host`'s rule): what `kvroute calibrate`, which runs every point on all engines at
    once, divides its measurements by (calibrate/fit.py). Three engines on two cores: one
    finishes at 1x, the two sharing a core at 1.5x (they share until the first finishes, then
    each has a core), median 1.5."""
    if engines <= cores:
        return 1.0
    left = [1.0] * engines  # work left, in steps of one engine alone
    queues = [list(range(c, engines, cores)) for c in range(cores)]
    now, done = 0.0, [0.0] * engines
    while any(queues):
        # the next step to finish, at each core's speed (1/k of a core for k sharing it)
        dt = min(left[i] * len(q) for q in queues if q for i in q)
        for q in queues:
            for i in q:
                left[i] -= dt / len(q)
        now += dt
        for q in queues:
            for i in [i for i in q if left[i] <= 1e-12]:
                q.remove(i)
                done[i] = now
        while True:
            hi = max(queues, key=len)
            lo = min(queues, key=len)
            if len(hi) - len(lo) < 2:
                break
            lo.append(hi.pop())
    return statistics.median(done)
