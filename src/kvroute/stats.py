"""The one percentile used outside numpy code: pure Python, so the gateway install (no numpy) has it.

Definition: nearest rank on the 0-based index — the value at ``round(q·(n−1))`` of the sorted
values (Python's ``round``, half to even). It is what GORGO's tuner takes (the ES compares window
p95s this way), it returns a value that was observed, and it costs one index after a sort.
Simulator summaries (:func:`kvroute.metrics.summary.summarize`) need numpy anyway and keep
``np.percentile`` (linear interpolation); with the sample counts they see the two differ by less
than the gap between neighbouring samples.
"""

from __future__ import annotations

from collections.abc import Iterable


def percentile_sorted(sorted_values: list[float], q: float) -> float:
    """The q-quantile (``q`` in [0, 1]) of values already sorted ascending; 0.0 when there are none."""
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (``q`` in [0, 1]) of ``values`` in any order; 0.0 when there are none."""
    return percentile_sorted(sorted(values), q)
