"""Each preset's defining behaviour, the framework's guarantees, and bad input."""

import pytest

from kvroute.errors import ConfigError
from kvroute.model import DecisionKind, Endpoint, Request
from kvroute.policy import PRESETS, Router, build_policy, policy_from_config
from tests.conftest import make_request

LONG = "shared context about the deployment " * 120  # ~4.3K chars → 16 blocks of 64 tokens


def loads(router):
    return {e.id: e.inflight for e in router.endpoints}


# -- framework ------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_routes_and_accounting_returns_to_zero(preset, router_for):
    router = router_for(preset, n=5)
    reqs = [make_request(f"r{i}", LONG + str(i % 3), key=f"u{i % 4}") for i in range(40)]
    for r in reqs:
        d = router.route(r)
        assert d.kind is DecisionKind.DISPATCH and d.branch, d
        assert d.target in {e.id for e in router.endpoints}
        router.on_first_token(r.id)
    assert sum(e.inflight for e in router.endpoints) == 40
    for r in reqs:
        router.on_finish(r.id)
        router.on_finish(r.id)  # idempotent: never double-undone
    for e in router.endpoints:
        assert (e.inflight, e.inflight_tokens, e.queued_prefill_tokens) == (0, 0, 0)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_bad_input_gives_typed_none_never_raises(preset, router_for):
    router = router_for(preset)
    d = router.route(Request(id="empty"))
    assert d.kind is DecisionKind.NONE and d.branch == "bad-request"
    empty = Router(build_policy(preset), [])
    d = empty.route(make_request("x"))
    assert d.kind is DecisionKind.NONE and "no endpoints" in d.reason
    for e in router.endpoints:
        e.healthy = False
    d = router.route(make_request("y"))
    assert d.kind is DecisionKind.NONE and d.branch == "all-filtered"


def test_residency_zone_filters_endpoints():
    eps = [Endpoint("us-1", region="us"), Endpoint("eu-1", region="eu"), Endpoint("eu-2", region="eu")]
    router = Router(build_policy("round_robin"), eps)
    for i in range(6):
        assert router.route(make_request(f"r{i}", residency="eu")).target in {"eu-1", "eu-2"}
    d = router.route(make_request("asia", residency="asia"))
    assert d.kind is DecisionKind.NONE and "residency" in d.reason


def test_burst_sees_inflight_of_earlier_decisions(router_for):
    router = router_for("least_request", n=4)
    targets = [router.route(make_request(f"b{i}")).target for i in range(8)]
    assert sorted(loads(router).values()) == [2, 2, 2, 2]  # never all on one replica
    assert len(set(targets[:4])) == 4


def test_first_token_releases_prefill_backlog_only(router_for):
    router = router_for("lmetric", n=1)
    r = make_request("a", LONG)
    router.route(r)
    e = router.endpoints[0]
    assert e.queued_prefill_tokens == r.prompt_tokens and e.inflight_tokens == r.prompt_tokens
    router.on_first_token("a")
    assert e.queued_prefill_tokens == 0 and e.inflight == 1
    router.on_finish("a")
    assert e.inflight == 0 and e.inflight_tokens == 0


def test_recommit_moves_accounting(router_for):
    router = router_for("round_robin", n=2)
    r = make_request("retry")
    router.commit(r, "e0")
    router.commit(r, "e1")  # retried elsewhere: e0 is released
    assert loads(router) == {"e0": 0, "e1": 1}


def test_config_errors_name_what_is_wrong():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*valid presets: round_robin"):
        build_policy("nope")
    with pytest.raises(ConfigError, match="unknown parameter 'treshold'.*valid parameters:.*cache_threshold"):
        build_policy("sglang_cache_aware", {"treshold": 0.4})
    with pytest.raises(ConfigError, match="cache_threshold"):
        build_policy("sglang_cache_aware", {"cache_threshold": 2})
    with pytest.raises(ConfigError, match="'blind', 'pending', 'outstanding' or 'forward'"):
        build_policy("lmetric", {"admission": "sometimes"})
    with pytest.raises(ConfigError, match="unknown scorer.*valid scorers: prefix"):
        build_policy("weighted", {"scorers": {"vibes": 1}})
    with pytest.raises(ConfigError, match="unknown key.*allowed: preset, params"):
        policy_from_config({"preset": "lmetric", "parms": {}})


def test_overrides_from_yaml(tmp_path):
    from kvroute.policyfiles import load_policy_file

    f = tmp_path / "p.yaml"
    f.write_text("preset: sglang_cache_aware\nparams:\n  balance_abs: 4\n  admission: pending\n")
    policy = load_policy_file(f)
    assert policy.params.balance_abs == 4 and policy.admission.name == "pending"
    f.write_text("preset: [unclosed\n")
    with pytest.raises(ConfigError, match=r"p.yaml:\d+: invalid YAML"):
        load_policy_file(f)


