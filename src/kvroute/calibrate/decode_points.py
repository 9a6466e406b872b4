"""Decode points and busy-engine probes of `kvroute calibrate` (moved out of calibrate/measure.py in issue
21w, when the decode points joined every repeat of the sweep; see measure.py's module docstring).

* :func:`decode_round`: per swept (context, batch), ``batch`` fresh prompts of ``ctx`` tokens sent once each
  (``max_tokens: 1``, so the engine holds them in its prefix cache), then all streamed together with
  ``decode_tokens`` tokens each: the time per token while every stream decodes is the step time
  (calibrate/stream_steps.py), at the context plus half the tokens generated.
* :func:`busy_points`: a tiny prompt beside a decoding batch (fit.py's ``c_admit_s`` and
  ``ttft_overhead_busy_s``).
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvroute.calibrate.stream_steps import _stall, _step_time


class Streams(Protocol):
    """What the decode points need of an engine (calibrate/measure.py's ``_Engine``)."""

    def prompt(self, tokens: int) -> str: ...

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]: ...

    async def stream_times(self, prompt: str, max_tokens: int, on_first: Callable[[], None] | None = None,
                           on_token: Callable[[], None] | None = None) -> list[float]: ...


async def decode_round(engines: Sequence[Streams], sweep: Any, say: Callable[[str], None],
                       backwards: bool = False) -> list[tuple[int, int, float, float]]:
    """One decode point per engine for every swept (context, batch) of ``sweep`` (calibrate/measure.py's
    ``Sweep``), in the sweep's order or, ``backwards``, the reverse (so that a drift during the sweep tilts no
    term: measure.py alternates): ``(batch, target context, mean context, step seconds)``, none for an engine
    whose streams never decoded together."""
    points = [(ctx, batch) for ctx in sweep.contexts for batch in sweep.batch_sizes]
    out: list[tuple[int, int, float, float]] = []
    for ctx, batch in (points[::-1] if backwards else points):
        prompts = [[e.prompt(ctx) for _ in range(batch)] for e in engines]
        warm = await asyncio.gather(*(e.complete(p, 1) for e, ps in zip(engines, prompts, strict=True) for p in ps))
        mean_ctx = statistics.fmean(tokens for _, tokens in warm) + sweep.decode_tokens / 2
        streams = await asyncio.gather(*(e.stream_times(p, sweep.decode_tokens)
                                         for e, ps in zip(engines, prompts, strict=True) for p in ps))
        steps = [_step_time(list(streams[i * batch:(i + 1) * batch])) for i in range(len(engines))]
        out.extend((batch, ctx, mean_ctx, s) for s in steps if s is not None)
        say(f"decode batch {batch} at ~{ctx} tokens: " + ", ".join(
            "-" if s is None else f"{s * 1000:.2f} ms" for s in steps))
    return out


async def busy_points(engines: Sequence[Streams], ctx: int, batch: int, decode_tokens: int, timeout_s: float,
                      slots: Sequence[int], say: Callable[[str], None]) -> list[tuple[int, float, int, float, float]]:
    """A tiny prompt sent to each engine while it decodes a batch of ``batch`` at ``ctx`` (once every stream has
    its first token): its latency is the per-request overhead of an engine that is busy, plus the step it waits
    for and the step it joins (fit.py takes those out); the longest gap between the batch's tokens while it ran
    is the step it joined, which shows how much of that overhead stalls the engine's loop (llama-server) rather
    than its API server (vLLM). Its own round, so the decode points' step times stay clean. ``slots``: the
    engines' slots where they say (a slot is left free: with every slot busy, llama-server defers the probe, a
    queue, not overhead). ``(batch, context, prompt tokens, seconds, the batch's longest gap meanwhile)`` per
    engine."""
    if slots:
        batch = max(1, min(batch, min(slots) - 1))
    prompts = [[e.prompt(ctx) for _ in range(batch)] for e in engines]
    await asyncio.gather(*(e.complete(p, 1) for e, ps in zip(engines, prompts, strict=True) for p in ps))
    ready = [asyncio.Event() for _ in engines]
    started = [0] * len(engines)

    def first(i: int) -> None:
        started[i] += 1
        if started[i] == batch:
            ready[i].set()

    async def probe(i: int, e: Streams) -> tuple[float, float, int]:
        await asyncio.wait_for(ready[i].wait(), timeout_s)
        t0 = time.perf_counter()
        s, tokens = await e.complete(e.prompt(16), 1)
        return t0, s, tokens

    streams = asyncio.gather(*(e.stream_times(p, decode_tokens, on_first=functools.partial(first, i))
                               for i, (e, ps) in enumerate(zip(engines, prompts, strict=True)) for p in ps))
    got, times = await asyncio.gather(asyncio.gather(*(probe(i, e) for i, e in enumerate(engines))), streams)
    out = [(batch, float(ctx), tokens, s, _stall(times[i * batch:(i + 1) * batch], t0, t0 + s))
           for i, (t0, s, tokens) in enumerate(got)]
    say(f"tiny prompt beside a decoding batch of {batch} at ~{ctx} tokens: "
        + ", ".join(f"{s * 1000:.1f} ms (batch's longest gap {g * 1000:.1f} ms)" for *_, s, g in out))
    return out
