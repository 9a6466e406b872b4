"""The adaptive mechanisms' pure cores: GORGO v2's (1+1)-ES, GORGO v1's TTFT fit, LMetric's
hotspot detector and the predicted-TTFT model."""

from __future__ import annotations

import math
import random

import pytest

from kvroute.model import Endpoint
from kvroute.perf.loader import load_profile
from kvroute.policy.adaptive.es_tuner import GORGO_RANGES, OnePlusOneES, WeightRange
from kvroute.policy.adaptive.hotspot import HotspotDetector
from kvroute.policy.adaptive.predictor import TTFTPredictor
from kvroute.policy.adaptive.ttft_fit import TTFTFit
from kvroute.stats import percentile_sorted


def _bowl(w: dict[str, float], rng: random.Random) -> float:
    """A TTFT whose p95 is lowest at w_rtt 0.3, w_queue 0.4 (both inside GORGO's ranges)."""
    d = math.log(w["w_rtt"] / 0.3) ** 2 + math.log(w["w_queue"] / 0.4) ** 2
    return 1.0 + d + 0.05 * rng.random()


def _drive(es: OnePlusOneES, n: int, seed: int = 7) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        es.observe(_bowl(es.weights, rng))


def test_nearest_rank_is_gorgos_quantile():
    s = sorted(float(i) for i in range(128))
    assert percentile_sorted(s, 0.95) == s[round(0.95 * 127)] == 121.0


def test_es_steps_at_128_then_every_32():
    es = OnePlusOneES(seed=1)
    _drive(es, 127)
    assert es.proposed == 0 and es.weights == {"w_rtt": 0.5, "w_queue": 0.1}
    _drive(es, 1)
    assert es.proposed == 1 and es.weights != {"w_rtt": 0.5, "w_queue": 0.1}
    _drive(es, 31)
    assert es.proposed == 1
    _drive(es, 1)
    assert es.proposed == 2  # 672 samples = 128 + 17·32 → the paper's 18th step


def test_es_improves_the_window_and_stays_in_range():
    es = OnePlusOneES(seed=3)
    _drive(es, 128)
    start = es.parent_p95
    _drive(es, 4000)
    assert es.accepted >= 1 and es.parent_p95 is not None and start is not None
    assert es.parent_p95 < start
    for k, r in GORGO_RANGES.items():
        assert r.lo <= es.parent[k] <= r.hi
    # the optimum (0.3, 0.4) is approached from the start (0.5, 0.1)
    assert abs(math.log(es.parent["w_queue"] / 0.4)) < abs(math.log(0.1 / 0.4))


def test_es_is_deterministic_under_a_seed_and_seed_dependent():
    runs = []
    for seed in (5, 5, 6):
        es = OnePlusOneES(seed=seed)
        _drive(es, 1500)
        runs.append(es.state())
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_es_sigma_follows_the_one_fifth_rule_and_converges():
    es = OnePlusOneES(seed=2)
    # a flat objective: no offspring ever beats the parent by 0.5 %, so σ shrinks by 0.817 a step
    for _ in range(128 + 32 * 12):
        es.observe(1.0)
    assert es.accepted == 0
    assert es.converged and es.sigma < 0.05
    assert es.weights == es.parent == {"w_rtt": 0.5, "w_queue": 0.1}
    proposed = es.proposed
    for _ in range(200):
        es.observe(1.0)
    assert es.proposed == proposed  # converged: serves the parent, proposes nothing


def test_es_frozen_serves_fixed_weights_and_measures():
    es = OnePlusOneES(frozen={"w_rtt": 0.276, "w_queue": 0.5}, seed=1)
    _drive(es, 1000)
    assert es.weights == {"w_rtt": 0.276, "w_queue": 0.5}
    assert es.proposed == 0 and es.state()["window_p95_s"] > 0 and es.state()["frozen"] == 1.0


def test_weight_range_rejects_non_positive_bounds():
    with pytest.raises(ValueError, match="lo"):
        WeightRange(0.1, 0.0, 0.5)
    with pytest.raises(ValueError, match="hop"):
        OnePlusOneES(window=16, hop=32)