# -- presets: defining behaviour --------------------------------------------------------------

def test_round_robin_cycles(router_for):
    router = router_for("round_robin", n=3)
    assert [router.route(make_request(f"r{i}")).target for i in range(6)] == ["e0", "e1", "e2"] * 2


def test_random_is_seeded_and_covers_all(router_for):
    a = [router_for("random").route(make_request(f"r{i}")).target for i in range(1)]
    r1, r2 = router_for("random"), router_for("random")
    s1 = [r1.route(make_request(f"r{i}")).target for i in range(40)]
    s2 = [r2.route(make_request(f"r{i}")).target for i in range(40)]
    assert s1 == s2 and set(s1) == {"e0", "e1", "e2", "e3"} and a


def test_least_load_counts_tokens_not_requests(router_for):
    router = router_for("least_load", n=2)
    router.commit(make_request("big", tokens=10_000), "e0")
    router.commit(make_request("s1", tokens=10), "e1")
    router.commit(make_request("s2", tokens=10), "e1")
    assert router.route(make_request("new")).target == "e1"


def test_power_of_two_never_picks_the_heavier_of_its_pair(router_for):
    router = router_for("power_of_two", n=4)
    router.endpoints[0].inflight = 100
    for i in range(100):
        r = make_request(f"r{i}")
        assert router.route(r).target != "e0"
        router.on_finish(r.id)


def test_consistent_hash_affinity_and_fallback(router_for):
    router = router_for("consistent_hash", n=5)
    first = router.route(make_request("a", key="user-7")).target
    assert all(router.route(make_request(f"a{i}", key="user-7")).target == first for i in range(5))
    assert router.route(make_request("nokey")).branch == "no-key-fallback"
    other = next(e.id for e in router.endpoints if e.id != first)
    router.remove_endpoint(other)  # an unrelated replica leaving does not move the session
    assert router.route(make_request("b", key="user-7")).target == first


def test_prefix_hash_uses_first_256_tokens_with_load_bound(router_for):
    router = router_for("prefix_hash", n=4)
    head = "h" * 1024  # 256 tokens
    t = router.route(make_request("a", head + "tail one " * 50)).target
    router.on_finish("a")
    assert router.route(make_request("b", head + "other tail " * 80)).target == t
    router.on_finish("b")
    # saturate t: bounded load sends the next one elsewhere, clockwise
    for i in range(6):
        router.commit(make_request(f"f{i}"), t)
    d = router.route(make_request("c", head + "third"))
    assert d.target != t and d.branch == "ring-overflow"


def test_sglang_imbalance_needs_both_abs_and_rel(router_for):
    router = router_for("sglang_cache_aware", n=2)
    router.route(make_request("warm", LONG))
    warm = router.tickets["warm"].endpoint_id
    cold = "e1" if warm == "e0" else "e0"
    # follow the cache while balanced
    assert router.route(make_request("hit", LONG)).branch == "prefix-hit"
    # abs difference > 32 and rel > 1.0001 → imbalance
    router.endpoint(warm).inflight += 40
    d = router.route(make_request("hit2", LONG))
    assert d.branch == "imbalance-fallback" and d.target == cold
    # large rel but abs difference ≤ 32 → no imbalance, the cache wins
    router.prefix.clear(cold)
    router.endpoint(warm).inflight = 20
    router.endpoint(cold).inflight = 0
    assert router.route(make_request("hit3", LONG)).target == warm
    # a miss goes to the least loaded
    d = router.route(make_request("miss", "completely different " * 300))
    assert d.branch == "prefix-miss" and d.target == cold


def test_aibrix_range_and_std_rule(router_for):
    router = router_for("aibrix_prefix_cache", n=3)
    router.commit(make_request("warm", LONG), "e0")
    for e, running in zip(router.endpoints, (4, 4, 4)):
        e.apply_probe(running, 0)
    d = router.route(make_request("hit", LONG))
    assert (d.target, d.branch) == ("e0", "prefix-hit")
    # e0 above mean + σ of the pool's batch sizes: the match is passed over
    for e, running in zip(router.endpoints, (8, 2, 2)):
        e.apply_probe(running, 0)
    d = router.route(make_request("hot", LONG))
    assert d.target != "e0" and d.branch == "prefix-miss"
    router.endpoints[0].apply_probe(12, 0)  # range 10 > 8 → least loaded outright
    d = router.route(make_request("x", LONG))
    assert d.branch == "imbalance-fallback" and d.target != "e0"


def test_vllm_jsq_uses_running_plus_waiting(router_for):
    router = router_for("vllm_jsq", n=3)
    for e, (run, wait) in zip(router.endpoints, [(5, 0), (1, 3), (2, 0)]):
        e.apply_probe(run, wait)
    assert router.route(make_request("a")).target == "e2"


