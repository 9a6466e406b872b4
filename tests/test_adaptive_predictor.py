"""llm-d's predicted TTFT (policy/adaptive/predictor): the step-time model's answers and their error."""

from __future__ import annotations

import random

import pytest

from kvroute.model import Endpoint, Request
from kvroute.perf.loader import load_profile
from kvroute.policy.adaptive.predictor import PredictionErrorPlugin, TTFTPredictor

PROFILE = "h20-qwen3-30b-a3b"
IDLE = {"rtt_s": 0.01}

# replica state, uncached, cached → how its TTFT compares with an idle replica's 2000 uncached tokens
CASES = [
    pytest.param(IDLE, 2000, 0, "==", id="idle-baseline"),
    pytest.param(IDLE, 200, 1800, "<", id="a-cache-hit-saves-prefill"),
    pytest.param({"rtt_s": 0.01, "running": 64, "inflight": 64, "inflight_tokens": 64 * 3000}, 2000, 0, ">",
                 id="a-running-batch-slows-each-step"),
    pytest.param({"rtt_s": 0.01, "queued_prefill_tokens": 30000}, 2000, 0, ">", id="queued-prefill-goes-first"),
    pytest.param({"rtt_s": 0.2}, 2000, 0, ">", id="a-farther-replica"),
]


@pytest.mark.parametrize(("state", "uncached", "cached", "relation"), CASES)
def test_prediction_against_an_idle_replica(state, uncached, cached, relation):
    prof = load_profile(PROFILE)
    pred = TTFTPredictor(prof)
    base = pred.predict(Endpoint("idle", **IDLE), uncached=2000, cached=0)
    # an idle replica's prediction is the profile's own single-prompt prefill, plus RTT and overhead
    assert base == pytest.approx(0.01 + prof.ttft_overhead_s + prof.prefill_time(2000), rel=1e-9)
    got = pred.predict(Endpoint("x", **state), uncached, cached)
    assert {"==": got == base, "<": got < base, ">": got > base}[relation]


def test_queued_prefill_costs_more_than_a_busy_batch():
    pred = TTFTPredictor(load_profile(PROFILE))
    busy = Endpoint("b", rtt_s=0.01, running=64, inflight=64, inflight_tokens=64 * 3000)
    queued = Endpoint("c", rtt_s=0.01, queued_prefill_tokens=30000)
    assert pred.predict(queued, 2000, 0) > pred.predict(busy, 2000, 0)


def test_predict_many_is_predict_per_endpoint():
    pred = TTFTPredictor(load_profile(PROFILE))
    rng = random.Random(3)
    for _ in range(200):
        eps = [Endpoint(f"r{i}", rtt_s=rng.random() / 10, running=rng.choice([0, 3, 300]),
                        inflight=(n := rng.randint(0, 40)), inflight_tokens=n * rng.randint(0, 5000),
                        queued_prefill_tokens=rng.choice([0, 700, 40_000])) for i in range(8)]
        prompt, block = rng.randint(1, 20_000), 64
        matches = {e.id: rng.randint(0, 400) for e in eps if rng.random() < 0.6}
        many = pred.predict_many(eps, prompt, block, matches)
        one = []
        for e in eps:
            cached = min(prompt, block * matches.get(e.id, 0))
            one.append(pred.predict(e, prompt - cached, cached))
        assert many == one  # bit for bit: simulate's fixed-seed JSON must not move


# (predicted, measured) TTFTs of dispatched requests → scored, mean |error| / measured, share off by > 20 %
ERRORS = [
    pytest.param([], 0, 0.0, 0.0, id="nothing-scored"),
    pytest.param([(1.0, 1.0), (2.0, 2.0)], 2, 0.0, 0.0, id="exact"),
    pytest.param([(1.1, 1.0), (0.5, 1.0)], 2, 0.3, 0.5, id="one-within-one-off"),
    pytest.param([(3.0, 1.0), (1.0, 0.0)], 1, 2.0, 1.0, id="zero-ttft-not-scored"),
]


@pytest.mark.parametrize(("pairs", "scored", "mean_err", "share"), ERRORS)
def test_the_plugin_scores_its_predictions(pairs, scored, mean_err, share):
    plugin = PredictionErrorPlugin()
    for i, (predicted, measured) in enumerate(pairs):
        rid = f"r{i}"
        plugin.last = (rid, [Endpoint("a"), Endpoint("b")], [predicted, 99.0])  # the decision's predictions
        plugin.on_dispatched(Request(id=rid), Endpoint("a"), 0)
        plugin.on_first_token(rid, "a", measured)
    st = plugin.state()
    assert st["scored"] == scored
    assert st["mean_abs_rel_error"] == pytest.approx(mean_err)
    assert st["share_over_20pct"] == pytest.approx(share)


def test_a_request_dispatched_elsewhere_or_failed_is_not_scored():
    plugin = PredictionErrorPlugin()
    plugin.last = ("r0", [Endpoint("a")], [1.0])
    plugin.on_dispatched(Request(id="r1"), Endpoint("a"), 0)  # not the decision's request
    plugin.on_first_token("r1", "a", 1.0)
    plugin.last = ("r2", [Endpoint("a")], [1.0])
    plugin.on_dispatched(Request(id="r2"), Endpoint("a"), 0)
    plugin.on_failed("r2", "a")
    plugin.on_first_token("r2", "a", 1.0)
    assert plugin.state()["scored"] == 0
