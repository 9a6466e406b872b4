"""How much one repeat of a calibration sweep moves what the fit gets, and whether to take another (issue 21w).

Every repeat of the sweep (calibrate/measure.py) times each swept point once on every engine, all engines at
once, and the fit takes each point's median over all its samples (fit.py). On the 2-core test machine the
engines' samples of one point in one repeat tend to move together, so a point's median rests on about as many
independent samples as there are repeats, and one fast or slow stretch of the machine can carry a whole kind of
point with it (module docstring of calibrate/speed_probe.py: the machine's speed moves within minutes).

The check is the jackknife (Efron and Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 11: recompute
the estimate with each sample group left out; how far it moves is its variability): per kind of point (cold
prefills, warm prefills, decode steps) and per repeat, the median over that kind's swept points of
log(the point's median without that repeat / its median with all), and :func:`shifts` is the largest of those
over the repeats, as a fraction. Check and repeat: measure.py runs ``Sweep.repeats`` repeats, then more, up to
``Sweep.max_repeats``, while some kind's shift is over ``Sweep.shift_limit`` — keep measuring until the
estimate's variation is below a preset threshold, with a cap on the count (Georges, Buytaert and Eeckhout,
"Statistically Rigorous Java Performance Evaluation", OOPSLA 2007, §5). Two repeats that disagree by 2x the
limit already fail it; one outlying repeat among three does too, and among four it no longer moves a median.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

KINDS = ("prefill", "warm", "decode")


def _samples(m: Any, kind: str) -> list[tuple[tuple, float]]:
    """``kind``'s (swept point, seconds) samples in the Measurements' order."""
    if kind == "prefill":
        return [((n,), s) for n, _, s in m.prefill]
    if kind == "warm":
        return [((ctx, n), s) for ctx, n, _, _, s in m.warm]
    return [((b, ctx), s) for b, ctx, _, s in m.decode]


def shifts(m: Any) -> dict[str, float]:
    """Per kind, how far leaving one repeat out moves its points' medians at most (module docstring), from
    ``m.repeat_ends`` (calibrate/measure.py's Measurements: the lengths of its prefill, warm and decode lists
    after each repeat); a kind that fewer than two repeats measured is left out."""
    out: dict[str, float] = {}
    for k, kind in enumerate(KINDS):
        bounds = [0] + [ends[k] for ends in m.repeat_ends]
        by_point: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
        for r, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            for key, s in _samples(m, kind)[lo:hi]:
                if s > 0:
                    by_point[key].append((r, s))
        repeats = len(m.repeat_ends)
        moved = []
        # points measured in at least two repeats (a point of one repeat has nothing to leave out)
        points = [v for v in by_point.values() if len({r for r, _ in v}) > 1]
        for left_out in range(repeats):
            logs = [math.log(statistics.median(s for r, s in v if r != left_out) / statistics.median(s for _, s in v))
                    for v in points]
            if logs:
                moved.append(abs(statistics.median(logs)))
        if moved:
            out[kind] = math.exp(max(moved)) - 1
    return out


def too_wide(m: Any, limit: float) -> dict[str, float]:
    """The kinds whose :func:`shifts` is over ``limit``, with their shift (empty: none)."""
    return {kind: s for kind, s in shifts(m).items() if s > limit}
