"""Step times read off token streams (calibrate/measure.py and its probes; moved out of measure.py in
issue 21k so that probes can use them without importing the sweep)."""

from __future__ import annotations

import statistics


def _step_time(streams: list[list[float]]) -> float | None:
    """Time per token while every stream decodes together (calibrate/measure.py, Decode): per stream, the span from its
    first to its last token inside that window over the tokens between; the median over streams. Spans, not single gaps:
    an engine or the network may deliver tokens in bursts, and the median gap of a bursty stream is far below the step
    time. A stream whose tokens inside the window all came in one burst (a span under 1 µs) says nothing about the step
    and is left out: against vLLM on a loaded machine such streams gave 0.0 ms "steps"."""
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    steps = []
    for t in streams:
        inside = [x for x in t if start <= x <= end]
        if len(inside) >= 3 and inside[-1] - inside[0] > 1e-6:
            steps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(steps) if steps else None


def _stall(streams: list[list[float]], t0: float, t1: float) -> float:
    """The longest gap between two tokens of one stream that ends while [t0, t1] runs (the step
    the probe joined), the median over the streams; 0 when no token came meanwhile."""
    gaps = [max((b - a for a, b in zip(t, t[1:]) if t0 <= b <= t1 + 0.001), default=0.0) for t in streams]
    return statistics.median(gaps) if gaps else 0.0
