"""Measure a step that runs a warm prefill beside a decoding batch, against the decode steps around it
(issue 21k): what the fidelity workload's engines mostly run, a chat turn's ~100 new tokens after
~1,500 cached joining 3-6 sequences that decode.

Why: against two vLLM CPU engines the live decode phase was 1.2-2.1x the simulated one in four of
five quiet fidelity runs (issue 21j), though the engines' compute threads got the share of the
cores that processor sharing gives them and the calibrated decode step (2.9 ms alone for 4
sequences at 1,600 tokens) with that sharing gives ~5 ms a token where vLLM's own histograms
showed 8-10. The calibration's decode sweep times steps of decodes alone; its prefills run alone;
a step holding both had never been timed on these engines.

Per round and engine (all engines at once, as every calibration point): a fresh base prompt of
``ctx`` tokens is sent once (``max_tokens: 1``) so the engine caches it, and ``batch`` fresh
prompts of ``ctx`` tokens likewise; then the ``batch`` prompts are streamed with ``decode_tokens``
output tokens each, and once every stream has had ``settle`` tokens the base plus ``new`` fresh
tokens is sent (``max_tokens: 1``). A point: the decode step before it (the streams' span over
their tokens from the last first token to the probe, calibrate/measure.py ``_step_time``), the
step the prompt joined (per stream the longest gap between two tokens while the prompt was in
flight, the median over the streams, as measure.py's ``_stall``), the prompt's latency, and its
cached and new tokens as the engine counted them. fit.py compares the joined step with the step
model's time for that step (``step_time(new, batch, contexts, attention)``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvroute.calibrate.stream_steps import _stall, _step_time


class Engine(Protocol):
    """What the probe needs of an engine (calibrate/measure.py ``_Engine``)."""

    cached: int | None

    def prompt(self, tokens: int) -> str: ...

    def suffix(self, tokens: int) -> str: ...

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]: ...

    async def stream_times(self, prompt: str, max_tokens: int, on_first: Callable[[], None] | None = None,
                           on_token: Callable[[], None] | None = None) -> list[float]: ...


# (batch, mean decode context, cached, new tokens, decode step s, joined step s, latency s)
Point = tuple[int, float, int, int, float, float, float]


async def mixed_decode_points(engines: Sequence[Engine], sweep: Any, say: Callable[[str], None],
                              settle: int = 6, slots: int | None = None) -> list[Point]:
    """The probe's points (module docstring) for ``sweep.mixed_decode_rounds`` rounds at the sweep's largest
    batch (one below ``slots``, the engines' slot count where they have one: with every slot busy
    llama-server defers the prompt) and longest warm context, with its shortest warm length (the new part
    of a chat turn)."""
    rounds = getattr(sweep, "mixed_decode_rounds", 0)
    if rounds < 1 or not engines:
        return []
    batch, ctx, new = max(sweep.batch_sizes), max(sweep.warm_contexts), min(sweep.warm_lengths)
    if slots:
        batch = max(1, min(batch, slots - 1))  # the base prompt's slot stays idle for the warm prompt
    tokens = max(sweep.decode_tokens, 3 * settle)
    points: list[Point] = []

    async def one(e: Engine) -> Point | None:
        base = e.prompt(ctx)
        prompts = [e.prompt(ctx) for _ in range(batch)]
        await asyncio.gather(e.complete(base, 1), *(e.complete(p, 1) for p in prompts))
        seen = [0] * batch
        ready = asyncio.Event()

        def token(i: int) -> None:
            seen[i] += 1
            if min(seen) >= settle:
                ready.set()

        async def stream(i: int, p: str) -> list[float]:
            return await e.stream_times(p, tokens, on_token=lambda: token(i))

        streams = asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts)))
        try:
            await asyncio.wait_for(ready.wait(), 60)
        except TimeoutError:
            await streams
            return None
        t0 = time.perf_counter()
        s, total = await e.complete(base + " " + e.suffix(new), 1)
        cached = e.cached
        times = await streams
        if cached is None or total <= cached:
            return None
        before = [[x for x in t if x <= t0] for t in times]
        step = _step_time([b[-settle:] for b in before if len(b) >= 3]) if all(len(b) >= 3 for b in before) else None
        if step is None:
            return None
        joined = _stall(times, t0, t0 + s)
        mean_ctx = statistics.fmean(len(b) for b in before) + ctx
        return batch, mean_ctx, cached, total - cached, step, joined, s

    for r in range(rounds):
        got = await asyncio.gather(*(one(e) for e in engines))
        points.extend(p for p in got if p is not None)
        say(f"warm prefill beside a decoding batch (round {r + 1}): " + ", ".join(
            "dropped" if p is None else
            f"{p[3]} new after {p[2]}: decode step {p[4] * 1000:.1f} ms, joined step {p[5] * 1000:.1f} ms, "
            f"latency {p[6] * 1000:.0f} ms" for p in got))
    return points


def fit_mixed_prefill(points: Sequence[Point], profile: Any, sharing: float = 1.0) -> tuple[float | None, dict]:
    """The profile's ``c_prefill_mixed_s`` from the points: per point, the joined step (divided by the
    calibration's ``sharing`` of the cores, as every point is: fit.py) less the step model's time for it
    (the prefill of its new tokens over the cached ones beside ``batch`` decodes, and ``c_admit_s`` for the
    new sequence), over its new tokens; the median, at least 0 (None without points). The report: the
    medians of the joined step and of the decode step before it, measured and modelled."""
    if not points:
        return None, {}
    p = profile
    per_token, joined, model_joined, decode, model_decode = [], [], [], [], []
    for batch, ctx, cached, new, step, got, _ in points:
        dec = p.step_time(decode=batch, decode_ctx=batch * ctx)
        ends = [ctx] * batch + [cached + new]
        mix = p.step_time(new, batch, batch * ctx, p.attn_rows(new) * (cached + new / 2),
                          p.heterogeneity(len(ends), sum(ends), sum(e * e for e in ends))) + p.c_admit_s
        per_token.append((got / sharing - mix) / new)
        joined.append(got / sharing)
        model_joined.append(mix)
        decode.append(step / sharing)
        model_decode.append(dec)
    med = statistics.median
    report = {"points": len(points), "joined_step_s": med(joined), "model_joined_step_s": med(model_joined),
              "decode_step_s": med(decode), "model_decode_step_s": med(model_decode),
              "new_tokens": med(q[3] for q in points), "cached_tokens": med(q[2] for q in points),
              "batch": med(q[0] for q in points)}
    return max(0.0, med(per_token)), report
