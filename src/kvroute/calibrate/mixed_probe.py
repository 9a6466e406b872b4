"""Measure what a step holding two prompts of different lengths costs against one holding one, and
fit the profile's batch-heterogeneity coefficient ``h_cv`` from it (perf/profile.py).

The step model multiplies a step's attention by H = 1 + h_cv × CV of the lengths it attends over
(every decode's context, every prefill chunk's end), h_cv 0.8 by default after CascadeInfer §2.2
(1.1-2.1x, a GPU decode pass). Nothing had measured it on the engines the fidelity bench runs.
Issue 21j: in bench fidelity's llama.cpp runs a group's cold first turns (~1,550 tokens each) ran
faster live than simulated; in llama-server's own log of one run (issue 21i q3) two cold prompts
launched together (1,564 + 482 tokens in one 2,048-token batch, two slots decoding) took 525-692 ms
where the simulator's step took 724-785 ms, H = 1.29 among the reasons; and on one llama-server
(busy machine, 4 rounds) a 1,536-token prompt sharing its batch with 512 tokens of another took
877 ms (median) where that run's own cold prefills, fitted, predicted 893 ms with H = 1 and
1,089 ms with the default H = 1.4.

Per round and engine (all engines at once, as every calibration point): a *blocker* prompt of
``n`` tokens, then a third of its time alone later (``lead_s`` at most), while the blocker's prefill
runs, either prompt A (``n`` tokens) alone or A and prompt C (``7n/24`` tokens: A + C fit
llama-server's 2,048-token batch for n = 1,536) together; both wait for the blocker's step and
start in the next one (a round where the blocker's first token came before them is dropped). A point is the
seconds from the blocker's first token until A's answer (alone) and until the later of A's and C's
(together), with the prompts' token counts. :func:`fit_h_cv` turns the points into the h_cv at
which the model's ratio of the two equals the measured median ratio: the ratio cancels what both
share (the engines' sharing of the cores, HTTP, the level of the profile's fit).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvroute.perf.profile import HardwareProfile


class Streams(Protocol):
    """What the probe needs of an engine (calibrate/measure.py's ``_Engine``)."""

    def prompt(self, tokens: int) -> str: ...

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]: ...

    async def stream_times(self, prompt: str, max_tokens: int,
                           on_first: Callable[[], None] | None = None) -> list[float]: ...


# (A's prompt tokens, seconds to A's answer alone; A's and C's tokens together, seconds to the later answer)
Point = tuple[int, float, int, int, float]


async def mixed_points(engines: Sequence[Streams], sweep: Any, say: Callable[[str], None],
                       lead_s: float = 0.05) -> list[Point]:
    """The probe's points (module docstring) for ``sweep.mixed_rounds`` rounds; A is the sweep's longest warm
    context (as the engines' context limit let it run)."""
    rounds = sweep.mixed_rounds
    if rounds < 1 or not engines:
        return []
    n = max(sweep.warm_contexts)
    points: list[Point] = []

    async def answer(e: Streams, tokens: int) -> tuple[float, int]:
        _, got = await e.complete(e.prompt(tokens), 1)
        return time.perf_counter(), got

    async def behind(e: Streams, sizes: tuple[int, ...], lead: float) -> tuple[float, list[int]] | None:
        first: list[float] = []
        blocker = asyncio.ensure_future(e.stream_times(e.prompt(n), 1, on_first=lambda: first.append(
            time.perf_counter())))
        await asyncio.sleep(lead)
        sent = time.perf_counter()
        got = await asyncio.gather(*(answer(e, s) for s in sizes))
        await blocker
        if not first or first[0] < sent:
            return None  # the blocker was done before they came: nothing queued behind it
        return max(t for t, _ in got) - first[0], [k for _, k in got]

    async def one(e: Streams, both_first: bool) -> Point | None:
        # the prompts come a third of the blocker's time alone after it (lead_s at most): vLLM's
        # 1,536-token prefill takes ~30 ms on 2 cores, llama-server's ~0.3 s
        alone_s, _ = await e.complete(e.prompt(n), 1)
        lead = min(lead_s, alone_s / 3)
        two, one_ = (n, n * 7 // 24), (n,)
        if both_first:  # the order alternates by round: drift biases neither side
            x, y = await behind(e, two, lead), await behind(e, one_, lead)
        else:
            y, x = await behind(e, one_, lead), await behind(e, two, lead)
        if x is None or y is None:
            return None
        (both, (a2, c)), (alone, (a,)) = x, y
        return a, alone, a2, c, both

    for r in range(rounds):
        got = await asyncio.gather(*(one(e, r % 2 == 1) for e in engines))
        points.extend(p for p in got if p is not None)
        say(f"two prompts in one step (round {r + 1}): " + ", ".join(
            "dropped (the blocker ended first)" if p is None else
            f"{p[1] * 1000:.0f} ms alone, {p[4] * 1000:.0f} ms with {p[3]} more tokens" for p in got))
    return points


def _steps(p: HardwareProfile, h_cv: float, prompts: Sequence[int]) -> float:
    """Seconds the model gives ``prompts`` (started together, FCFS chunks within the profile's token budget)
    until the last one's first token, with heterogeneity coefficient ``h_cv``."""
    q = p.model_copy(update={"h_cv": h_cv})
    left = list(prompts)
    total = q.ttft_overhead_s
    while any(left):
        budget, tokens, attn, ends = q.max_batched_tokens, 0, 0.0, []
        for i, n in enumerate(left):
            c = min(n, budget)
            if c <= 0:
                continue
            done = prompts[i] - n
            tokens += c
            attn += q.attn_rows(c) * (done + c / 2)
            ends.append(done + c)
            budget -= c
            left[i] = n - c
        total += q.step_time(tokens, prefill_attn=attn,
                             h=q.heterogeneity(len(ends), sum(ends), sum(e * e for e in ends)))
    return total


def fit_h_cv(points: list[Point], profile: HardwareProfile, most: float = 10.0) -> float | None:
    """The h_cv (0 to ``most``) at which the model's ratio of the two-prompt wait to the one-prompt wait is the
    measured median ratio (module docstring); 0 where even without the term the model's ratio is at or above it;
    None without points."""
    got = [(a, alone, a2, c, both) for a, alone, a2, c, both in points if alone > 0 and both > 0]
    if not got:
        return None
    measured = statistics.median(both / alone for _, alone, _, _, both in got)
    a = round(statistics.median(p[0] for p in got))
    a2 = round(statistics.median(p[2] for p in got))
    c = round(statistics.median(p[3] for p in got))

    def ratio(h: float) -> float:
        return _steps(profile, h, (a2, c)) / _steps(profile, h, (a,))

    if ratio(0.0) >= measured:
        return 0.0
    if ratio(most) <= measured:
        return most
    lo, hi = 0.0, most
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < measured else (lo, mid)
    return (lo + hi) / 2