def test_ttft_fit_recovers_gorgo_v1_regression():
    fit = TTFTFit(min_samples=8)
    rng = random.Random(0)
    for i in range(200):
        uncached, queued = rng.randrange(100, 4000), rng.randrange(0, 20000)
        ttft = 0.15072 + 0.0000938 * uncached + 0.00002 * queued + 0.05  # + 50 ms RTT
        fit.dispatched(f"r{i}", "a", uncached, queued, 0.05)
        fit.first_token(f"r{i}", ttft)
    m = fit.model("a")
    assert m is not None and m.samples == 200
    assert m.intercept_s == pytest.approx(0.15072, rel=1e-3)
    assert m.per_uncached_s * 1000 == pytest.approx(0.0938, rel=1e-3)
    assert m.per_queued_s * 1000 == pytest.approx(0.02, rel=1e-3)
    assert fit.model("b") is None
    assert fit.state()["a.ms_per_uncached_token"] == pytest.approx(0.0938, rel=1e-3)


def test_ttft_fit_waits_for_samples_and_forgets_failures():
    fit = TTFTFit(min_samples=8)
    for i in range(7):
        fit.observe("a", 100 * i, 0, 0.2)
    assert fit.model("a") is None
    fit.dispatched("x", "a", 10, 10, 0.0)
    fit.forget("x")
    fit.first_token("x", 5.0)  # forgotten: no observation
    assert fit.state()["a.samples"] == 7.0


def test_hotspot_stays_silent_when_equation_2_holds():
    det = HotspotDetector(window=32)
    # 4 classes take turns (x = 1/4), each cached on 4 of 16 instances: x/x̄ = 1/3 = |M|/|M̄| → benign
    for i in range(500):
        assert not det.record(i % 4, holders=4, others=12, prefers_holder=True)
    assert det.state()["filter_events"] == 0.0


def test_hotspot_two_phases_then_clears():
    det = HotspotDetector(window=32)
    # one class is 3/4 of the traffic and cached on 1 of 16 instances: x/x̄ = 3 > 1/15
    out = []
    for i in range(64):
        klass = 7 if i % 4 else None
        out.append(det.record(klass, holders=1, others=15, prefers_holder=True) if klass else
                   det.record(None, 0, 16, False))
    # silent until the window is full; then phase 1 alarms; > 2·|M| = 2 consecutive → filter
    # the window fills at request 31 (class 7: run 1); 33 (run 2); 34 is the third → filtered
    assert out.index(True) == 34
    # class requests keep being filtered while the alarm holds
    assert all(v for i, v in enumerate(out) if i >= 34 and i % 4)
    assert det.state()["filter_events"] == 1.0 and det.state()["classes_filtering"] == 1.0
    # the prefix spread to 15 of 16 instances: Equation 2 holds again, the alarm clears
    assert not det.record(7, holders=15, others=1, prefers_holder=True)
    assert det.state()["classes_alarmed"] == 0.0


def test_hotspot_run_resets_when_the_class_prefers_others():
    det = HotspotDetector(window=8)
    for _ in range(8):
        det.record(1, holders=1, others=7, prefers_holder=False)
    for i in range(50):  # alternate: never 2 consecutive preferences for the holder
        assert not det.record(1, holders=1, others=7, prefers_holder=bool(i % 2))


def test_predictor_grows_with_queue_batch_and_uncached_tokens():
    prof = load_profile("h20-qwen3-30b-a3b")
    pred = TTFTPredictor(prof)
    idle = Endpoint("a", rtt_s=0.01)
    base = pred.predict(idle, uncached=2000, cached=0)
    assert base > 0.01 + prof.ttft_overhead_s
    assert pred.predict(idle, uncached=200, cached=1800) < base  # a cache hit saves prefill
    busy = Endpoint("b", rtt_s=0.01, running=64, inflight=64, inflight_tokens=64 * 3000)
    assert pred.predict(busy, 2000, 0) > base
    queued = Endpoint("c", rtt_s=0.01, queued_prefill_tokens=30000)
    assert pred.predict(queued, 2000, 0) > pred.predict(busy, 2000, 0) > base
    # an idle replica's prediction is the profile's own single-prompt prefill, plus RTT/overhead
    assert base == pytest.approx(0.01 + prof.ttft_overhead_s + prof.prefill_time(2000), rel=1e-9)


def test_predict_many_is_predict_per_endpoint():
    pred = TTFTPredictor(load_profile("h20-qwen3-30b-a3b"))
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
