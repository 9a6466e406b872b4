"""Prefill/decode disaggregation in the simulator (sim/disagg.py): the legs, the KV transfer from
bytes over the link plus RTT, decode admission bounded by KV, and the scenario's checks."""

from __future__ import annotations

import pytest
from conftest import needs_trace

from kvroute.perf.loader import load_profile
from kvroute.policy.pd import kv_transfer_s
from kvroute.sim.scenario import ScenarioError, load_scenario, parse_scenario
from kvroute.sim.simulation import Simulation

PROFILE = "h100-llama3.2-3b"


def _scenario(**over):
    data = {"name": "pd", "seed": 3,
            "replicas": [{"region": "us", "count": 1, "profile": PROFILE, "role": "prefill"},
                         {"region": "us", "count": 1, "profile": PROFILE, "role": "decode"}],
            "pd": {"disaggregate": "always"},
            "workload": {"kind": "long-context", "rate": 0.2}, "limits": {"max_requests": 6},
            "policies": ["pd_decode"]}
    data.update(over)
    return parse_scenario(data)


def _run(sc):
    entry = sc.policy_list()[0]
    sim = Simulation(sc.setup(entry.topology), entry.preset, entry.params, sc.make_workload())
    return sim, sim.run()


def test_every_request_is_prefilled_on_the_prefill_engine_and_decoded_on_the_decode_engine():
    sim, res = _run(_scenario())
    assert res["requests"] == 6 and res["pd"]["split"] == 6
    p, d = sim.replicas["p-us-0"].engine, sim.replicas["d-us-0"].engine
    # the prefill engine computed every prompt; the decode engine computed one token of each
    assert p.prompt_tokens == d.prompt_tokens and p.prompt_tokens > 6 * 1000
    assert d.busy_s > 0 and p.busy_s > 0
    assert res["pd"]["transfer_share_of_ttft"]["mean"] > 0


def test_the_transfer_takes_bytes_over_the_link_plus_the_rtt():
    """One request on idle engines: TTFT = the legs' network hops + prefill + transfer + one
    decode-engine step; the transfer is tokens × KV bytes ÷ link + RTT (in region here)."""
    sc = _scenario(limits={"max_requests": 1}, network={"in_region_ms": 2})
    sim, res = _run(sc)
    prof = load_profile(PROFILE)
    prompt = sim.replicas["p-us-0"].engine.prompt_tokens
    expect = kv_transfer_s(prompt, prof.kv_bytes_per_token, 25.0, 0.002)
    assert res["pd"]["transfer_s"]["mean"] == pytest.approx(expect, abs=2e-6)
    slow = _run(_scenario(limits={"max_requests": 1}, network={"in_region_ms": 2},
                          pd={"link_gb_s": 2.5}))[1]
    assert slow["pd"]["transfer_s"]["mean"] == pytest.approx(kv_transfer_s(prompt, prof.kv_bytes_per_token, 2.5,
                                                                           0.002), abs=2e-6)
    assert slow["ttft_s"]["mean"] - res["ttft_s"]["mean"] == pytest.approx(
        slow["pd"]["transfer_s"]["mean"] - res["pd"]["transfer_s"]["mean"], rel=1e-3)


def test_a_cross_region_pair_pays_the_wan():
    near = _run(_scenario(limits={"max_requests": 2}))[1]
    far = _run(_scenario(limits={"max_requests": 2}, network={"rtt_ms": {"us-eu": 80}},
                         replicas=[{"region": "us", "count": 1, "profile": PROFILE, "role": "prefill"},
                                   {"region": "eu", "count": 1, "profile": PROFILE, "role": "decode"}],
                         workload={"kind": "long-context", "rate": 0.2, "clients": {"us": 1}},
                         topology={"kind": "global", "region": "us"}))[1]
    assert far["pd"]["transfer_s"]["mean"] > 10 * near["pd"]["transfer_s"]["mean"]


