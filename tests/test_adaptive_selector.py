"""auto's online selector (policy/adaptive/selector): interleaved trials, switching on evidence, the guard,
the doubling exploit stretch; and the trust region (near_best) that keeps trials safe."""

from __future__ import annotations

import pytest

from kvroute.model import Endpoint
from kvroute.policy import Router, build_policy
from kvroute.policy.adaptive.selector import A, B, TTFTSelector
from kvroute.policy.adaptive.selector.plugin import welch
from kvroute.policy.builtin.filters import NearBest
from kvroute.policy.plugins import DecisionState
from tests.conftest import make_request
from tests.test_adaptive_replica_speed import _learn  # lifecycle events as the Router delivers them


class _Req:
    def __init__(self, rid):
        self.id = rid


class _St:
    """The part of a DecisionState the selector reads, with Router.route's commit of its deferred
    state changes."""

    def __init__(self, rid):
        self.req = _Req(rid)
        self.effects = []

    def defer(self, effect):
        self.effects.append(effect)


def drive(sel: TTFTSelector, ttft, e2e, n: int, start: int = 0) -> list[int]:
    """n requests: ask, dispatch, answer at once with the arm's TTFT and E2E (a callable of the request
    number, or a constant); returns the arms that served."""
    arms = []
    for i in range(start, start + n):
        rid = f"r{i}"
        st = _St(rid)
        arm = A if sel.holds(st, []) else B
        arms.append(arm)
        for effect in st.effects:  # the dispatch is committed
            effect()
        sel.on_dispatched(_Req(rid), None, 0)
        t, e = ttft[arm], e2e[arm]
        sel.on_first_token(rid, "e", t(i) if callable(t) else t)
        sel.on_finished(rid, "e", e(i) if callable(e) else e, 10)
    return arms


def noisy(mean: float, spread: float = 0.1):
    """A deterministic TTFT series around ``mean`` (a sawtooth of ± ``spread``)."""
    return lambda i: mean + spread * ((i * 7919) % 11 - 5) / 5


def test_a_trial_interleaves_the_rules_then_the_incumbent_serves():
    sel = TTFTSelector(window=8, exploit=2)
    assert drive(sel, {A: noisy(0.5), B: noisy(0.5)}, {A: 5.0, B: 5.0}, 16) == [A, B] * 8
    assert sel.state()["rounds"] == 1 and sel.state()["wins_other"] == 1  # a tie keeps LMetric (B)
    # kept once: the stretch doubles (2 windows × 8 × 2 = 32 dispatches), then the next trial
    assert drive(sel, {A: noisy(0.5), B: noisy(0.5)}, {A: 5.0, B: 5.0}, 32, 16) == [B] * 32
    assert drive(sel, {A: noisy(0.5), B: noisy(0.5)}, {A: 5.0, B: 5.0}, 4, 48) == [A, B, A, B]


# TTFT and E2E each rule's requests measure → the rule serving after one trial
ROUNDS = [
    pytest.param({A: noisy(0.2), B: noisy(0.5)}, {A: 5.0, B: 5.0}, 0.1, 2.0, A, id="challenger-clearly-faster"),
    pytest.param({A: noisy(0.5), B: noisy(0.2)}, {A: 5.0, B: 5.0}, 0.1, 2.0, B, id="incumbent-faster"),
    pytest.param({A: noisy(0.45, 0.3), B: noisy(0.5, 0.3)}, {A: 5.0, B: 5.0}, 0.1, 2.0, B,
                 id="a-lead-within-the-noise-keeps-the-incumbent"),
    pytest.param({A: noisy(0.45, 0.3), B: noisy(0.5, 0.3)}, {A: 5.0, B: 5.0}, 0.1, 0.0, A,
                 id="z-0-follows-any-lead"),
    pytest.param({A: noisy(0.1), B: noisy(0.3)}, {A: 20.0, B: 5.0}, 0.1, 2.0, B,
                 id="guard-refuses-fast-first-tokens-slow-answers"),
    pytest.param({A: noisy(0.1), B: noisy(0.3)}, {A: 5.4, B: 5.0}, 0.1, 2.0, A, id="within-the-e2e-slack"),
    pytest.param({A: noisy(0.1), B: noisy(0.3)}, {A: 5.4, B: 5.0}, 0.05, 2.0, B, id="beyond-a-tighter-slack"),
]


