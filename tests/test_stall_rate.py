"""The stall detector's prefill allowance (gateway/outlier.py) learns its seconds per prompt token
only from prompts long enough to be prefill-dominated, as a median: a cold engine's slow first
reply to a short prompt (0.12-0.14 s per token on a vLLM CPU engine) no longer gives a short prompt
waiting on a frozen engine 1.7 s more before it is ejected. The detector is pure (the caller passes
the clock), so these drive it with the timings seen, not a live engine (tests/test_vllm_streams.py
does that)."""

from __future__ import annotations

import pytest

from kvroute.gateway.outlier import PRIOR_S_PER_TOKEN, RATE_MIN_TOKENS, StallDetector

SHORT = 13  # tokens of a short prompt: 1.7 s of allowance at 0.13 s per token


def _stream(detector: StallDetector, prompt: int, start: float, ttft: float, until: float, gap: float = 0.05):
    """An attempt whose first token comes ``ttft`` after ``start``, then one every ``gap`` until ``until``."""
    a = detector.begin("r", prompt, start)
    t = start + ttft
    while t <= until:
        a.progressed(t)
        t += gap
    return a


def test_a_cold_first_reply_to_a_short_prompt_teaches_no_rate_and_the_freeze_is_out_at_the_base():
    detector = StallDetector(factor=10, min_s=1, max_s=3)
    w = detector.watch("r")
    long = _stream(detector, SHORT, 0.0, 0.13 * SHORT, 10.0)  # the cold first reply: 1.69 s to its first token
    assert w.first_tokens == 1 and w.s_per_token is None  # no prefill rate from 13 tokens of fixed costs
    assert w.short_s_per_token == pytest.approx(0.13)
    # the engine freezes at 10.0 (its last token); a short prompt arrives and waits for its first token
    short = detector.begin("r", SHORT, 10.0)
    # the base threshold is 3 s (10 × the 1.69 s first gap, capped); the short prompt adds its prefill
    # at the prior alone (13 × 1e-4 s), not 13 × 0.13 = 1.7 s
    assert w.threshold(10.0, 10, 1, 3) == pytest.approx(3 + SHORT * PRIOR_S_PER_TOKEN)
    assert not list(detector.sweep(12.9))
    assert [name for name, _, _ in detector.sweep(13.1)] == ["r"]  # was 14.7 s: 4.7 s of silence
    w.end(long)
    w.end(short)


def test_a_lone_short_prompt_on_a_replica_that_answered_before_is_judged():
    """The first-token rule (no verdict before a replica ever produced one) counts short replies too."""
    detector = StallDetector(factor=10, min_s=1, max_s=3)
    w = detector.watch("r")
    w.end(_stream(detector, SHORT, 0.0, 0.5, 2.0))
    lone = detector.begin("r", SHORT, 20.0)
    assert w.s_per_token is None and w.threshold(20.0, 10, 1, 3) < 3.01
    assert [name for name, _, _ in detector.sweep(23.1)] == ["r"]
    w.end(lone)


def test_the_rate_is_the_median_of_long_prompts_so_one_cold_one_moves_it_little():
    detector = StallDetector(factor=10, min_s=1, max_s=3)
    w = detector.watch("r")
    w.end(_stream(detector, 2000, 0.0, 8.0, 8.0))  # cold: 4 ms per token
    for k in range(4):  # warm: 0.25 ms per token
        w.end(_stream(detector, 2000, 20.0 + 10 * k, 0.5, 20.5 + 10 * k))
    w.end(_stream(detector, RATE_MIN_TOKENS - 1, 70.0, 2.0, 72.0))  # a short one: no sample
    assert w.s_per_token == pytest.approx(0.25e-3)  # an EWMA of weight 0.2 read 4.6 ms here
    big = detector.begin("r", 40000, 100.0)  # 10 s of prefill expected, plus the 3 s base
    assert not list(detector.sweep(112.5))
    assert [name for name, _, _ in detector.sweep(113.5)] == ["r"]
    w.end(big)


def test_before_any_long_prompt_a_long_one_is_allowed_the_short_prompts_pace():
    """Until a long prompt has taught the rate, the short ones' time to first token per token bounds
    it from above: a long prompt is given at least its prefill on a slow engine (errs toward waiting)."""
    detector = StallDetector(factor=10, min_s=1, max_s=3)
    w = detector.watch("r")
    w.end(_stream(detector, SHORT, 0.0, 0.13 * SHORT, 3.0))
    long = detector.begin("r", 1500, 10.0)  # 195 s at 0.13 s per token, plus a base decayed to ~1.6 s by then
    assert not list(detector.sweep(10.0 + 190.0))
    assert [name for name, _, _ in detector.sweep(10.0 + 200.0)] == ["r"]
    w.end(long)