def test_decode_admission_waits_for_kv_memory():
    """A decode engine whose KV holds about one long prompt admits the next only when the first
    finished: its requests wait (queued) rather than fail."""
    sc = _scenario(workload={"kind": "long-context", "rate": 50.0}, limits={"max_requests": 20})
    setup = sc.setup()
    small = setup.replicas[1].profile.model_copy(update={"kv_blocks": 1000})  # 16K tokens: a few prompts
    setup.replicas[1].profile = small
    entry = sc.policy_list()[0]
    sim = Simulation(setup, entry.preset, entry.params, sc.make_workload())
    d = sim.replicas["d-us-0"].engine
    asked: dict[str, int] = {}
    peak = {"used": 0}
    inner = d.admission

    def watch(eng, seq, need):  # the engine's admission hook: each time the queue's head is considered
        asked[seq.rid] = asked.get(seq.rid, 0) + 1
        peak["used"] = max(peak["used"], eng.used)
        return inner is None or inner(eng, seq, need)
    d.admission = watch
    res = sim.run()
    assert res["requests"] + sum(res["failed"].values()) == 20
    assert set(res["failed"]) <= {"rejected"}  # prompts longer than the small cache
    assert inner is None and max(asked.values()) >= 2  # a request was asked again: it waited for memory, not failed
    assert peak["used"] <= d.capacity


def test_conditional_splits_only_long_uncached_prompts():
    sc = _scenario(pd={"disaggregate": {"pd_uncached_at_least": 20000}},
                   workload={"kind": "long-context", "rate": 1.0}, limits={"max_requests": 30})
    res = _run(sc)[1]
    assert 0 < res["pd"]["split"] < 30 and res["pd"]["split"] + res["pd"]["local"] == 30


def test_mixed_engines_take_both_sides():
    sc = _scenario(replicas=[{"region": "us", "count": 2, "profile": PROFILE, "role": "mixed"}],
                   workload={"kind": "chat-poisson", "rate": 5}, limits={"max_requests": 40})
    res = _run(sc)[1]
    assert res["requests"] == 40 and res["pd"]["split"] + res["pd"]["local"] == 40


@pytest.mark.parametrize("replicas, pd, fragment", [
    ([{"count": 2, "role": "prefill"}], {}, "no decode"),
    ([{"count": 1, "role": "decode"}, {"count": 1}], None, "needs a `pd:` section"),
    ([{"count": 1, "role": "decode"}], {}, "no prefill"),
    ([{"count": 1, "role": "decode"}, {"count": 1, "role": "prefill"}], {"disaggregate": {"pd_nope": 1}},
     "unknown condition"),
])
def test_a_one_sided_scenario_is_one_line_naming_its_line(tmp_path, replicas, pd, fragment):
    import yaml

    data = {"replicas": replicas, **({"pd": pd} if pd is not None else {})}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ScenarioError) as err:
        load_scenario(str(path))
    msg = str(err.value)
    assert "\n" not in msg and fragment in msg and f"{path}:" in msg, msg


@needs_trace  # the long workload is the Mooncake trace (a lone clone has no shared/ beside it)
def test_bench_pd_disaggregation_removes_decode_interference_on_long_prompts():
    """`kvroute bench pd`'s rows: at a high load of long prompts, splitting keeps prefills out of
    the decode batches (lower TPOT p99) and pays a transfer in TTFT; at a low load nobody misses."""
    from kvroute.bench.pd import WORKLOADS, layouts, markdown, run_one

    long = next(w for w in WORKLOADS if w.name == "long")
    rows = {lay.name: run_one(long, lay, 8.0, "h100-llama3.2-3b", 0, 300) for lay in layouts(512)}
    agg, dis = rows["aggregated"], rows["disaggregated"]
    assert dis["tpot_p99_ms"] < 0.7 * agg["tpot_p99_ms"], (agg, dis)
    assert dis["ttft_p50_s"] > agg["ttft_p50_s"] and 0 < dis["transfer_share"] < 0.5
    assert agg["transfer_share"] is None and dis["split_share"] == 1.0
    assert 0 < rows["conditional"]["split_share"] < 1
    table = markdown({"profile": "p", "seed": 0, "threshold": 512, "rows": list(rows.values()),
                      "workloads": [{"name": "long", "workload": long.spec, "requests": 300,
                                     "slo_ttft_s": long.slo_ttft_s, "slo_tpot_s": long.slo_tpot_s}]})
    assert table.count("| 8 |") == 4
