"""The detour of ``lmetric_speed``'s TTFT pick (policy/adaptive/replica_speed/detour.py): among the replicas
where the request's first token is not late, the speed-scaled score chooses; a replica outside its near set
qualifies only while its measured decode time per token is no worse than the near set's pick's."""

from __future__ import annotations

import pytest

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed import SpeedFit
from kvroute.policy.adaptive.replica_speed.detour import OUTSIDE_S, detour


def _complete(fit: SpeedFit, ep: str, i: int, ttft: float, tpot: float, out: int = 101) -> None:
    rid = f"{ep}-{i}"
    fit.dispatched(rid, ep, 1000, 0.0)
    fit.first_token(rid, ttft)
    fit.finished(rid, ep, ttft + tpot * (out - 1), out)


def _fleet(slow_tpot: float = 0.050) -> SpeedFit:
    """fast: TPOTs of 12 to 68 ms (~40 ms per token measured); slow: ``slow_tpot``; every TTFT 0.3 s (the mean
    wait)."""
    fit = SpeedFit(min_samples=2)
    for i in range(8):
        _complete(fit, "fast", i, 0.3, 0.010 + 0.002 * (i * 4 + 1))
        _complete(fit, "slow", i, 0.3, slow_tpot)
    return fit


def _pick(values: list[float], names: list[str]) -> str:
    return names[values.index(min(values))]


@pytest.mark.parametrize(("slow_tpot", "ttft", "chosen"), [
    (0.050, [0.5, 1.7], "fast"),   # long prompt, late on slow; fast decoded ~40 ms per token <= slow's 50 ms
    (0.015, [0.5, 1.7], "slow"),   # slow's requests decoded faster than fast's: no detour, the late pick stays
    (0.050, [0.22, 0.48], "slow"),  # short prompt: slow is not late (0.48 <= 0.22 + 0.3) and the score prefers it
])
def test_a_late_request_detours_only_while_the_measured_decode_there_is_no_slower(slow_tpot, ttft, chosen):
    fit = _fleet(slow_tpot)
    eps = [Endpoint("fast", inflight=25), Endpoint("slow", inflight=0)]
    scaled = [10.0, 1.0]  # the score puts fast out of the near set (limit 2)
    assert _pick(detour(fit, eps, ttft, scaled, 2.0, {}), ["fast", "slow"]) == chosen


def test_the_score_chooses_among_the_replicas_where_the_first_token_is_not_late():
    """Two fast replicas in the near set, an idle slow one: a short prompt (not late anywhere) goes where the
    score ranks best, the slow one; a long one (late on the slow one) to the better-scored fast one, not to the
    fast one whose first token would come soonest."""
    fit = _fleet()
    fit.dispatched("r", "fast2", 1000, 0.0)
    fit.first_token("r", 0.3)
    names = ["fast", "fast2", "slow"]
    eps = [Endpoint(n) for n in names]
    scaled = [1.6, 1.2, 1.0]  # all within 2x the best: the near set
    assert _pick(detour(fit, eps, [0.20, 0.25, 0.45], scaled, 2.0, {}), names) == "slow"
    values = detour(fit, eps, [0.40, 0.45, 1.6], scaled, 2.0, {})
    assert _pick(values, names) == "fast2"
    assert values[2] == pytest.approx(1.6 + OUTSIDE_S)  # late, in the near set: after every qualifying one


def test_an_unmeasured_replica_is_read_at_its_decode_factor_times_the_median():
    fit = _fleet()  # fast ~40 ms, slow 50 ms per token measured: median ~45 ms
    assert fit.mean_wait_s() == pytest.approx(0.3)
    eps = [Endpoint("new"), Endpoint("slow")]
    scaled = [10.0, 1.0]
    # new's decode factor 0.5 puts it at ~23 ms <= slow's 50: the late request detours there
    assert _pick(detour(fit, eps, [0.5, 1.7], scaled, 2.0, {"new": 0.5}), ["new", "slow"]) == "new"
    # factor 2: ~90 ms > 50 ms: it stays on the (late) near pick
    assert _pick(detour(fit, eps, [0.5, 1.7], scaled, 2.0, {"new": 2.0}), ["new", "slow"]) == "slow"