@pytest.mark.parametrize(("ttft", "e2e", "slack", "z", "kept"), ROUNDS)
def test_the_rule_serving_after_one_trial(ttft, e2e, slack, z, kept):
    sel = TTFTSelector(window=8, exploit=2, e2e_slack=slack, z=z)
    assert drive(sel, ttft, e2e, 16) == [A, B] * 8
    assert drive(sel, ttft, e2e, 16, 16) == [kept] * 16
    assert sel.state()["rounds"] == 1
    assert sel.state()["wins_guarded" if kept == A else "wins_other"] == 1


def test_a_switch_is_followed_back_when_the_traffic_changes():
    sel = TTFTSelector(window=8, exploit=1)
    drive(sel, {A: noisy(0.1), B: noisy(0.5)}, {A: 5.0, B: 5.0}, 16)
    assert drive(sel, {A: noisy(0.1), B: noisy(0.5)}, {A: 5.0, B: 5.0}, 8, 16) == [A] * 8  # switched: 1 window
    later = drive(sel, {A: noisy(0.9), B: noisy(0.2)}, {A: 5.0, B: 5.0}, 24, 24)
    assert later[:16] == [A, B] * 8 and later[16:] == [B] * 8  # the next trial switched back: 1 window
    assert sel.state()["wins_guarded"] == 1 and sel.state()["wins_other"] == 1


def test_answers_of_an_earlier_trial_do_not_count_in_the_next():
    sel = TTFTSelector(window=8, exploit=1)
    for i in range(16):  # a trial whose answers never come ...
        st = _St(f"old{i}")
        sel.holds(st, [])
        for effect in st.effects:
            effect()
        sel.on_dispatched(_Req(f"old{i}"), None, 0)
    assert sel.state()["rounds"] == 0  # ... is still awaited: the incumbent serves meanwhile
    assert drive(sel, {A: 0.1, B: 0.1}, {A: 1.0, B: 1.0}, 4) == [B] * 4


@pytest.mark.parametrize(("better", "worse", "want"), [
    ([1.0, 1.0], [2.0, 2.0], float("inf")), ([2.0, 2.0], [1.0, 1.0], 0.0),
    ([1.0, 2.0, 3.0], [2.0, 3.0, 4.0], pytest.approx(1.2247, abs=1e-3))])
def test_welch_counts_standard_errors_of_the_lead(better, worse, want):
    assert welch(better, worse) == want


@pytest.mark.parametrize(("window", "exploit", "z"), [(7, 8, 2.0), (64, 0, 2.0), (64, 8, -1.0)])
def test_bad_settings_are_refused(window, exploit, z):
    with pytest.raises(ValueError, match="window must be|z must be"):
        TTFTSelector(window=window, exploit=exploit, z=z)


def _lm_state(eps, prompt_tokens):
    """A real DecisionState (the class the compiled build compiles, so the test runs against either
    build) for a request of ``prompt_tokens`` that no endpoint has cached: each new prefill is the
    whole prompt."""
    router = Router(build_policy("round_robin"), eps)
    return DecisionState(make_request("r", tokens=prompt_tokens), router.view, router.policy.rng)


def _ep(eid, queued, batch):
    e = Endpoint(id=eid)
    e.queued_prefill_tokens, e.running = queued, batch
    return e


@pytest.mark.parametrize(("factor", "kept"), [(1.0, ["a"]), (2.0, ["a", "b"]), (10.0, ["a", "b", "c"])])
def test_near_best_keeps_the_endpoints_lmetric_ranks_within_the_factor(factor, kept):
    eps = [_ep("a", 0, 0), _ep("b", 500, 0), _ep("c", 100, 5)]  # lmetric: 1000, 1500, (100+1000)×6
    st = _lm_state(eps, 1000)
    assert st.new_prefill(eps) == [1000, 1000, 1000]
    assert [e.id for e in NearBest("lmetric", factor).filter(st, eps)] == kept


