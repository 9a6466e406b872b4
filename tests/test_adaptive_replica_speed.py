"""Replica speed learned online (policy/adaptive/replica_speed): factors from measured TTFTs and
TPOTs, the spread below which they are noise, the score, the trust region hearing the events, and
``auto`` on the bundled mixed-hardware scenario."""

from __future__ import annotations

import random

import pytest

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.replica_speed import SpeedFit, SpeedLMetric
from kvroute.policy.builtin.filters import NearBest
from kvroute.policy.plugins import DecisionState


def _feed(fit: SpeedFit, laws: dict[str, tuple[float, float, float]], n: int, seed: int = 0) -> None:
    """``n`` requests per replica; law = (intercept s, s per prefill token of work, s per output token)."""
    rng = random.Random(seed)
    for i in range(n):
        for ep, (a, b, d) in laws.items():
            work, out, rtt = rng.randrange(200, 8000), rng.randrange(2, 400), 0.02
            rid = f"{ep}-{i}"
            fit.dispatched(rid, ep, work, rtt)
            ttft = rtt + a + b * work
            fit.first_token(rid, ttft)
            fit.finished(rid, ep, ttft + d * (out - 1), out)


# replica laws → expected (prefill factor, decode factor) per replica; {} = all 1 (noise or one kind)
CASES = [
    pytest.param({"a": (0.02, 1e-4, 0.03), "b": (0.02, 1e-4, 0.03)}, {}, {}, id="one-kind"),
    pytest.param({"a": (0.02, 1.2e-4, 0.033), "b": (0.02, 1e-4, 0.03), "c": (0.02, 0.9e-4, 0.03)}, {}, {},
                 id="within-spread-is-noise"),
    pytest.param({"fast": (0.01, 1e-4, 0.02), "slow1": (0.03, 3e-4, 0.06), "slow2": (0.03, 3e-4, 0.06)},
                 {"fast": 1 / 3, "slow1": 1.0, "slow2": 1.0}, {"fast": 1 / 3, "slow1": 1.0, "slow2": 1.0},
                 id="a100-beside-l4s"),
    # hardware apart differs in both; one measure apart alone is read as noise (load, cache luck)
    pytest.param({"a": (0.02, 1e-4, 0.03), "b": (0.02, 1e-4, 0.03), "c": (0.02, 1e-4, 0.09)}, {}, {},
                 id="decode-only-differs"),
    pytest.param({"a": (0.02, 1e-4, 0.03), "b": (0.02, 1e-4, 0.03), "c": (0.02, 3e-4, 0.03)}, {}, {},
                 id="prefill-only-differs"),
    pytest.param({"fast": (0.01, 1e-4, 0.03), "slow": (0.03, 3e-4, 0.05), "slow2": (0.03, 3e-4, 0.05)},
                 {"fast": 1 / 3, "slow": 1.0, "slow2": 1.0}, {"fast": 0.6, "slow": 1.0, "slow2": 1.0},
                 id="apart-in-both"),
]


@pytest.mark.parametrize(("laws", "prefill", "decode"), CASES)
def test_factors_follow_the_measured_speeds(laws, prefill, decode):
    fit = SpeedFit(min_samples=16, spread=1.5)
    _feed(fit, laws, 200)
    pf, df = fit.factors()
    assert pf.keys() == prefill.keys() and df.keys() == decode.keys()
    for ep, f in prefill.items():
        assert pf[ep] == pytest.approx(f, rel=0.02)
    for ep, f in decode.items():
        assert df[ep] == pytest.approx(f, rel=0.02)
    state = fit.state()
    assert state["mixed"] == (1.0 if prefill or decode else 0.0)
    assert state[f"{next(iter(laws))}.samples"] == 200.0


# observations per replica, min_samples → is the replica's own time used?
THRESHOLDS = [(15, 16, False), (16, 16, True), (3, 2, True)]