def test_before_any_completion_the_detour_is_unbounded_and_tiers_keep_their_order():
    fit = SpeedFit(min_samples=2)
    fit.dispatched("r", "fast", 100, 0.0)
    fit.first_token("r", 0.2)
    eps = [Endpoint("fast", inflight=30), Endpoint("slow"), Endpoint("far")]
    values = detour(fit, eps, [0.3, 1.5, 2.0], [10.0, 1.0, 50.0], 2.0, {})
    assert values[0] == pytest.approx(10.0 / 51.0)  # out of the near set, soon, nothing known of TPOT: by score
    assert values[1] == pytest.approx(1.5 + OUTSIDE_S)  # the near set's pick, late
    assert values[2] == pytest.approx(2.0 + 2 * OUTSIDE_S)


@pytest.mark.parametrize(("slo_ms", "chosen"), [
    (0.0, "slow"),    # no SLO: slow's requests decoded faster (15 ms) than fast's (~40 ms): the late pick stays
    (100.0, "fast"),  # the SLO given: fast's p90 (~65 ms) leaves headroom under 100 ms, the long prompt goes there
    # ~65 ms > 50 ms: no headroom, so fast does not qualify — but the request is late on slow by more than a mean
    # wait, and fast's predicted mean (~40 ms) is within 50 ms: the soonest of those keeps it
    (50.0, "fast"),
    (30.0, "slow"),   # even fast's mean is past 30 ms: the near set's late pick, slow
])
def test_with_a_tpot_slo_a_late_request_detours_while_the_p90_there_is_within_it(slo_ms, chosen):
    fit = _fleet(0.015)
    p90 = fit.decode_p90_s()
    assert 0.060 < p90["fast"] < 0.070 and p90["slow"] == pytest.approx(0.015)  # mean + 1.28 sd of 12..68 ms
    eps = [Endpoint("fast", inflight=25), Endpoint("slow", inflight=0)]
    values = detour(fit, eps, [0.5, 1.7], [10.0, 1.0], 2.0, {}, slo_ms / 1000.0)
    assert _pick(values, ["fast", "slow"]) == chosen


def test_auto_hands_its_tpot_slo_to_every_copy_of_its_score():
    from kvroute.policy import build_policy
    from kvroute.policy.adaptive.replica_speed import SpeedLMetric

    def slos(policy) -> list[float]:
        scorers = [s for rule in policy.rules for s, _ in rule.scorers]
        scorers += [getattr(f, "scorer", None) for rule in policy.rules for f in rule.among]
        return [s.slo_tpot_s for s in scorers if isinstance(s, SpeedLMetric)]
    assert slos(build_policy("auto")) == [0.0] * 4
    assert slos(build_policy("auto", {"slo_tpot_ms": 80})) == [0.08] * 4


def test_the_busy_term_stands_aside_while_the_cached_replica_has_no_tpot_headroom():
    """busy_uncached_headroom: busy_uncached as is, unless the replica with the longest cached prefix measured a
    p90 TPOT past the SLO (then 0 for the decision); without an SLO, busy_uncached exactly."""
    import random

    from kvroute.policy import Router, build_policy
    from kvroute.policy.adaptive.replica_speed import BusyUncachedHeadroom
    from kvroute.policy.adaptive.replica_speed.plugin import speed_fit
    from kvroute.policy.builtin.scorers import BusyUncached
    from kvroute.policy.plugins import DecisionState
    from kvroute.policy.shared import sharing
    from tests.conftest import make_request

    with sharing():  # one policy's plugins naming one fit read the same one
        assert speed_fit("x", 2, 128, 1.5, 2.0) is speed_fit("x", 2, 128, 1.5, 2.0)
    fit = _fleet(0.120)  # "slow" decodes at 120 ms per token, "fast" at a p90 of ~65 ms
    with_slo, without = BusyUncachedHeadroom(slo_tpot_ms=100), BusyUncachedHeadroom()
    with_slo.fit = without.fit = fit
    req = make_request("turn2", "hello " * 800)
    for cached, stands_aside in (("slow", True), ("fast", False)):
        router = Router(build_policy("round_robin"), [Endpoint("fast"), Endpoint("slow")])
        eps = router.view.endpoints
        for e in eps:
            e.queued_prefill_tokens = 10
        router.prefix.insert(cached, req.block_hashes[:-2])
        st = DecisionState(req, router.view, random.Random(0))
        plain = BusyUncached().values(st, eps)
        assert without.values(st, eps) == plain and max(plain) > 0
        assert with_slo.values(st, eps) == ([0.0, 0.0] if stands_aside else plain)