def test_near_best_refuses_a_factor_below_one():
    with pytest.raises(ValueError, match="factor must be >= 1"):
        NearBest("lmetric", 0.5)


def test_a_trial_the_challenger_is_clearly_losing_stops_early():
    """Futility stopping: with window 32, once each rule has 8 TTFTs and the challenger is behind by more
    than z standard errors, the incumbent serves the rest of the trial; a winning challenger is trialled
    in full."""
    sel = TTFTSelector(window=32, exploit=1)
    arms = drive(sel, {A: noisy(0.6), B: noisy(0.2)}, {A: 5.0, B: 5.0}, 64)
    assert arms[:16] == [A, B] * 8 and arms[16:] == [B] * 48
    state = sel.state()
    assert state["stopped_early"] == 1 and state["wins_other"] == 1 and state["evidence"] < -2
    sel = TTFTSelector(window=32, exploit=1)
    assert drive(sel, {A: noisy(0.2), B: noisy(0.6)}, {A: 5.0, B: 5.0}, 64) == [A, B] * 32
    assert sel.state()["stopped_early"] == 0 and sel.state()["wins_guarded"] == 1


def test_uniform_fleet_is_the_trust_region_until_the_fleet_is_mixed_or_regions_apart():
    from kvroute.policy.adaptive.selector import UniformFleet

    class _View:
        def __init__(self, *rtts_ms):
            self.endpoints = [Endpoint(f"e{i}", rtt_s=ms / 1000) for i, ms in enumerate(rtts_ms)]

    def st(*rtts_ms):
        state = _St("x")
        state.view = _View(*rtts_ms)
        state.new_prefill = lambda eps: [100] * len(eps)  # nothing cached, nothing queued: all near-best
        return state

    def kept(cond, state):
        got = [e.id for e in cond.filter(state, state.view.endpoints)]
        for effect in state.effects:  # Router.route commits the deferred state
            effect()
        return got

    def fresh():
        return UniformFleet(scorer={"lmetric_speed": {"min_samples": 2, "live_batch": True}})

    one_kind, mixed = fresh(), fresh()
    blind = UniformFleet(scorer={"lmetric_speed": {"learn": False, "live_batch": True}})
    _learn(one_kind, {"a": (1e-4, 0.02), "b": (1.1e-4, 0.021), "c": (1e-4, 0.02)})
    assert kept(one_kind, st(1, 2, 9)) == ["e0", "e1", "e2"] and one_kind.state() == {"mixed": 0.0}
    assert kept(one_kind, st(1, 2, 90)) == []  # a replica regions away: the LB's fleet is not one region
    for cond in (mixed, blind):
        _learn(cond, {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)})
    assert kept(mixed, st(1, 2)) == [] and mixed.state() == {"mixed": 1.0}  # 6x apart at both: mixed, for good
    assert kept(blind, st(1, 2)) == ["e0", "e1"]  # learn: false (auto's speed: false) learns nothing
    declared = st(1, 2)
    declared.view.endpoints[0].accelerator, declared.view.endpoints[1].accelerator = "a100-80gb", "l4"
    apart = fresh()
    assert kept(apart, declared) == [] and apart.state() == {"mixed": 1.0}  # the datasheet prior decides at once
    declared.view.endpoints[0].accelerator = "l4"
    assert kept(fresh(), declared) == ["e0", "e1"]  # declared alike


