"""The arrival-window token rate (metrics/summary.py: window_token_rate), on hand-computed cases."""

import pytest

from kvroute.metrics.summary import Recorder, window_token_rate


def test_two_requests_counted_by_when_their_tokens_are_generated():
    # Window: arrivals at 0 s and 10 s → 10 s long.
    # A: first token at 2 s, done at 6 s, 5 tokens → all 5 inside the window.
    # B: arrives at 10 s (the window's end): first token at 11 s → none of its 9 tokens count.
    assert window_token_rate([0.0, 10.0], [2.0, 11.0], [6.0, 20.0], [5, 9]) == pytest.approx(0.5)


def test_a_request_straddling_the_window_end_counts_its_first_token_and_a_linear_share():
    # Window 0–10 s. A: first token at 4 s, done at 16 s, 13 tokens: 1 at 4 s, 12 spread over 12 s,
    # of which 6 s fall before 10 s → 1 + 6 = 7 tokens. B: arrives at 10 s, first token at 12 s → 0.
    assert window_token_rate([0.0, 10.0], [4.0, 12.0], [16.0, 14.0], [13, 3]) == pytest.approx(0.7)


def test_no_window_gives_zero():
    assert window_token_rate([], [], [], []) == 0.0
    assert window_token_rate([1.0], [2.0], [3.0], [4]) == 0.0


def test_the_recorders_summary_reports_it_beside_the_makespan_rate():
    rec = Recorder(["r0"])
    rec.complete(sent=0.0, first=4.0, done=16.0, out=13, prompt=10, cached=0, queue_s=0.0, replica="r0", cross=False)
    rec.complete(sent=10.0, first=12.0, done=14.0, out=3, prompt=10, cached=0, queue_s=0.0, replica="r0", cross=False)
    res = rec.result(replica_hours=0.0)
    assert res["window_output_tps"] == pytest.approx(0.7)
    assert res["output_tps"] == pytest.approx(16 / 16)
