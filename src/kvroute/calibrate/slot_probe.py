"""Measure llama-server's slot copies to its host prompt cache (perf/profile.py
``slot_save_s_per_token``, sim/slot_cache.py), on every engine that has slots, all at once.

Launching a request, llama-server copies every idle slot whose content is not cached yet into
host memory (``--cache-idle-slots``; tools/server/server-context.cpp), on the loop every slot
waits for. So, per round: a fresh prompt of ``N`` tokens (one output token) leaves a slot holding
N + 1 uncached tokens; a tiny fresh prompt then takes another slot (least recently used: nothing
shares its prefix) and pays that copy; a second tiny prompt pays only the copy of the first tiny
prompt's slot (~17 tokens). Their difference over the difference of copied tokens is the cost per
token. On one llama-server (busy machine, issue 21) the first tiny prompt took 5-20 ms more
than the second after 500-3,000 tokens; with ``--cache-ram 0`` (no prompt cache) 0-2 ms.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Completes(Protocol):
    """What the probe needs of an engine (calibrate/measure.py's ``_Engine``)."""

    def prompt(self, tokens: int) -> str: ...

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]: ...


async def slot_points(engines: Sequence[Completes], facts: Sequence[Any], sizes: tuple[int, ...], rounds: int,
                      say: Callable[[str], None]) -> list[tuple[int, float]]:
    """(tokens copied beyond the baseline, extra seconds) per engine with slots (``facts[i].slots``,
    measure.py's EngineFacts) and round; N in ``sizes`` that a slot's context holds."""
    with_slots = [e for e, f in zip(engines, facts, strict=True) if f.slots]
    if not with_slots:
        return []
    per_slot = min((f.kv_tokens or 0) // f.slots for f in facts if f.slots)
    fit = tuple(n for n in sizes if n + 64 < per_slot) or (max(64, per_slot // 2),)

    async def one(e: Completes, n: int) -> tuple[int, float]:
        _, tokens = await e.complete(e.prompt(n), 1)  # leaves a slot of tokens + 1, not cached
        dirty, tiny = await e.complete(e.prompt(16), 1)
        clean, _ = await e.complete(e.prompt(16), 1)  # copies only the first tiny prompt's slot
        return tokens - tiny, dirty - clean

    points: list[tuple[int, float]] = []
    for _ in range(rounds):
        for n in fit:
            got = await asyncio.gather(*(one(e, n) for e in with_slots))
            points.extend(got)
            say(f"tiny prompt after a slot of {n} tokens went idle: " + ", ".join(
                f"+{s * 1000:.1f} ms" for _, s in got))
    return points


def per_token(points: list[tuple[int, float]], sharing: float) -> float:
    """Seconds per copied token: the median of extra / tokens over the points (each divided by
    the machine's sharing factor, as every other measured time in fit.py), at least 0."""
    rates = [s / sharing / n for n, s in points if n > 0]
    return max(0.0, statistics.median(rates)) if rates else 0.0