def test_auto_routes_by_least_work_on_one_kind_and_stands_aside_on_a_mixed_fleet(router_for):
    """auto's least-work rule: among the near-best, the least queued + uncached tokens; its condition
    judges with the incumbent's settings, and a mixed fleet goes to the learned speeds instead."""
    from kvroute.policy.adaptive.selector import UniformFleet
    from kvroute.policy.presets.auto import ADDITIVE, LEAST_WORK
    from tests.conftest import make_request

    r = router_for("auto", 3, params={"speed_spread": 2.5, "speed_samples": 3})
    lmetric = router_for("auto", 3, params={"least_work": False, "select": False})
    (cond,) = [f for rule in r.policy.rules for f in rule.among if isinstance(f, UniformFleet)]
    assert (cond.scorer.fit.spread, cond.scorer.fit.min_samples, cond.scorer.learn, cond.factor) == (2.5, 3, True, 2.0)
    for router in (r, lmetric):
        a, b, c = router.view.endpoints
        a.queued_prefill_tokens, a.inflight, a.running = 300, 3, 3
        b.queued_prefill_tokens, b.inflight, b.running = 800, 0, 0
        c.queued_prefill_tokens, c.inflight, c.running = 300, 2, 2
    req = make_request("q", "hello " * 50)
    assert lmetric.decide(req).target == b.id  # LMetric's score alone: (800 + n) × 1 is its least
    d = r.route(req)
    # LMetric's score (work × (batch + 1)) ranks all three within 2x of b's; the least work (a, c), then the
    # fewest requests in flight (c) wins
    assert d.branch == LEAST_WORK and d.target == c.id
    _learn(cond, {"fast": (1e-4, 0.01), "slow": (6e-4, 0.06), "slow2": (6e-4, 0.06)})
    assert r.route(make_request("q2", "hello " * 50)).branch == ADDITIVE  # mixed: the trials and learned speeds


def test_auto_least_work_counts_an_uncached_prefill_again_while_the_candidates_are_busy(router_for):
    """busy_uncached: while every candidate has prefill queued, a prefill the cache would have saved is work a
    queue waits for, so auto's least work counts the uncached tokens once more; with an idle one, in proportion."""
    from kvroute.policy.presets.auto import LEAST_WORK
    from tests.conftest import make_request

    req = make_request("turn2", "hello " * 800)  # 18 blocks, 1,204 tokens
    old = router_for("auto", 3, params={"busy_prefill": 0.0})
    new = router_for("auto", 3)
    for router in (old, new):
        a, b, c = router.view.endpoints
        router.prefix.insert(a.id, req.block_hashes[:-2])  # a caches 16 blocks: 180 tokens uncached there
        a.queued_prefill_tokens, b.queued_prefill_tokens, c.queued_prefill_tokens = 1600, 50, 2000
        for e in (a, b, c):
            e.inflight = e.running = 2
    # the trust region is a and b (LMetric's (2,000 + 1,204) x 3 for c is more than twice b's 1,254 x 3).
    # Least work alone: b (50 + 1,204) before a (1,600 + 180); both busy, the uncached tokens count twice:
    # a (1,600 + 2 x 180) before b (50 + 2 x 1,204) — the request stays with its cache
    d_old, d_new = old.decide(req), new.decide(req)
    assert (d_old.branch, d_old.target, d_new.branch, d_new.target) == (LEAST_WORK, "e1", LEAST_WORK, "e0")
    for router in (old, new):  # b idle: half the candidates busy, b (1,204 x 1.5) before a (1,600 + 180 x 1.5)
        router.view.endpoints[1].queued_prefill_tokens = 0
    assert old.decide(req).target == new.decide(req).target == "e1"


