"""Measure how much slower a step runs when its engine starts stepping while other engines on the
same machine already step, beyond processor sharing (perf/profile.py ``newcomer_slowdown``,
sim/host.py ``newcomer_factor``).

Processor sharing (sim/host.py) gives every stepping engine ``n / (cores - background)`` of its time
alone. Linux schedules per core, though: an engine thread that wakes while both cores run an engine
thread is queued on one of them and shares that core half and half with its occupant until the
kernel's load balancing moves a thread, which on busy cores runs only every few tens of ms. Issue
21g (`quiet`, three llama-servers on 2 cores): a warm ~100-token prefill took 2.02x its 40 ms alone
while the other two engines ran prefills back to back, where sharing gives 1.5x; issue 21f: a
newcomer ran 1.82x over its first 20 ms, 1.64-1.70x after 50 ms. So the transient lasts about as
long as a chat turn's warm prefill, which is what the fidelity workload's engines mostly start with.

Per round and engine (the *target*), with ``k`` of the other engines busy (k = 1 .. engines - 1):
the target first gets a fresh prompt of ``ctx`` tokens (cached afterwards), then the same prompt
plus ``new`` fresh tokens — the probe, a warm prefill like a chat turn's (96 after 1,536 by
default) — once with the others idle (alone) and once ``lead_s`` after ``k`` others were each sent
a fresh ``busy_tokens``-token prompt (2,048: a long prefill, so they are stepping when the probe
arrives and still stepping when it ends; a point where one of them finished first is dropped).
Also a cold probe of ``busy_tokens / 2`` tokens the same way, a step several times as long, to
see whether the excess fades with the step's length. A point is (k, probe kind, seconds alone,
seconds beside k busy engines); fit.py turns the medians into factors over what sharing predicts.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Completes(Protocol):
    """What the probe needs of an engine (calibrate/measure.py's ``_Engine``)."""

    def prompt(self, tokens: int) -> str: ...

    def suffix(self, tokens: int) -> str: ...

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]: ...

    async def sized(self, tokens: int, max_tokens: int = 1) -> tuple[float, int]: ...


# (others busy, probe kind "warm" | "cold", seconds alone, seconds beside the busy ones)
Point = tuple[int, str, float, float]


async def newcomer_points(engines: Sequence[Completes], sweep: Any, say: Callable[[str], None],
                          lead_s: float = 0.05) -> list[Point]:
    """The probe's points (see the module docstring) for ``sweep.newcomer_rounds`` rounds (measure.py's
    Sweep, as the engines' context limit let it run): the warm probe is the sweep's shortest warm length
    after its longest warm context, the busy engines' prompt its longest prefill length, the cold probe
    half that; none with fewer than two engines."""
    n, rounds = len(engines), sweep.newcomer_rounds
    if n < 2 or rounds < 1:
        return []
    ctx, new = max(sweep.warm_contexts), min(sweep.warm_lengths)
    busy_tokens = max(sweep.prefill_lengths)
    cold = busy_tokens // 2
    points: list[Point] = []

    async def probe(target: Completes, kind: str) -> float:
        if kind == "cold":
            s, _ = await target.complete(target.prompt(cold), 1)
            return s
        base = target.prompt(ctx)
        await target.complete(base, 1)  # cached from now on (its slot stays idle until the probe)
        s, _ = await target.complete(base + " " + target.suffix(new), 1)
        return s

    async def beside(target: Completes, others: list[Completes], kind: str) -> float | None:
        if kind == "warm":  # the cached part first, with the others idle, as for the probe alone
            base = target.prompt(ctx)
            await target.complete(base, 1)
        ends: list[float] = []

        async def long(e: Completes) -> None:
            # sized: shorter after an answer that it overflowed the context (vLLM's tokenizer spends more
            # tokens per byte on long prompts than the engine's line predicts: 2,049 of 2,048 once)
            await e.sized(busy_tokens)
            ends.append(time.perf_counter())

        loads = [asyncio.ensure_future(long(e)) for e in others]
        await asyncio.sleep(lead_s)
        if kind == "warm":
            s, _ = await target.complete(base + " " + target.suffix(new), 1)
        else:
            s, _ = await target.complete(target.prompt(cold), 1)
        done = time.perf_counter()
        await asyncio.gather(*loads)
        return s if min(ends) > done else None  # every other engine stepped throughout

    for r in range(rounds):
        for i, target in enumerate(engines):
            others = [e for j, e in enumerate(engines) if j != i]
            for k in range(1, n):
                for kind in ("warm", "cold"):
                    busy_first = (r + i) % 2 == 1  # alternate the order: drift biases neither side
                    if busy_first:
                        b = await beside(target, others[:k], kind)
                        a = await probe(target, kind)
                    else:
                        a = await probe(target, kind)
                        b = await beside(target, others[:k], kind)
                    if b is not None:
                        points.append((k, kind, a, b))
                    say(f"{kind} probe on engine {i + 1} alone {a * 1000:.1f} ms, beside {k} busy: "
                        + ("dropped (one finished first)" if b is None else f"{b * 1000:.1f} ms"))
    return points


def factors(points: list[Point], cores: int, background: float) -> list[tuple[int, float, float]]:
    """Per (others busy, probe kind) with points: (others busy, median seconds alone, median of
    beside / (alone x sharing)), sharing = max(1, (others + 1) / (cores - background)) as sim/host.py
    has it — the excess over processor sharing, at least 1 (the model's terms only slow a step).
    Sorted by others, then seconds alone."""
    out = []
    free = cores - background
    for k in sorted({p[0] for p in points}):
        for kind in ("warm", "cold"):
            got = [(a, b) for kk, kd, a, b in points if kk == k and kd == kind and a > 0]
            if not got:
                continue
            share = max(1.0, (k + 1) / free)
            ratio = statistics.median(b / (a * share) for a, b in got)
            out.append((k, statistics.median(a for a, _ in got), max(1.0, ratio)))
    return sorted(out)