def test_bailian_lambda_extremes(router_for):
    router = router_for("bailian_linear", n=2, params={"lam": 1.0})
    router.commit(make_request("warm", LONG), "e0")
    router.endpoints[0].running = 30
    assert router.route(make_request("a", LONG)).target == "e0"  # λ=1: hit ratio only
    router = router_for("bailian_linear", n=2, params={"lam": 0.0})
    router.commit(make_request("warm", LONG), "e0")
    router.endpoints[0].running = 30
    assert router.route(make_request("a", LONG)).target == "e1"  # λ=0: batch size only


def test_dynamo_cost_formula(router_for):
    router = router_for("dynamo_kv", n=2)
    req = make_request("warm", LONG)
    router.commit(req, "e0")
    router.on_first_token("warm")
    d = router.decide(make_request("a", LONG))
    bt, p = req.block_tokens, req.prompt_tokens
    full = len(req.block_hashes)
    # e0: cached 16 blocks → prefill = p − 16·64 (≥ 0); decode = (p + p)/bt
    assert d.scores["e0"] == pytest.approx(max(0, p - full * bt) / bt + 2 * p / bt)
    assert d.scores["e1"] == pytest.approx(p / bt + p / bt)


def test_skywalker_selective_pushing_and_prefix(router_for):
    router = router_for("skywalker", n=3)
    router.route(make_request("warm", LONG))
    warm = router.tickets["warm"].endpoint_id
    assert router.route(make_request("hit", LONG)).target == warm
    router.endpoint(warm).waiting = 2  # pending → unavailable: prefix is ignored
    d = router.route(make_request("hit2", LONG))
    assert d.target != warm and d.branch == "least-load"
    for e in router.endpoints:
        e.waiting = 1
    d = router.route(make_request("held", LONG))
    assert d.kind is DecisionKind.HOLD
    assert "held" not in router.tickets


def test_skywalker_low_match_goes_to_least_load(router_for):
    router = router_for("skywalker", n=3)
    router.route(make_request("warm", LONG))
    warm = router.tickets["warm"].endpoint_id
    d = router.route(make_request("partial", LONG[:1100] + "new tail " * 400))
    assert d.branch == "least-load" and d.target != warm


def test_skywalker_ch_skips_unavailable_clockwise(router_for):
    router = router_for("skywalker_ch", n=4)
    owner = router.route(make_request("a", key="user-3")).target
    router.endpoint(owner).waiting = 1
    d = router.route(make_request("b", key="user-3"))
    assert d.branch == "ring" and d.target == router.ring.lookup("user-3", {"e0", "e1", "e2", "e3"} - {owner})


def test_gorgo_weighs_rtt_against_uncached_prefill():
    eps = [Endpoint("near", rtt_s=0.002), Endpoint("far", rtt_s=0.150)]
    router = Router(build_policy("gorgo"), eps)
    assert router.route(make_request("a", "q " * 50)).target == "near"
    router.on_finish("a")
    big = make_request("warm", LONG)
    router.commit(big, "far")
    router.on_finish("warm")
    # far holds the whole 1K-token prefix: 0.5·150 ms < 1·uncached tokens at near
    d = router.route(make_request("b", LONG))
    assert d.target == "far" and d.scores["far"] < d.scores["near"]


def test_lmetric_score_formula(router_for):
    router = router_for("lmetric", n=2)
    router.endpoints[0].apply_probe(running=3, waiting=1)
    router.endpoints[1].apply_probe(running=0, waiting=0)
    r = make_request("a", LONG)
    d = router.decide(r)
    assert d.scores == {"e0": r.prompt_tokens * 5, "e1": r.prompt_tokens * 1}
    # with e0 caching the prefix its P-tokens shrink enough to win despite its batch
    router.prefix.insert("e0", r.block_hashes)
    r2 = make_request("b", LONG)
    assert router.decide(r2).target == "e0"


def test_weighted_llm_d_profile_prefers_cache_and_free_kv(router_for):
    router = router_for("weighted", n=3)  # defaults: llm-d's scorer profile
    router.commit(make_request("warm", LONG), "e2")
    router.on_finish("warm")
    assert router.route(make_request("a", LONG)).target == "e2"
    router.on_finish("a")
    for e, kv in zip(router.endpoints, (0.1, 0.9, 0.9)):
        e.kv_usage = kv
    assert router.route(make_request("fresh", "unrelated " * 300)).target == "e0"


def test_outstanding_admission_holds_above_limit(router_for):
    router = router_for("least_request", n=2, params={"admission": "outstanding", "max_outstanding": 2})
    kinds = [router.route(make_request(f"r{i}")).kind for i in range(5)]
    assert kinds.count(DecisionKind.DISPATCH) == 4 and kinds[-1] is DecisionKind.HOLD