@pytest.mark.parametrize(("observed", "min_samples", "used"), THRESHOLDS)
def test_a_replica_counts_as_the_median_until_min_samples(observed, min_samples, used):
    fit = SpeedFit(min_samples=min_samples)
    _feed(fit, {"fast": (0.0, 1e-4, 0.02), "slow": (0.0, 3e-4, 0.06)}, observed)
    assert ("fast" in fit.factors()[0]) == used


def test_failed_and_single_token_requests_leave_no_decode_observation():
    fit = SpeedFit(min_samples=1)
    fit.dispatched("x", "a", 1000, 0.0)
    fit.first_token("x", 0.5)
    fit.finished("x", "a", 0.9, 1)  # one output token: no time per token
    fit.dispatched("y", "a", 1000, 0.0)
    fit.forget("y")
    fit.first_token("y", 0.5)  # forgotten: no observation
    assert fit.state()["a.samples"] == 1.0 and fit.decode_s() == {}


def test_a_fleet_judged_mixed_stays_mixed_when_load_closes_the_decode_gap():
    """The A100s' TPOTs grow with the load sent to them; the hardware did not change, so the judgment
    holds and the factors follow the measured times (a fresh fit on the same later data is not mixed)."""
    fit = SpeedFit(min_samples=16)
    a100_l4 = {"fast": (0.01, 1e-4, 0.02), "slow1": (0.03, 3e-4, 0.06), "slow2": (0.03, 3e-4, 0.06)}
    _feed(fit, a100_l4, 100)
    assert fit.factors()[1]["fast"] == pytest.approx(1 / 3, rel=0.02)
    loaded = {"fast": (0.01, 1e-4, 0.055), "slow1": (0.03, 3e-4, 0.06), "slow2": (0.03, 3e-4, 0.06)}
    _feed(fit, loaded, 2000, seed=1)
    pf, df = fit.factors()
    assert fit.state()["mixed"] == 1.0 and pf["fast"] == pytest.approx(1 / 3, rel=0.02)
    assert df["fast"] == pytest.approx(0.055 / 0.06, rel=0.05)
    fresh = SpeedFit(min_samples=16)
    _feed(fresh, loaded, 200, seed=1)
    assert fresh.factors() == ({}, {})


def test_the_most_certain_pair_decides_not_the_noisiest_replica():
    """A replica with few, scattered observations has the highest point estimate and the widest error;
    the spread stands on the two replicas measured precisely (the old test took the extremes and lost it)."""
    fit = SpeedFit(min_samples=4)
    _feed(fit, {"fast": (0.01, 1e-4, 0.02), "slow": (0.03, 3e-4, 0.06)}, 100)
    rng = random.Random(3)
    for i in range(4):  # "noisy": 4 requests whose times scatter over 10x
        rid, work, out = f"noisy-{i}", 1000 + 500 * i, 100
        fit.dispatched(rid, "noisy", work, 0.0)
        ttft = rng.choice((0.1, 1.0, 3.0, 6.0))
        fit.first_token(rid, ttft)
        fit.finished(rid, "noisy", ttft + rng.choice((0.5, 5.0, 20.0)), out)
    assert fit.prefill_s()["noisy"] > fit.prefill_s()["slow"]  # the extreme point estimate
    assert fit.factors()[0]["fast"] < 0.5


def test_the_predicted_ttft_is_each_replicas_line_and_the_median_for_an_unmeasured_one():
    fit = SpeedFit(min_samples=8)
    _feed(fit, {"a": (0.1, 1e-4, 0.02), "b": (0.2, 3e-4, 0.06), "c": (0.2, 3e-4, 0.06)}, 50)
    a, b, c, new = fit.predict_ttft([("a", 4000.0), ("b", 1000.0), ("c", 0.0), ("new", 1000.0)])
    assert a == pytest.approx(0.5, rel=1e-6) and b == pytest.approx(0.5, rel=1e-6) and c == pytest.approx(0.2)
    assert new == pytest.approx(0.5, rel=1e-6)  # the median of the three predictions


