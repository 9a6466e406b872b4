"""The adaptive presets inside bounded simulations: GORGO v2's reward-hacking failure and the
range that prevents it, the predicted-TTFT policy's accuracy with a matched vs a mismatched
profile (LMetric Figs. 15-16), and LMetric's hotspot detector acting and staying silent."""

from __future__ import annotations

from collections import Counter

from kvroute.reproduce.lmetric import HotspotWorkload
from kvroute.sim.runner import PolicyRun, run_scenario
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.simulation import Simulation


def _top_share(run: PolicyRun) -> float:
    counts = Counter(run.recorder.replica)
    return max(counts.values()) / sum(counts.values())


def _runs(policies: list, **scenario) -> dict[str, PolicyRun]:
    sc = parse_scenario({"name": "t", "seed": 1, "policies": policies, **scenario}, "test")
    return {r.label: r for r in run_scenario(sc)}


# GORGO v2's setup in miniature: one proxy next to one replica, two replicas far away
CROSS_REGION = {
    "network": {"rtt_ms": {"near-far1": 300, "near-far2": 400, "far1-far2": 300}, "in_region_ms": 2},
    "replicas": [{"region": r, "count": 1, "profile": "a100-mistral-7b"} for r in ("near", "far1", "far2")],
    "topology": {"kind": "global", "region": "near", "probe_interval_s": 1},
    "workload": {"kind": "chat-poisson", "rate": 2, "clients": {"near": 1}},
    "limits": {"max_requests": 2000},
}


def test_reward_hacking_without_the_queue_term_and_the_default_range_prevents_it():
    """GORGO v2 App. D: rewarded on TTFT alone, dropping the queue term sends everything to the
    nearest replica — the best TTFT, the worst E2E. The default range (w_queue ≥ 0.05) keeps
    the tuner out of it."""
    runs = _runs([{"preset": "gorgo_tuned"}, {"preset": "gorgo", "params": {"w_queue": 0.001}}], **CROSS_REGION)
    tuned, hacked = runs["gorgo_tuned"], runs["gorgo(w_queue=0.001)"]
    t, h = tuned.result, hacked.result
    state = t["policy_state"]
    assert state["es.proposed"] >= 10 and state["es.converged"] == 1.0
    assert state["es.parent_w_queue"] >= 0.05 and state["es.w_queue"] >= 0.05
    assert _top_share(hacked) > 0.95  # all traffic to the nearest replica
    assert h["ttft_s"]["p95"] < t["ttft_s"]["p95"]  # the reward it hacks: a better TTFT tail
    assert h["e2e_s"]["p95"] > 3 * t["e2e_s"]["p95"]  # E2E collapses
    assert _top_share(tuned) < 0.6


def test_the_tuner_uses_a_range_that_lets_w_queue_fall_to_zero():
    """With w_queue's floor at 0.001 the ES drives it below the default floor (here on H20s,
    where the nearest replica absorbs more load before TTFT suffers). Judged per hop: on the
    paper's rolling window this short run's search accepts too little to get there."""
    wide = {**CROSS_REGION,
            "replicas": [{"region": r, "count": 1, "profile": "h20-qwen3-30b-a3b"} for r in ("near", "far1", "far2")]}
    runs = _runs([{"preset": "gorgo_tuned", "params": {"w_queue_range": [0.001, 0.5], "judge": "hop"}}],
                 **wide)
    state = next(iter(runs.values())).result["policy_state"]
    assert state["es.parent_w_queue"] < 0.05


def test_tuner_is_deterministic_under_the_scenario_seed():
    small = {**CROSS_REGION, "limits": {"max_requests": 600}}
    a = _runs([{"preset": "gorgo_tuned"}], **small)["gorgo_tuned"].result["policy_state"]
    b = _runs([{"preset": "gorgo_tuned"}], **small)["gorgo_tuned"].result["policy_state"]
    assert a == b and a["es.proposed"] >= 10


def test_a_mismatched_profile_predicts_ttft_worse():
    """LMetric Figs. 15-16: a simulator tuned for other hardware mispredicts TTFT."""
    runs = _runs([{"preset": "llm_d"}, {"preset": "llm_d", "params": {"profile": "l4-llama3.1-8b"}}],
                 replicas=[{"region": "us", "count": 4, "profile": "h20-qwen3-30b-a3b"}],
                 workload={"kind": "chat-poisson", "rate": 8}, limits={"max_requests": 1500})
    tuned = runs["llm_d"].result["policy_state"]
    untuned = runs["llm_d(profile=l4-llama3.1-8b)"].result["policy_state"]
    assert tuned["predictor.scored"] == untuned["predictor.scored"] == 1500
    assert tuned["predictor.mean_abs_rel_error"] < 0.3
    assert untuned["predictor.mean_abs_rel_error"] > 3 * tuned["predictor.mean_abs_rel_error"]
    assert untuned["predictor.share_over_20pct"] > tuned["predictor.share_over_20pct"]


