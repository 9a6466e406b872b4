"""GORGO v1's online TTFT fit (policy/adaptive/ttft_fit): recovered laws, sample threshold, forgetting."""

from __future__ import annotations

import random

import pytest

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.ttft_fit import CalibratedTTFT, TTFTFit

# a replica's true TTFT law (seconds): intercept + per uncached token + per queued token, and the RTT
LAWS = [
    pytest.param(0.15072, 0.0000938, 0.00002, 0.05, id="gorgo-v1-regression"),  # §4.2: 150.72 ms + 0.0938 ms/token
    pytest.param(0.02, 0.0002, 0.0, 0.0, id="no-queue-cost"),
    pytest.param(0.5, 0.00001, 0.0001, 0.3, id="queue-bound-far-away"),
    pytest.param(0.1, 0.0, 0.00005, 0.01, id="fully-cached-traffic-cost"),
]


@pytest.mark.parametrize(("intercept", "per_uncached", "per_queued", "rtt"), LAWS)
def test_the_fit_recovers_the_replicas_law(intercept, per_uncached, per_queued, rtt):
    fit = TTFTFit(min_samples=8)
    rng = random.Random(0)
    for i in range(200):
        uncached, queued = rng.randrange(100, 4000), rng.randrange(0, 20000)
        fit.dispatched(f"r{i}", "a", uncached, queued, rtt)
        fit.first_token(f"r{i}", intercept + per_uncached * uncached + per_queued * queued + rtt)
    m = fit.model("a")
    assert m is not None and m.samples == 200
    assert m.intercept_s == pytest.approx(intercept, rel=1e-3)
    assert m.per_uncached_s == pytest.approx(per_uncached, rel=1e-3, abs=1e-9)
    assert m.per_queued_s == pytest.approx(per_queued, rel=1e-3, abs=1e-9)
    assert fit.state()["a.ms_per_uncached_token"] == pytest.approx(per_uncached * 1000, rel=1e-3, abs=1e-6)
    assert fit.model("b") is None


# observations, min_samples → is the fit used?
THRESHOLDS = [(0, 8, False), (7, 8, False), (8, 8, True), (3, 3, True), (20, 30, False)]


@pytest.mark.parametrize(("observed", "min_samples", "fitted"), THRESHOLDS)
def test_the_fit_waits_for_min_samples(observed, min_samples, fitted):
    fit = TTFTFit(min_samples=min_samples)
    for i in range(observed):
        fit.observe("a", 100 * i, 50 * (i % 3), 0.2 + 0.001 * i)
    assert (fit.model("a") is not None) == fitted


def test_a_forgotten_request_gives_no_observation():
    fit = TTFTFit(min_samples=8)
    for i in range(7):
        fit.observe("a", 100 * i, 0, 0.2)
    fit.dispatched("x", "a", 10, 10, 0.0)
    fit.forget("x")
    fit.first_token("x", 5.0)  # forgotten: no observation
    assert fit.state()["a.samples"] == 7.0


def test_the_scorer_uses_the_constants_until_the_fit_is_ready():
    """CalibratedTTFT's cost: t_p·uncached + w_queue·queued tokens before min_samples, the fit's ms after."""

    class _St:
        def new_prefill(self, eps):
            return [1000 for _ in eps]

    scorer = CalibratedTTFT(t_p=1.0, w_queue=0.1, min_samples=3)
    ep = Endpoint("a", inflight_tokens=2000)
    assert scorer.values(_St(), [ep]) == [1.0 * 1000 + 0.1 * 2000]
    for i in range(3):  # TTFT − RTT = 0.1 s + 0.1 ms per uncached token
        req = Request(id=f"r{i}", prompt_tokens=0)
        scorer.on_dispatched(req, Endpoint("a", inflight_tokens=0, rtt_s=0.0), new_prefill_tokens=500 * (i + 1))
        scorer.on_first_token(f"r{i}", "a", 0.1 + 0.0001 * 500 * (i + 1))
    assert scorer.values(_St(), [ep])[0] == pytest.approx(1000 * (0.1 + 0.0001 * 1000), rel=1e-3)