def test_ttft_pick_chooses_the_first_answer_among_the_replicas_the_score_ranks_near_its_best():
    """On a fleet judged mixed: the least predicted TTFT among the replicas the speed-scaled score ranks
    within ``near`` x its best; a replica outside that set ranks after all inside it; one kind: LMetric."""
    laws = {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)}
    one_kind = SpeedLMetric(min_samples=8, ttft_pick=True)
    _learn(one_kind, {"fast": (1e-4, 0.02), "slow": (1e-4, 0.02)})
    eps = [Endpoint("fast", queued_prefill_tokens=9000, running=5), Endpoint("slow", queued_prefill_tokens=0)]
    assert one_kind.values(_St(), eps) == [(9000 + 1000) * 6, 1000]
    picker = SpeedLMetric(min_samples=8, ttft_pick=True, near=2.0)
    _learn(picker, laws)
    # scaled score: fast 10000·6/36 ≈ 1667, slow 1000 — both near; predicted TTFT 1.0 s vs 0.6 s
    fast, slow = picker.values(_St(), eps)
    assert slow == pytest.approx(0.6, rel=0.02) and fast == pytest.approx(1.0, rel=0.02)
    narrow = SpeedLMetric(min_samples=8, ttft_pick=True, near=1.5)
    _learn(narrow, laws)
    eps[1].queued_prefill_tokens, eps[0].queued_prefill_tokens = 2000, 0  # now the fast one is best
    fast, slow = narrow.values(_St(), eps)
    assert fast == pytest.approx(0.1, rel=0.02) and slow > 1e6  # slow: 3000 > 1.5 x 1000/6
    with pytest.raises(ValueError):
        SpeedLMetric(near=0.5)


@pytest.mark.parametrize(("dof", "t"), [(1, 13.97), (2, 4.53), (3, 3.31), (10, 2.28), (30, 2.09), (10_000, 2.0)])
def test_the_bound_is_students_t_at_the_confidence_of_z(dof, t):
    from kvroute.policy.adaptive.replica_speed.fit import t_quantile

    assert t_quantile(2.0, dof) == pytest.approx(t, abs=0.01)
    assert t_quantile(1.96, 10) == pytest.approx(2.228, abs=0.002)  # the textbook 95 % value


def test_few_observations_judge_a_clear_spread_but_not_a_scattered_one():
    """With Student's t the floor is what a standard error needs (3 first tokens, 2 completions):
    exact A100-vs-L4 laws are judged at once; three scattered observations are not, though 2 normal
    standard errors of them would pass (the z bound alone: factors 0.53 / 1.47)."""
    fit = SpeedFit(min_samples=1)
    _feed(fit, {"fast": (0.01, 1e-4, 0.02), "slow": (0.03, 3e-4, 0.06), "slow2": (0.03, 3e-4, 0.06)}, 3)
    assert fit.factors()[0]["fast"] < 0.5
    noisy = SpeedFit(min_samples=1)
    for i, (slow_ttft, slow_tpot) in enumerate([(1.0, 0.08), (1.3, 0.10), (1.1, 0.09)]):
        for ep, ttft, tpot in (("a", 0.4 + 0.01 * i, 0.03), ("b", slow_ttft, slow_tpot)):
            rid = f"{ep}-{i}"
            noisy.dispatched(rid, ep, 1000 + 100 * i, 0.0)
            noisy.first_token(rid, ttft)
            noisy.finished(rid, ep, ttft + tpot * 100, 101)
    assert noisy.factors() == ({}, {})


