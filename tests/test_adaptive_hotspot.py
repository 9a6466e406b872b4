"""LMetric's two-phase KV-hotspot detector (policy/adaptive/hotspot): when filtering starts, holds, stops."""

from __future__ import annotations

import pytest

from kvroute.policy.adaptive.hotspot import HotspotDetector


def _benign(i):
    # 4 classes take turns (x = 1/4), each cached on 4 of 16 instances: x/x̄ = 1/3 = |M|/|M̄| (Equation 2 holds)
    return i % 4, 4, 12, True


def _hot(i):
    # one class is 3/4 of the traffic and cached on 1 of 16 instances: x/x̄ = 3 > 1/15; the rest uncached
    return (7, 1, 15, True) if i % 4 else (None, 0, 16, False)


def _prefers_others(i):
    # hot (1 of 8 instances, the whole traffic) but never 2 consecutive preferences for the holder (Equation 4)
    return 1, 1, 7, i >= 8 and bool(i % 2)


def _hot_then_spread(i):
    # hot until request 60, then the prefix is cached on 15 of 16 instances: Equation 2 holds again
    return (7, 1 if i < 60 else 15, 15 if i < 60 else 1, True) if i % 4 else (None, 0, 16, False)


# traffic, window, requests → first request filtered (None: never), filtering at the end, filter events
CASES = [
    pytest.param(_benign, 32, 500, None, False, 0, id="benign-equation-2-holds"),
    # silent until the window is full (request 31); phase 1 alarms; > 2·|M| = 2 consecutive → request 34
    pytest.param(_hot, 32, 64, 34, True, 1, id="hotspot-two-phases"),
    pytest.param(_prefers_others, 8, 58, None, False, 0, id="holder-not-preferred"),
    pytest.param(_hot_then_spread, 32, 64, 34, False, 1, id="alarm-clears-when-spread"),
]


@pytest.mark.parametrize(("traffic", "window", "n", "first", "filtering_at_end", "events"), CASES)
def test_when_the_detector_filters(traffic, window, n, first, filtering_at_end, events):
    det = HotspotDetector(window=window)
    out = [det.record(*traffic(i)) for i in range(n)]
    assert (out.index(True) if True in out else None) == first
    assert det.state()["filter_events"] == events
    assert (det.state()["classes_filtering"] == 1.0) == filtering_at_end
    if first is not None and filtering_at_end:
        # every class request after the first filtered one is filtered while the alarm holds
        assert all(v for i, v in enumerate(out) if i >= first and traffic(i)[0] is not None)


def test_peek_predicts_record_without_learning():
    det = HotspotDetector(window=32)
    for i in range(64):
        args = _hot(i)
        before = det.state()
        peeked = det.peek(*args)
        assert det.state() == before  # deciding is a dry run
        assert det.record(*args) == peeked


def test_a_window_under_two_is_refused():
    with pytest.raises(ValueError, match="window"):
        HotspotDetector(window=1)
