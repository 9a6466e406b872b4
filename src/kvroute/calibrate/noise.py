"""How noisy the measured engines are, for the simulator's optional noise (:mod:`kvroute.sim.noise`).

Two numbers, both from points `kvroute calibrate` measures anyway or cheaply adds:

* ``step_sigma``: every prefill length of the sweep is measured ``repeats`` times on every engine
  (all engines at once, as for the fit). A prefill of ≥ 512 tokens is one engine step that
  dominates its TTFT, so the spread of ``log(time / the point's median)`` over those repeats is
  the spread of a step's time. Dividing by the point's median removes the length's own effect;
  the pooled standard deviation (one degree of freedom per point spent on its median) is the
  log-normal sigma. Shorter prompts are left out: their TTFT is mostly the per-request overhead,
  which the second number describes.
* ``api_delay_s``: ``noise_probes`` rounds of a tiny fresh prompt (``max_tokens: 1``) on every
  engine at once. Its TTFT is the engine's per-request overhead (HTTP, tokenizing, handing the
  task to the step loop) plus one tiny step; the fastest probe of each engine is taken as its
  fixed part, and the mean excess over it is the mean of the simulator's exponential extra delay
  (quantiles reported beside it, to see how well an exponential fits). Times are not divided for
  shared cores: this delay is outside the engines' steps, which are what the simulator's host
  sharing stretches.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from kvroute.stats import percentile

STEP_MIN_TOKENS = 512  # prefills at least this long count for the step noise (see the module docstring)


def step_sigma(prefill: list[tuple[int, int, float]]) -> tuple[float, int]:
    """The log-normal sigma of a step's time from the sweep's ``(target, tokens, seconds)`` prefill
    points, and how many points it rests on (0: too few repeats to say)."""
    by_len: dict[int, list[float]] = defaultdict(list)
    for n, tokens, s in prefill:
        if tokens >= STEP_MIN_TOKENS and s > 0:
            by_len[n].append(s)
    sq, dof, used = 0.0, 0, 0
    for times in by_len.values():
        if len(times) < 2:
            continue
        mid = statistics.median(times)
        sq += sum(math.log(t / mid) ** 2 for t in times)
        dof += len(times) - 1
        used += len(times)
    return (math.sqrt(sq / dof), used) if dof else (0.0, 0)


def api_delay(probes: list[tuple[int, float]]) -> dict:
    """The mean extra per-request delay over each engine's fastest probe, from ``(engine index,
    seconds)`` probe TTFTs, with the excess's quantiles and the fixed part per engine."""
    by_engine: dict[int, list[float]] = defaultdict(list)
    for i, s in probes:
        by_engine[i].append(s)
    excess: list[float] = []
    fixed = {}
    for i, times in sorted(by_engine.items()):
        if len(times) < 2:
            continue
        ordered = sorted(times)
        fixed[i] = ordered[0]
        excess.extend(t - ordered[0] for t in ordered[1:])  # the fastest is the reference, not a sample
    if not excess:
        return {"api_delay_s": 0.0, "probes": len(probes)}
    return {"api_delay_s": statistics.fmean(excess), "probes": len(probes),
            "excess_p50_s": percentile(excess, 0.5), "excess_p90_s": percentile(excess, 0.9),
            "excess_max_s": max(excess), "fixed_s": statistics.fmean(fixed.values())}