@pytest.mark.parametrize("bad", [{"min_samples": 0}, {"halflife": 0}, {"spread": 0.9}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SpeedFit(**bad)


class _St:
    _lmetric_of = None
    lmetric = DecisionState.lmetric  # the scorer reads LMetric's score from the decision's state

    def new_prefill(self, eps):
        return [1000 for _ in eps]


def _learn(plugin, laws: dict[str, tuple[float, float]], n: int = 40) -> None:
    """Lifecycle events as the Router delivers them; law = (s per work token, s per output token)."""
    for i in range(n):
        for ep, (b, d) in laws.items():
            req = Request(id=f"{ep}-{i}", prompt_tokens=1000)
            work = 500 + 100 * (i % 20)
            plugin.on_dispatched(req, Endpoint(ep, queued_prefill_tokens=work, rtt_s=0.0), new_prefill_tokens=1000)
            plugin.on_first_token(req.id, ep, b * work)
            plugin.on_finished(req.id, ep, b * work + d * 100, 101)


def test_the_score_is_lmetric_until_the_fleet_is_mixed_then_scaled_by_speed():
    scorer = SpeedLMetric(min_samples=8)
    eps = [Endpoint("fast", queued_prefill_tokens=3000, running=5), Endpoint("slow", queued_prefill_tokens=0)]
    lmetric = [(3000 + 1000) * 6, (0 + 1000) * 1]
    assert scorer.values(_St(), eps) == lmetric
    _learn(scorer, {"fast": (1e-4, 0.02), "slow": (1e-4, 0.02)})
    assert scorer.values(_St(), eps) == lmetric  # one kind: unchanged
    scorer = SpeedLMetric(min_samples=8)
    _learn(scorer, {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)})
    fast, slow = scorer.values(_St(), eps)
    assert fast == pytest.approx(lmetric[0] / 36, rel=0.02) and slow == pytest.approx(lmetric[1], rel=0.02)
    assert fast < slow  # 6x faster at both: the loaded fast replica is preferred over the idle slow one


def test_the_trust_region_hears_the_events_of_a_learning_scorer():
    region = NearBest(scorer="lmetric_speed", factor=2.0)
    _learn(region, {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)})
    assert region.scorer.fit.state()["mixed"] == 1.0
    assert region.state() == {}  # exported by the rule's own copy, not twice


def test_auto_learns_the_mixed_fleet_and_loads_the_fast_replicas_more():
    """The bundled mixed-hardware scenario (2 A100 + 6 L4): auto's learned factors find the A100s
    about 3x faster at prefill, and they carry more of the load than with ``speed: false``, and more
    again with ``speed_ttft`` (the default) than without it."""
    from kvroute.sim.scenario import load_scenario, parse_scenario
    from kvroute.sim.simulation import Simulation

    data = load_scenario("mixed-hardware").model_dump(exclude_none=True)
    data["limits"]["max_requests"] = 400
    sc = parse_scenario(data, "mixed-hardware")
    share = {}
    for speed in (True, False, "no-ttft-pick"):
        params = {"speed_ttft": False} if speed == "no-ttft-pick" else {"speed": speed}
        sim = Simulation(sc.setup(None), "auto", params, sc.make_workload())
        result = sim.run()
        rec = sim.recorder
        a100 = sum(1 for i in rec.replica if rec.replica_ids[i] in ("us-0", "us-1"))
        share[speed] = a100 / len(rec.replica)
        if speed is True:
            state = result["policy_state"]
            assert state["lmetric_speed.mixed"] == 1.0
            assert 2.0 < state["lmetric_speed.us-2.prefill_factor"] / state["lmetric_speed.us-0.prefill_factor"] < 4.5
    assert share[True] > share[False] + 0.05
    # picking the least predicted TTFT among the near-best sends more of the long prompts to the A100s
    assert share[True] > share["no-ttft-pick"] + 0.02


def _trust_regions(policy) -> list[NearBest]:
    """The near_best filters of a compiled pipeline's rules."""
    return [f for rule in policy.rules for f in rule.among if type(f) is NearBest]  # uniform_fleet: its own test


@pytest.mark.parametrize(("params", "learns", "spread"), [({}, True, 1.5), ({"speed_spread": 3.0}, True, 3.0),
                                                          ({"speed": False}, False, 1.5)])
