"""GORGO v2's (1+1)-ES (policy/adaptive/es_tuner): when it steps, what it keeps, how σ moves."""

from __future__ import annotations

import math
import random

import pytest

from kvroute.policy.adaptive.es_tuner import GORGO_RANGES, OnePlusOneES, WeightRange
from kvroute.policy.adaptive.es_tuner.plugin import TunerPlugin
from kvroute.stats import percentile_sorted

START = {"w_rtt": 0.5, "w_queue": 0.1}


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


# samples observed → steps proposed: the first evaluation at 128 (window), then one every 32 (hop);
# 672 samples = 128 + 17·32 would be the paper's 18th step
STEPS = [(0, 0), (127, 0), (128, 1), (159, 1), (160, 2), (191, 2), (192, 3)]


@pytest.mark.parametrize(("samples", "proposed"), STEPS)
def test_es_steps_at_the_window_then_every_hop(samples, proposed):
    es = OnePlusOneES(seed=1)
    _drive(es, samples)
    assert es.proposed == proposed
    assert (es.weights == START) == (proposed == 0)  # the first offspring is served after the first step


# objective, judge, samples → what the search must have done
OUTCOMES = [
    # a bowl with its optimum at (0.3, 0.4), each offspring judged on its own hop: offspring are
    # accepted, the parent's p95 falls, w_queue moves up, σ shrinks to convergence near the optimum
    pytest.param("bowl", "hop", 4128, {"accepted": True, "improved": True, "converged": True}, id="bowl-hop"),
    # the same bowl judged on the paper's rolling window (96 of its 128 first tokens served under
    # earlier offspring): fewer acceptances, but the released tuner's tolerance still lets the
    # parent improve before σ shrinks to convergence
    pytest.param("bowl", "window", 4128, {"accepted": True, "improved": True, "converged": True}, id="bowl-window"),
    # flat: every offspring ties its parent and the released tuner accepts ties (p95 below 1.005 ×
    # the parent's), so the success rate is 1, σ grows once eight outcomes are in and the search
    # never converges: it wanders within the ranges
    pytest.param("flat", "window", 128 + 32 * 12, {"accepted": True, "improved": False, "converged": False},
                 id="flat"),
]


@pytest.mark.parametrize(("objective", "judge", "samples", "expect"), OUTCOMES)
def test_es_outcome_per_objective(objective, judge, samples, expect):
    es = OnePlusOneES(seed=3, judge=judge)
    rng = random.Random(7)
    first_p95 = None
    for i in range(samples):
        es.observe(_bowl(es.weights, rng) if objective == "bowl" else 1.0)
        if i == 127:
            first_p95 = es.parent_p95
    assert (es.accepted >= 1) == expect["accepted"]
    assert es.parent_p95 is not None and first_p95 is not None
    assert (es.parent_p95 < first_p95) == expect["improved"]
    assert es.converged == expect["converged"]
    for k, r in GORGO_RANGES.items():
        assert r.lo <= es.parent[k] <= r.hi
    if expect["improved"]:
        assert abs(math.log(es.parent["w_queue"] / 0.4)) < abs(math.log(0.1 / 0.4))
    if expect["converged"]:
        assert es.sigma < 0.05 and es.weights == es.parent
        proposed = es.proposed
        for _ in range(200):
            es.observe(1.0)
        assert es.proposed == proposed  # converged: serves the parent, proposes nothing
    else:
        assert es.accepted == es.proposed - 1 and es.sigma > 0.5  # every judged offspring passed


@pytest.mark.parametrize(("outcomes", "sigma"), [
    ([False] * 7, 0.5),  # under eight outcomes σ does not move (tuner.py: a full history first)
    ([False] * 8, 0.5 * 0.817),  # 0 of 8 < 1/5: shrink
    ([True] + [False] * 7, 0.5 * 0.817),  # 1/8 < 1/5: shrink
    ([True, True] + [False] * 6, 0.5 / 0.817),  # 2/8 > 1/5: grow
])
def test_sigma_follows_the_released_one_fifth_rule(outcomes, sigma):
    """σ as GORGO's gorgo/tuner.py moves it: only with eight outcomes recorded, by their rate."""
    es = OnePlusOneES(seed=1, window=8, hop=1, judge="hop")  # each offspring judged on its one sample
    for _ in range(8):
        es.observe(1.0)  # the first full window scores the parent at 1.0
    best = 1.0
    for won in outcomes:
        best *= 0.9 if won else 1.0
        es.observe(best if won else 5.0)  # a win beats the parent, a loss is far worse
    assert es.accepted == sum(outcomes)
    assert es.sigma == pytest.approx(sigma)


def test_es_is_deterministic_under_a_seed_and_seed_dependent():
    runs = []
    for seed in (5, 5, 6):
        es = OnePlusOneES(seed=seed, judge="hop")  # a search that accepts: its path depends on the seed
        _drive(es, 1500)
        runs.append(es.state())
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_es_frozen_serves_fixed_weights_and_measures():
    es = OnePlusOneES(frozen={"w_rtt": 0.276, "w_queue": 0.5}, seed=1)
    _drive(es, 1000)
    assert es.weights == {"w_rtt": 0.276, "w_queue": 0.5}
    assert es.proposed == 0 and es.state()["window_p95_s"] > 0 and es.state()["frozen"] == 1.0


@pytest.mark.parametrize(("build", "match"), [
    (lambda: WeightRange(0.1, 0.0, 0.5), "lo"),  # log space: lower bounds must be positive
    (lambda: WeightRange(0.6, 0.1, 0.5), "start"),  # start outside its range
    (lambda: OnePlusOneES(window=16, hop=32), "hop"),  # a hop longer than the window
    (lambda: OnePlusOneES(judge="median"), "judge"),
])
def test_bad_settings_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_plugin_feeds_a_requests_ttft_when_it_completes():
    """GORGO's proxy records a sample (TTFT and total time) at the end of the response: the window
    holds completed requests, in completion order; a failed request adds nothing."""
    es = OnePlusOneES(window=8, hop=1, seed=1)
    plugin = TunerPlugin(es)
    plugin.on_first_token("a", "r0", 0.3)
    plugin.on_first_token("b", "r1", 0.9)
    assert es.samples == 0  # past the first token, not complete
    plugin.on_finished("b", "r1", 2.0, 10)
    assert es.samples == 1 and list(es.window) == [0.9]
    plugin.on_failed("a", "r0")
    plugin.on_finished("a", "r0", 2.0, 10)  # already dropped: no sample
    assert es.samples == 1
