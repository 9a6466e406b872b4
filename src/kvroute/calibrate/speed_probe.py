"""How fast the engines run now against how fast they ran when calibrated (issue 21k): a short probe
that `kvroute bench fidelity` runs right after its calibration (the reference) and again before and
after every live run, so that the simulator of that run gets the engines' speed of that moment.

Why: the fidelity bench calibrates once and then runs 4 policies x N repeats live over 5-10 minutes,
and the 2-core test machine's speed moves by more than the model's terms within minutes. Issue 21g:
two quiet runs of the same code nine minutes apart gave 18 and 10 of 20 ratios within 20 %, the
second's live side slower throughout (req/s 7.7-11.6 against 9.1-14.0) though its own calibration,
just before, was not slower. Issue 21j: the same again (19 and 15 of 20; its calibration 3-9 %
faster than the first run's, its live decode phase 241-313 ms against 134-291 simulated). A profile
fitted minutes earlier describes the engines of minutes earlier.

The probe, on every engine at once (as every calibration point): one fresh prompt of
``prefill_tokens`` tokens, streamed with ``decode_tokens`` output tokens. Its time to the first token
is a cold prefill (with the per-request overhead); the span of its later tokens over their count is
a decode step at batch 1 and about that context (calibrate/measure.py ``_step_time``). A round gives
one of each per engine; :func:`speed_of` takes the medians over engines and rounds. The factor of a
live run is (probe before + probe after) / 2 over the reference, per kind (:func:`factors`), and
:func:`scaled` multiplies the profile's time constants by it: the prefill factor the prefill and
per-request terms, the decode factor the per-step and decode terms. Nothing is fitted to the live
run: the probe's prompts are not the workload's, and the factors are fixed before the live run's
numbers are known.

The reference is the profile's own prediction of the probe (:func:`predicted`), not a probe taken
after the calibration (issue 21o): the profile describes the engines as they ran during the sweep,
and a probe a minute later already ran at another speed — on issue 21l's llama.cpp run the probe
after the calibration took 296 ms where the profile gives 397 ms for the same prefill (its own sweep
point measured 411 ms), so every factor came out ×1.34 too high, and its replay had 7 of 20 ratios
within 20 % with them against 18 without; against the prediction (with each run's measured
background, as below) it has 20 of 20 (16 within 10 %, pooled TTFT p99 4 of 4).

Measured (issue 21k, `quiet`, two vLLM CPU engines, 3 repeats): the probe's own spread between runs
was larger than the drift it was to correct — the same 1,024-token prefill took 166-289 ms around
the 12 live runs (the reference 193 ms), a 6-9 ms decode step 6.3-13.7 ms — and the factors
(x1.1-1.3) made the comparison worse: 7 of 20 ratios within 20 % with them, 14 without, in the same
run. Issue 21o's quiet runs, factors against the prediction with each run's background: vLLM 7 and 17 of 20
with them against 17 and 19 as calibrated, llama.cpp 16 against 15 (replayed). So `bench fidelity` leaves it
off unless asked (``--speed probe``).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from kvroute.calibrate.stream_steps import _step_time
from kvroute.perf.profile import HardwareProfile


class Streams(Protocol):
    """What the probe needs of an engine (calibrate/measure.py ``_Engine``)."""

    def prompt(self, tokens: int) -> str: ...

    async def stream_times(self, prompt: str, max_tokens: int) -> list[float]: ...


@dataclass
class Speed:
    """One probe: the median cold prefill's time to its first token and the median decode step (None:
    no stream gave one), in seconds, over ``points`` prompts."""

    prefill_s: float
    decode_s: float | None
    points: int

    def as_dict(self) -> dict[str, Any]:
        """The probe as the fidelity JSON stores it."""
        return asdict(self)


async def probe(engines: Sequence[Streams], rounds: int = 3, prefill_tokens: int = 1024,
                decode_tokens: int = 24) -> Speed:
    """``rounds`` rounds of one streamed fresh prompt per engine, all engines at once (module docstring)."""
    import time

    prefills: list[float] = []
    steps: list[float] = []

    async def one(e: Streams) -> tuple[float, list[float]]:
        t0 = time.perf_counter()
        times = await e.stream_times(e.prompt(prefill_tokens), decode_tokens)
        return t0, times

    for _ in range(rounds):
        for t0, times in await asyncio.gather(*(one(e) for e in engines)):
            if not times:
                continue
            prefills.append(times[0] - t0)
            if len(times) >= 3:
                step = _step_time([times[1:]])
                if step is not None:
                    steps.append(step)
    if not prefills:
        raise ValueError("the speed probe got no token from any engine")
    return Speed(statistics.median(prefills), statistics.median(steps) if steps else None, len(prefills))


def predicted(profile: HardwareProfile, engines: int, host_cores: int | None, prefill_tokens: int = 1024,
              decode_tokens: int = 24, background: float = 0.0) -> Speed:
    """What ``profile`` says :func:`probe` measures on ``engines`` engines probed at once on ``host_cores``
    shared cores (None: a machine each) where other work takes ``background`` cores: the cold prefill
    (``ttft_overhead_s`` plus its steps, chunked by ``max_batched_tokens``) and a batch-1 decode step at the
    middle of the probe's output, both times the processor sharing the simulator applies while every engine
    steps (sim/host.py). A live run's factors take the background that run measured, as its simulation does:
    without it the prediction on two vLLM engines was ×1.35-1.56 too fast (issue 21o: their calibration had
    divided its times by 1.35 for 0.52 background cores, the live runs measured 0.72)."""
    free = host_cores - background if host_cores else 0.0
    share = max(1.0, engines / free) if host_cores and free > 0 else 1.0
    prefill, done = profile.ttft_overhead_s, 0
    while done < prefill_tokens:
        chunk = min(profile.max_batched_tokens, prefill_tokens - done)
        prefill += profile.step_time(chunk, prefill_attn=profile.attn_rows(chunk) * (done + chunk / 2))
        done += chunk
    step = profile.step_time(decode=1, decode_ctx=prefill_tokens + decode_tokens / 2)
    return Speed(prefill * share, step * share, 0)


def speed_of(stored: dict[str, Any] | None) -> Speed | None:
    """A :class:`Speed` back from its stored dict (None stays None)."""
    return None if stored is None else Speed(**stored)


def factors(reference: Speed, before: Speed, after: Speed | None = None) -> dict[str, float]:
    """How much slower (> 1) or faster the engines ran around a live run than at the reference: per kind the
    mean of the probes before and after (``after`` None: before alone) over the reference; a decode factor
    the probes could not give is the prefill one."""
    probes = [before] + ([after] if after is not None else [])
    prefill = statistics.fmean(p.prefill_s for p in probes) / reference.prefill_s
    steps = [p.decode_s for p in probes if p.decode_s]
    decode = statistics.fmean(steps) / reference.decode_s if steps and reference.decode_s else prefill
    return {"prefill": prefill, "decode": decode}


# the profile's time terms by the probe that measures them (perf/profile.py): what a prefill and a
# request's way in cost (the cold prefill's time to its first token), and what every step costs
PREFILL_TERMS = ("c_prefill_s", "c_prefill_attn_s", "ttft_overhead_s", "ttft_overhead_busy_s", "c_admit_s",
                 "c_prefill_mixed_s", "slot_save_s_per_token")
DECODE_TERMS = ("c0_s", "c_decode_s", "c_attn_s", "c_attn_fixed_s")


def scaled(profile: HardwareProfile, f: dict[str, float]) -> HardwareProfile:
    """``profile`` with its prefill terms times ``f["prefill"]`` and its decode terms times ``f["decode"]``;
    a newcomer point's step length alone moves with the prefill factor (its factor, a ratio, does not)."""
    update: dict[str, Any] = {}
    for names, k in ((PREFILL_TERMS, f["prefill"]), (DECODE_TERMS, f["decode"])):
        for name in names:
            value = getattr(profile, name)
            if value is not None:
                update[name] = value * k
    update["newcomer_slowdown"] = [p.model_copy(update={"solo_s": p.solo_s * f["prefill"]})
                                   for p in profile.newcomer_slowdown]
    return profile.model_copy(update=update)