def test_auto_trust_region_follows_speed_and_speed_spread(params, learns, spread):
    """The challenger's trust region judges with the incumbent's settings: ``speed: false`` leaves it
    LMetric's score as is (it learns nothing, even from a clearly mixed fleet), ``speed_spread`` is its
    spread too (the bug: it kept learning at the default 1.5 whatever auto was given)."""
    from kvroute.policy import build_policy

    regions = _trust_regions(build_policy("auto", params))
    assert len(regions) == 2  # the additive and the RTT-aware rule
    eps = [Endpoint("fast", queued_prefill_tokens=3000, running=5), Endpoint("slow", queued_prefill_tokens=0)]
    for region in regions:
        assert region.scorer.fit.spread == spread
        _learn(region, {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)})
        assert (region.scorer.fit.state().get("mixed") == 1.0) is learns
        kept = [e.id for e in region.filter(_St(), eps)]
        assert kept == (["fast", "slow"] if learns else ["slow"])  # lmetric: 24000 vs 1000, beyond 2x


def test_near_best_takes_scorer_arguments_and_names_bad_ones():
    assert NearBest(scorer={"lmetric_speed": {"spread": 2.5}}).scorer.fit.spread == 2.5
    with pytest.raises(ValueError, match="valid scorers"):
        NearBest(scorer="no_such_scorer")
    with pytest.raises(ValueError, match="arguments: min_samples"):
        NearBest(scorer={"lmetric_speed": {"bogus": 1}})


def _feed_noisy(fit: SpeedFit, laws: dict[str, tuple[float, float]], n: int, noise: float, seed: int) -> bool:
    """``n`` requests per replica with multiplicative noise (± ``noise``) on TTFT and decode time;
    law = (s per prefill token of work, s per output token). True if the fit judged the fleet mixed at any point."""
    rng = random.Random(seed)
    seen = False
    for i in range(n):
        for ep, (b, d) in laws.items():
            work, out = rng.randrange(500, 5000), rng.randrange(20, 400)
            rid = f"{ep}-{i}"
            fit.dispatched(rid, ep, work, 0.0)
            ttft = b * work * (1 + noise * (2 * rng.random() - 1))
            fit.first_token(rid, ttft)
            fit.finished(rid, ep, ttft + d * (out - 1) * (1 + noise * (2 * rng.random() - 1)), out)
            seen = seen or bool(fit.factors()[0])
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_few_noisy_samples_of_one_kind_do_not_make_a_mixed_fleet(seed):
    """One hardware kind, ±60 % noise (cache luck, batch interference), judged from 4 samples on: the
    spread must stand ``z`` standard errors apart, which noise on a handful of samples rarely fakes —
    without the test (z = 0) the same samples flip the fleet to mixed."""
    laws = {f"r{i}": (2.5e-4, 0.03) for i in range(8)}
    assert not _feed_noisy(SpeedFit(min_samples=4, z=2.0), laws, 40, 0.6, seed)
    if seed == 0:
        assert _feed_noisy(SpeedFit(min_samples=4, z=0.0), laws, 40, 0.6, seed)


def test_hardware_three_times_apart_is_found_within_a_few_samples():
    fit = SpeedFit(min_samples=4, z=2.0)
    laws = {"a100-0": (1e-4, 0.015), "a100-1": (1e-4, 0.015), **{f"l4-{i}": (3e-4, 0.04) for i in range(6)}}
    assert _feed_noisy(fit, laws, 6, 0.3, 1)
    pf, df = fit.factors()
    assert pf["a100-0"] < 0.5 and df["a100-0"] < 0.6 and pf["l4-0"] == pytest.approx(1.0, rel=0.35)