def test_auto_least_work_counts_an_uncached_prefill_once_more_per_request_waiting_on_every_candidate(router_for):
    """waiting_uncached: first come, first served, about as many requests arrive behind a prefill as were waiting
    when it came, so while every candidate has requests of this LB waiting for a first token, auto's least work
    counts the uncached tokens once more per request waiting on the least-waited candidate — but that term moves
    the pick only to a replica that then queues no more prefill than the longest queue now; a first token ends
    the wait."""
    from kvroute.policy.presets.auto import LEAST_WORK
    from tests.conftest import make_request

    req = make_request("turn2", "hello " * 800)  # 18 blocks, 1,204 tokens
    old = router_for("auto", 3)  # behind_prefill 0 by default
    new = router_for("auto", 3, params={"behind_prefill": 1.0})
    for router in (old, new):
        for i, e in enumerate(router.view.endpoints):  # one request of this LB waiting on each
            router.commit(make_request(f"wait{i}", f"other {i} " * 40), e.id)
        a, b, c = router.view.endpoints
        for cached in (a, c):  # a and c cache 16 blocks: 180 tokens uncached there
            router.prefix.insert(cached.id, req.block_hashes[:-2])
        a.queued_prefill_tokens, b.queued_prefill_tokens, c.queued_prefill_tokens = 3100, 600, 3400
    # every candidate busy. The least work: b 600 + 2 x 1,204 = 3,008 before a 3,100 + 2 x 180 = 3,460 and c 3,760.
    # One request waiting everywhere: a 3,640 before c 3,940 and b 4,212 — and a would then queue 3,280 tokens, no
    # more than c's 3,400 now: the request stays with its cache
    d_old, d_new = old.decide(req), new.decide(req)
    assert (d_old.branch, d_old.target, d_new.branch, d_new.target) == (LEAST_WORK, "e1", LEAST_WORK, "e0")
    new.view.endpoints[2].queued_prefill_tokens = 3200  # a would now hold the longest queue: the least work decides
    assert new.decide(req).target == "e1"
    new.view.endpoints[2].queued_prefill_tokens = 3400
    new.on_first_token("wait1", 0.5)  # b's request got its first token: nothing waiting there, the term is 0
    assert new.decide(req).target == "e1"


def test_auto_least_work_counts_an_uncached_prefill_once_more_per_answer_decoding_where_it_would_run(router_for):
    """decoding_uncached: a prefill lengthens the steps of every answer decoding on its replica, so auto's least work
    counts the uncached tokens once more per request of this LB decoding there (first token seen, not finished), times
    the share of the candidates with no prefill queued — but the term moves the pick only to a replica with no prefill
    queued; a request still waiting for its first token does not count, and a finished one no longer does."""
    from kvroute.policy.presets.auto import LEAST_WORK
    from tests.conftest import make_request

    req = make_request("turn2", "hello " * 800)  # 18 blocks, 1,204 tokens
    old = router_for("auto", 3, params={"decode_prefill": 0.0})
    new = router_for("auto", 3, params={"decode_fanout": False})  # the term on any traffic (default: on fan-outs)
    for router in (old, new):
        a, b, c = router.view.endpoints
        router.prefix.insert(a.id, req.block_hashes[:-2])  # a caches 16 blocks: 180 tokens uncached there
        for i in range(12):  # twelve requests of this LB on a, one on c
            router.commit(make_request(f"a{i}", f"other {i} " * 40), a.id)
        router.commit(make_request("c0", "other c " * 40), c.id)
    # waiting for their first tokens they are queued prefill, not answers being decoded: the term is 0, the pick the
    # least work's (b, the one replica without a queue)
    assert old.decide(req).target == new.decide(req).target == "e1"
    for router in (old, new):
        for rid in [f"a{i}" for i in range(12)] + ["c0"]:
            router.on_first_token(rid, 0.4)
        assert all(e.queued_prefill_tokens == 0 for e in router.view.endpoints)
    # now they decode. Least work: a (180) before b and c (1,204). With the term (free share 1): a 180 + 12 x 180 =
    # 2,340, c 1,204 + 1 x 1,204 = 2,408, b 1,204: prefilling 180 tokens under twelve answers costs more than 1,204
    # under none (the trust region: LMetric's 180 x 13 for a is within twice b's 1,204 x 1)
    d_old, d_new = old.decide(req), new.decide(req)
    assert (d_old.branch, d_old.target, d_new.branch, d_new.target) == (LEAST_WORK, "e0", LEAST_WORK, "e1")
    # b with 64 tokens of prefill queued (free share 2/3): the term would still prefer b (a 240 + 1,440, b 64 + 1,605),
    # but there the first token would wait on a queue, so the least work decides alone: a
    new.view.endpoints[1].queued_prefill_tokens = 64
    assert new.decide(req).target == "e0"
    new.view.endpoints[1].queued_prefill_tokens = 0
    for i in range(12):  # a's answers are done: nothing decodes there, the request stays with its cache
        new.on_finish(f"a{i}", 5.0, 100)
    assert new.decide(req).target == "e0"