def test_auto_hands_its_tpot_slo_to_the_busy_term_which_reads_the_incumbents_fit():
    from kvroute.policy import build_policy
    from kvroute.policy.adaptive.replica_speed import BusyUncachedHeadroom, SpeedLMetric

    for params, slo in (({}, 0.0), ({"slo_tpot_ms": 80}, 0.08)):
        policy = build_policy("auto", params)
        scorers = [s for rule in policy.rules for s, _ in rule.scorers]
        busy = [s for s in scorers if isinstance(s, BusyUncachedHeadroom)]
        fits = {id(s.fit) for s in scorers if isinstance(s, SpeedLMetric)}
        assert len(busy) == 1 and busy[0].slo_tpot_s == slo and fits == {id(busy[0].fit)}


def _load(fit: SpeedFit, ep: str, n: int, tpot_of, tag: str) -> None:
    """``n`` requests in flight on ``ep`` at once, then completed in order; the j-th decodes at ``tpot_of`` (its mean
    count in flight — at dispatch and at completion, averaged —, j): a decode step growing with the batch."""
    rids = [f"{ep}-{tag}-{i}" for i in range(n)]
    for rid in rids:
        fit.dispatched(rid, ep, 1000, 0.0)
        fit.dispatched(rid, ep, 1000, 0.0)  # a shared fit hears each dispatch once per copy: counted once
        fit.first_token(rid, 0.4)
    for j, rid in enumerate(rids):
        x = ((j + 1) + (n - j)) / 2.0
        fit.finished(rid, ep, 0.4 + tpot_of(x, j) * 100, 101)


def _loaded_fleet() -> SpeedFit:
    """fast: 20 ms per output token + 2 ms per request in flight (±8 ms); slow: 50 ms at any count; every wait
    (TTFT − RTT) 0.4 s, so the fleet's mean and p90 wait are both 0.4 s."""
    fit = SpeedFit(min_samples=2)
    for k, n in enumerate((4, 12, 20, 28, 36, 44)):
        _load(fit, "fast", n, lambda x, j: 0.020 + 0.002 * x + (0.008 if j % 2 else -0.008), f"a{k}")
        _load(fit, "slow", 2, lambda x, j: 0.050, f"b{k}")
    return fit


def test_the_fit_learns_tpot_on_the_count_in_flight_counting_each_request_once():
    fit = _loaded_fleet()
    mean, p90 = fit.tpot_at("fast", 30)
    assert mean == pytest.approx(0.080, abs=0.006) and p90 > mean + 0.005
    mean, p90 = fit.tpot_at("fast", 36)  # the count the cases below put fast at: p90 past 100 ms, the mean not
    assert mean < 0.100 < p90
    assert fit.tpot_at("fast", 10)[0] == pytest.approx(0.040, abs=0.006)
    assert fit.tpot_at("slow", 30)[0] == pytest.approx(0.050)
    assert fit.tpot_at("nobody", 1) is None
    assert fit._count == {"fast": 0, "slow": 0}  # every request left: dispatched twice, counted once
    assert fit.mean_wait_s() == pytest.approx(0.4) and fit.wait_p90_s() == pytest.approx(0.4)


@pytest.mark.parametrize(("fast_inflight", "ttft", "chosen"), [
    (10, [0.30, 0.38], "slow"),  # short: not a tail first token on slow (0.38 <= the p90 wait), the score's pick
    (10, [0.30, 0.60], "fast"),  # medium: by the mean-wait margin slow qualified (0.60 <= 0.3 + 0.4); not now
    (35, [0.30, 0.60], "slow"),  # fast has no TPOT headroom at 36 in flight (p90 > 100 ms): slow takes the medium
    (35, [0.30, 1.20], "fast"),  # long, late on slow by more than a mean wait: fast's predicted mean still fits
    (60, [0.30, 1.20], "slow"),  # at 61 in flight even fast's predicted mean (~142 ms) is past the SLO
])
def test_with_a_tpot_slo_slow_replicas_take_what_is_no_tail_first_token_and_fast_ones_shed_at_their_count(
        fast_inflight, ttft, chosen):
    fit = _loaded_fleet()
    eps = [Endpoint("fast", inflight=fast_inflight), Endpoint("slow", inflight=0)]
    scaled = [1.5, 1.0]  # both in the near set; the score prefers the idle slow replica
    assert _pick(detour(fit, eps, ttft, scaled, 2.0, {}, 0.100), ["fast", "slow"]) == chosen
    # without the SLO, session 7's rule: the mean-wait margin, the score's order
    assert _pick(detour(fit, eps, ttft, scaled, 2.0, {}), ["fast", "slow"]) == ("slow" if ttft[1] <= 0.7 else "fast")