def test_live_batch_counts_at_least_the_requests_in_flight():
    """A probe read an SGLang gauge written before 6 requests arrived (running 1, nothing since the probe),
    but this LB has 7 in flight there: with ``live_batch`` the batch term is 7, not 1."""
    stale = Endpoint("stale", queued_prefill_tokens=0, running=1, inflight=7)
    fresh = Endpoint("fresh", queued_prefill_tokens=0, running=3, waiting=1, inflight=2)
    plain, live = SpeedLMetric(), SpeedLMetric(live_batch=True)
    assert plain.values(_St(), [stale, fresh]) == [1000 * 2, 1000 * 5]  # LMetric: the stale one looks idle
    assert live.values(_St(), [stale, fresh]) == [1000 * 8, 1000 * 5]  # max(probe, in flight) + 1
    # the state says how often the floor was above the probe at dispatch (counts include the request)
    live.on_dispatched(Request(id="a", prompt_tokens=10), stale, 10)
    live.on_dispatched(Request(id="b", prompt_tokens=10), fresh, 10)
    assert live.state()["batch_floor_share"] == 0.5
    assert "batch_floor_share" not in plain.state()


def test_auto_uses_the_live_batch_in_its_incumbent_and_trust_region():
    from kvroute.policy import build_policy

    for params, want in (({}, True), ({"live_batch": False}, False)):
        policy = build_policy("auto", params)
        incumbent = [s for rule in policy.rules for s, _ in rule.scorers if isinstance(s, SpeedLMetric)]
        assert [s.live_batch for s in incumbent] == [want]
        assert [r.scorer.live_batch for r in _trust_regions(policy)] == [want, want]


class _Both:
    """Delivers every lifecycle event to each of ``copies`` in turn, as the Router does to its listeners."""

    def __init__(self, *copies):
        self.copies = copies

    def __getattr__(self, name):
        return lambda *args, **kw: [getattr(c, name)(*args, **kw) for c in self.copies]


def test_copies_sharing_a_fit_learn_each_event_once():
    """Copies built in one scope with one ``shared_fit`` name and equal settings hold one fit; told every
    event by each copy, it learns what a lone copy told once learns (the fit consumes a request's record
    at its first hearing). Other settings, no name, or no scope: a fit of its own."""
    from kvroute.policy.shared import sharing

    laws = {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)}
    with sharing():
        a, b = SpeedLMetric(min_samples=8, shared_fit="x"), SpeedLMetric(min_samples=8, shared_fit="x")
        other = SpeedLMetric(min_samples=8, spread=3.0, shared_fit="x")
        unnamed = SpeedLMetric(min_samples=8)
    assert a.fit is b.fit and other.fit is not a.fit and unnamed.fit is not a.fit
    assert SpeedLMetric(shared_fit="x").fit is not SpeedLMetric(shared_fit="x").fit  # outside a scope
    lone = SpeedLMetric(min_samples=8)
    _learn(_Both(a, b), laws)
    _learn(lone, laws)
    assert a.fit.state() == lone.fit.state() and a.fit.state()["mixed"] == 1.0
    assert a.fit.version == lone.fit.version  # one refresh per event, not one per copy


def test_auto_keeps_one_replica_speed_fit_per_policy():
    """``auto``'s incumbent, its trust regions and the least-work rule's trust region learn into one fit
    (one refresh per event); a second policy built from the same preset has its own."""
    from kvroute.policy import build_policy

    def fits(policy):
        scorers = [s for rule in policy.rules for s, _ in rule.scorers if isinstance(s, SpeedLMetric)]
        scorers += [getattr(f, "scorer", None) for rule in policy.rules for f in rule.among]
        scorers = [s for s in scorers if isinstance(s, SpeedLMetric)]  # other filters (kv_room) hold none
        return {id(s.fit) for s in scorers}, len(scorers)

    one, other = build_policy("auto"), build_policy("auto")
    (fit_one, copies), (fit_other, _) = fits(one), fits(other)
    assert copies == 4 and len(fit_one) == 1 and len(fit_other) == 1 and fit_one != fit_other
