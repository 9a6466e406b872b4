"""Fidelity defects of issue 7: SGLang's miss mode, prefix_hash's key on Mooncake, closed loops
that run out of conversations."""

import json

from conftest import MOONCAKE, make_request, needs_trace

from kvroute.model import Endpoint
from kvroute.policy import Router, build_policy
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import parse_scenario


def _two_replicas(miss: str) -> Router:
    router = Router(build_policy("sglang_cache_aware", {"miss": miss}), [Endpoint("big"), Endpoint("small")])
    for i in range(5):  # 'big' holds a large tree but nothing in flight
        router.commit(make_request(f"w{i}", f"warm-up text {i} " * 40), "big")
        router.on_finish(f"w{i}")
    router.commit(make_request("busy", "other text " * 40), "small")  # 'small' has one in flight
    return router


def test_sglang_miss_goes_to_least_load_by_default_and_smallest_tree_on_request():
    miss = make_request("new", "a prompt nobody has seen " * 40)
    d = _two_replicas("least_load").route(miss)
    assert (d.branch, d.target) == ("prefix-miss", "big")
    d = _two_replicas("smallest_tree").route(miss)
    assert (d.branch, d.target) == ("prefix-miss", "small")
    assert build_policy("sglang_cache_aware").params.miss == "least_load"


def test_prefix_hash_key_reaches_past_a_shared_first_block():
    from kvroute.model import Request

    key = build_policy("prefix_hash").rules[0].route.key  # the bounded_prefix_ring route's key
    a = Request(id="a", block_hashes=(0, 11, 12), block_tokens=512, prompt_tokens=1500)
    b = Request(id="b", block_hashes=(0, 21, 22), block_tokens=512, prompt_tokens=1500)
    assert key(a) != key(b)  # one shared system-prompt block is not the key
    short = Request(id="c", block_hashes=(7,), block_tokens=512, prompt_tokens=300)
    assert key(short) == 7


@needs_trace
def test_prefix_hash_mostly_follows_its_ring_on_mooncake():
    sc = parse_scenario({"replicas": [{"region": "us", "count": 8, "profile": "h20-qwen3-30b-a3b"}],
                         "workload": {"kind": "mooncake", "path": str(MOONCAKE)},
                         "policies": ["prefix_hash", {"preset": "prefix_hash", "params": {"min_key_blocks": 1}}],
                         "limits": {"max_requests": 1500}, "seed": 1})
    fixed, old = (r.result for r in run_scenario(sc))
    share = fixed["branches"].get("ring-overflow", 0) / fixed["requests"]
    old_share = old["branches"].get("ring-overflow", 0) / old["requests"]
    assert share < 0.5 < old_share
    assert fixed["prefix_hit_rate"] > old["prefix_hit_rate"]


def test_closed_loop_ends_when_conversations_run_out(tmp_path):
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"},
                         {"role": "user", "content": "bye"}]}
    trace = tmp_path / "msgs.jsonl"
    trace.write_text((json.dumps(conv) + "\n") * 2)
    sc = parse_scenario({"replicas": [{"region": "us", "count": 2}],
                         "workload": {"kind": "openai", "path": str(trace)},
                         "policies": ["round_robin"], "seed": 1})
    r = run_scenario(sc)[0].result
    assert r["requests"] == 6 and r["issued"] == 6
    assert r["sim_time_s"] < 60  # it stops with the last answer, not at a horizon


def test_bench_gateway_never_reports_a_negative_overhead():
    from kvroute.bench.gateway import _compare, added_text

    direct = [{"rps": 1000, "p50_ms": 2.0, "p99_ms": 5.0, "errors": 0},
              {"rps": 1100, "p50_ms": 2.2, "p99_ms": 6.0, "errors": 0}]
    via = [{"rps": 900, "p50_ms": 1.9, "p99_ms": 5.5, "errors": 0},
           {"rps": 1000, "p50_ms": 2.1, "p99_ms": 6.5, "errors": 0}]
    row = _compare(direct, via)
    assert row["added_p50_ms"] == 0.0 and not row["added_p50_resolved"]
    assert row["added_p50_ms_spread"] == [-0.1, -0.1]
    assert added_text(row, "p50").startswith("< noise")
    assert row["added_p99_resolved"] and row["added_p99_ms"] == 0.5
    assert row["rps_ratio_spread"][0] <= row["rps_ratio"] <= row["rps_ratio_spread"][1] < 1


def test_skipping_first_token_events_changes_nothing_for_policies_that_do_not_read_them(monkeypatch):
    from kvroute.policy import Policy, build_policy

    assert build_policy("lmetric").reads_prefill_backlog and not build_policy("skywalker").reads_prefill_backlog
    sc = parse_scenario({"replicas": [{"region": "us", "count": 3}],
                         "workload": {"kind": "chat", "clients": {"us": 12}},
                         "policies": ["skywalker", "sglang_cache_aware"], "limits": {"max_requests": 300}, "seed": 2})
    skipped = [r.result for r in run_scenario(sc)]
    monkeypatch.setattr(Policy, "reads_prefill_backlog", property(lambda self: True))
    delivered = [r.result for r in run_scenario(sc)]
    assert json.dumps(skipped, sort_keys=True) == json.dumps(delivered, sort_keys=True)