def _hotspot_run(params: dict, hot: float) -> tuple[Simulation, dict]:
    sc = parse_scenario({"name": "hot", "seed": 1, "policies": ["lmetric"],
                         "replicas": [{"region": "us", "count": 16, "profile": "h20-qwen3-30b-a3b"}]}, "test")
    sim = Simulation(sc.setup(None), "lmetric", params, HotspotWorkload(5.0, 3000, hot=hot, seed=1))
    return sim, sim.run()


def test_hotspot_detector_spreads_a_hot_prefix():
    plain_sim, plain = _hotspot_run({}, hot=0.7)
    sim, res = _hotspot_run({"hotspot": True}, hot=0.7)
    state = res["policy_state"]
    assert state["hotspot.filter_events"] >= 1 and res["branches"].get("hotspot-filtered", 0) >= 1

    def share(s: Simulation) -> float:
        c = Counter(s.recorder.replica)
        return max(c.values()) / sum(c.values())

    assert share(sim) < share(plain_sim)


def test_hotspot_detector_is_silent_without_a_hot_class():
    _, res = _hotspot_run({"hotspot": True}, hot=0.0)
    assert res["policy_state"]["hotspot.phase1_requests"] == 0.0
    assert "hotspot-filtered" not in res["branches"]


def test_balancers_keep_rtt_as_an_ewma_of_probe_round_trips():
    """Like the gateway: each probe's round trip (the network's RTT ± jitter) enters an EWMA."""
    from kvroute.perf.network import Network

    sc = parse_scenario({"name": "rtt", "seed": 1, "policies": ["gorgo"], **CROSS_REGION,
                         "limits": {"max_requests": 200}}, "test")
    setup = sc.setup(None)
    setup.network = Network({("near", "far1"): 300.0, ("near", "far2"): 400.0, ("far1", "far2"): 300.0},
                            in_region_ms=2.0, jitter=0.2, seed=3)
    sim = Simulation(setup, "gorgo", None, sc.make_workload())
    sim.run()
    rtts = {ep.id: ep.rtt_s for ep in sim.lbs[0].router.endpoints}
    far = [v for k, v in rtts.items() if "far1" in k]
    assert far and 0.24 <= far[0] <= 0.36 and far[0] != 0.3  # smoothed samples of 0.3 s ± 20 %
    assert Network(jitter=0.0).probe_rtt("us", "eu") == 0.08


def test_calibration_recovers_the_replicas_prefill_regression():
    """GORGO v1 §4.2's TTFT = 150.72 ms + 0.0938 ms/token is what the A100 profile is fitted to;
    fitted online from first tokens on lightly loaded replicas, the regression comes back."""
    runs = _runs([{"preset": "gorgo", "params": {"calibrate": True, "w_rtt": 1.0, "t_p": 0.094, "w_queue": 0.094}}],
                 replicas=[{"region": "us", "count": 2, "profile": "a100-mistral-7b"}],
                 workload={"kind": "chat-poisson", "rate": 0.5}, limits={"max_requests": 300})
    st = next(iter(runs.values())).result["policy_state"]
    fitted = [k for k in st if k.endswith("ms_per_uncached_token")]
    assert len(fitted) == 2
    for k in fitted:
        replica = k.rsplit(".", 1)[0]
        assert st[f"{replica}.samples"] >= 8
        assert abs(st[k] - 0.0938) / 0.0938 < 0.2
        assert abs(st[f"{replica}.intercept_ms"] - 150.72) / 150.72 < 0.2


def test_llm_d_predicts_on_the_replicas_own_profile():
    """Unset, the predictor follows each replica's profile (issue 21): on A100 replicas it predicts
    as well as on H20s, where naming the H20 profile mispredicts."""
    runs = _runs([{"preset": "llm_d"}, {"preset": "llm_d", "params": {"profile": "h20-qwen3-30b-a3b"}}],
                 replicas=[{"region": "us", "count": 4, "profile": "a100-mistral-7b"}],
                 workload={"kind": "chat-poisson", "rate": 4}, limits={"max_requests": 800})
    own = runs["llm_d"].result["policy_state"]
    named = runs["llm_d(profile=h20-qwen3-30b-a3b)"].result["policy_state"]
    assert own["predictor.mean_abs_rel_error"] < 0.3
    assert named["predictor.mean_abs_rel_error"] > 2 * own["predictor.mean_abs_rel_error"]
