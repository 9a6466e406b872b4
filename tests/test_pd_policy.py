"""The pure P/D layer: PDRouter's choices, accounting and deciders (policy/pd.py, builtin/pd.py)."""

from __future__ import annotations

import pytest

from kvroute.model import DecisionKind, Endpoint, Request
from kvroute.policy import ConfigError
from kvroute.policy.pd import LOCAL, SPLIT, PDPolicySpec, PDRouter, compile_decider, kv_transfer_s, role_check
from kvroute.policyfiles import load_entry_points

load_entry_points()  # profile names for pd_adaptive


def _fleet(*roles: str, region: str = "us") -> list[Endpoint]:
    return [Endpoint(f"{r[0]}{i}", region=region, role=r, kv_blocks=10_000, block_size=16) for i, r in enumerate(roles)]


def _req(rid: str, blocks: int, first: int = 0) -> Request:
    return Request(id=rid, block_hashes=tuple(range(first, first + blocks)), prompt_tokens=64 * blocks)


def test_a_split_commits_prefill_on_the_prefill_side_and_nothing_to_prefill_on_the_decode_side():
    r = PDRouter.from_spec(PDPolicySpec(), 0, _fleet("prefill", "decode"))
    d = r.route(_req("a", 20))
    assert (d.kind, d.branch, d.prefill, d.target) == (DecisionKind.DISPATCH, SPLIT, "p0", "d1")
    p, dec = r.endpoint("p0"), r.endpoint("d1")
    assert (p.inflight, p.queued_prefill_tokens) == (1, 1280)
    assert (dec.inflight, dec.queued_prefill_tokens) == (1, 0)
    r.on_prefill_done("a", 0.2)
    assert (p.inflight, p.queued_prefill_tokens) == (0, 0)
    r.on_finish("a", 1.0, 8)
    assert dec.inflight == 0 and not r.tickets and not r.prefill.tickets
    # a failure undoes both sides and the index forgets the prompt on both
    r.route(_req("b", 4, first=100))
    r.on_failed("b")
    assert all(e.inflight == 0 for e in r.all_endpoints)
    assert r.prefix.match_one("d1", tuple(range(100, 104))) == 0


def test_the_decode_engine_is_chosen_near_the_prefill_engine():
    eps = [Endpoint("p-us", region="us", role="prefill"), Endpoint("d-eu", region="eu", role="decode"),
           Endpoint("d-us", region="us", role="decode")]
    r = PDRouter.from_spec(PDPolicySpec(), 0, eps)
    assert r.route(_req("a", 2)).target == "d-us"


def test_llm_d_threshold_keeps_cached_prompts_local():
    spec = PDPolicySpec(disaggregate={"pd_uncached_at_least": 512})
    r = PDRouter.from_spec(spec, 0, _fleet("prefill", "decode"))
    assert r.route(_req("short", 4)).branch == LOCAL  # 256 uncached tokens
    d = r.route(_req("long", 20, first=50))
    assert d.branch == SPLIT
    r.on_finish("long", 1.0)
    assert r.route(_req("again", 20, first=50)).branch == LOCAL  # now cached on the decode engine


def test_dynamo_needs_a_long_prefill_and_a_short_prefill_queue():
    spec = PDPolicySpec(disaggregate={"pd_dynamo": {"max_local_prefill": 1000, "max_prefill_queue": 1}})
    r = PDRouter.from_spec(spec, 0, _fleet("prefill", "decode"))
    assert r.route(_req("a", 10)).branch == LOCAL  # 640 tokens
    assert r.route(_req("b", 20, first=100)).branch == SPLIT
    r.endpoint("p0").waiting = 3  # the prefill engine's queue is long now
    assert r.route(_req("c", 20, first=200)).branch == LOCAL


def test_adaptive_splits_when_the_decode_engine_is_busy():
    spec = PDPolicySpec(disaggregate={"pd_adaptive": {"profile": "h100-llama3.2-3b"}})
    r = PDRouter.from_spec(spec, 0, _fleet("prefill", "decode"))
    assert r.route(_req("idle", 64)).branch == LOCAL  # nothing to spare: the transfer only costs
    r.on_finish("idle", 1.0)
    r.endpoint("d1").running = 100
    assert r.route(_req("busy", 64, first=500)).branch == SPLIT


def test_without_prefill_engines_the_decode_side_serves_alone_or_refuses():
    eps = _fleet("prefill", "decode")
    eps[0].healthy = False
    assert PDRouter.from_spec(PDPolicySpec(), 0, eps).route(_req("a", 2)).branch == LOCAL
    sglang = PDRouter.from_spec(PDPolicySpec(), 0, _fleet("prefill", "decode"), decode_alone=False)
    sglang.endpoint("p0").healthy = False
    d = sglang.route(_req("a", 2))
    assert d.kind is DecisionKind.NONE and "no prefill engine" in d.reason


def test_presets_still_work_on_an_aggregated_fleet():
    r = PDRouter.from_spec(PDPolicySpec(decode_policy="lmetric"), 0, _fleet("mixed", "mixed"))
    d = r.route(_req("a", 3))
    assert d.kind is DecisionKind.DISPATCH and d.prefill in (None, "m0", "m1")


def test_deciders_and_roles_are_checked():
    assert compile_decider("always") is True and compile_decider("never") is False
    with pytest.raises(ConfigError, match="unknown condition"):
        compile_decider({"pd_nonsense": 1})
    with pytest.raises(ConfigError, match="tokens must be"):
        compile_decider({"pd_uncached_at_least": -1})
    assert role_check(["prefill", "mixed"]) is None
    assert "no decode" in (role_check(["prefill"]) or "")
    assert "no prefill" in (role_check(["decode", "decode"]) or "")
    assert kv_transfer_s(1000, 100_000, 25.0, 0.001) == pytest.approx(0.001 + 1e8 / 25e9)


def test_the_seeds_compose_with_pd():
    """GORGO's RTT cost and LMetric's score choose prefill engines; SkyWalker's pending admission
    holds on the decode side (a held request is not split, nothing committed)."""
    for prefill in ("gorgo", "lmetric"):
        r = PDRouter.from_spec(PDPolicySpec(prefill_policy=prefill), 0, _fleet("prefill", "prefill", "decode"))
        d = r.route(_req("a", 8))
        assert d.branch == SPLIT and d.prefill in ("p0", "p1")
    r = PDRouter.from_spec(PDPolicySpec(decode_policy="skywalker"), 0, _fleet("prefill", "decode"))
    r.endpoint("d1").waiting = 5  # SkyWalker's pending gate: a replica with waiting requests admits none
    d = r.route(_req("b", 8))
    assert d.kind is DecisionKind.HOLD and not r.tickets and not r.prefill.tickets
