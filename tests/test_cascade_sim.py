"""CascadeInfer in the simulator: engine migration, stage routing, whole runs, the reproduction."""

from __future__ import annotations

import json

import pytest

from kvroute.errors import ConfigError
from kvroute.model import Endpoint, Request
from kvroute.perf.loader import load_profile
from kvroute.policy.presets.cascadeinfer import stage_filter
from kvroute.policy.registry import build_policy, policy_from_config
from kvroute.policy.router import Router
from kvroute.reproduce import common as reproduce_common
from kvroute.reproduce import reproduce
from kvroute.reproduce.common import DIRECTION, NO, YES
from kvroute.sim.engine import DECODE, DONE, Engine, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.qoe_profiling import fit_profile
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import ScenarioError, parse_scenario
from kvroute.sim.simulation import Simulation
from kvroute.workload.long_context import MAX_CONTEXT, LongContext

PROFILE = load_profile("h100-llama3.2-3b")


def two_engines():
    loop = EventLoop()
    done: list[tuple[str, str, float]] = []
    engines = {}
    for name in ("a", "b"):
        engines[name] = Engine(name, PROFILE, loop, lambda s, t: None,
                               lambda s, t, name=name: done.append((name, s.rid, t)))
    return loop, engines["a"], engines["b"], done


def test_a_sequence_departs_at_a_step_boundary_and_finishes_once_on_its_target():
    loop, a, b, done = two_engines()
    seq = Seq("r1", 1000, 300, (), 16)
    a.submit(seq)
    moved: list[int] = []

    def move(_):
        ctx = a.context(seq)
        assert ctx > 1000 and seq.state == DECODE

        def arrived(s: Seq, now_ctx: int) -> None:
            moved.append(now_ctx)
            b.adopt(s, now_ctx)

        a.depart(seq, arrived)

    loop.at(0.3, move)
    loop.run()
    assert done == [("b", "r1", pytest.approx(done[0][2]))] and seq.state == DONE
    assert moved and moved[0] > 1000
    assert a.used == 0 and b.used == 0 and not a.decoding and not b.decoding
    # 300 tokens in all: the same finish as without the move (departure and adoption at one
    # instant here), give or take the step the move waited for
    loop2, plain, _, done2 = two_engines()
    plain.submit(Seq("r1", 1000, 300, (), 16))
    loop2.run()
    step = PROFILE.step_time(decode=1, decode_ctx=1300)
    assert abs(done[0][2] - done2[0][2]) < 2 * step


def test_a_context_limit_stops_the_jump_where_a_sequence_passes_it():
    loop, a, _, _ = two_engines()
    a.limit = 1100
    seen: list[tuple[int, float]] = []
    a.on_limit = lambda eng, seqs: seen.extend((eng.context(s), loop.now) for s in seqs)
    a.submit(Seq("r1", 1000, 500, (), 16))
    loop.run()
    assert len(seen) == 1 and seen[0][0] == 1101  # flagged at the step that passed the limit, once


def test_reservations_hold_memory_until_released():
    _, a, _, _ = two_engines()
    free = a.free_tokens()
    a.reserve(5000)
    assert a.free_tokens() == free - 5000 and a.kv_usage(0.0) > 0
    a.reserve(-5000)
    assert a.free_tokens() == free


def stage_router(**params) -> Router:
    policy = build_policy("cascadeinfer", {"stage_sizes": [2, 1, 1], "bounds": [1000, 8000], **params})
    return Router(policy, [Endpoint(f"e{i}", kv_blocks=1000) for i in range(4)])


def test_length_stage_routes_to_the_earliest_covering_stage_and_exposes_limits():
    r = stage_router()
    targets = {n: r.route(Request(id=f"q{n}", prompt_tokens=n)).target for n in (10, 999, 1000, 9000)}
    assert targets[10] in ("e0", "e1") and targets[999] in ("e0", "e1")
    assert targets[1000] == "e2" and targets[9000] == "e3"
    assert [r.policy.context_limit(f"e{i}") for i in range(4)] == [1000, 1000, 8000, None]
    assert build_policy("least_load").context_limit("e0") is None


def test_length_stage_falls_to_a_later_stage_when_its_own_has_no_candidate():
    r = stage_router()
    r.endpoints[2].healthy = False
    assert r.policy.decide(Request(id="q", prompt_tokens=2000), r.view).target == "e3"
    r.endpoints[3].healthy = False
    assert r.policy.decide(Request(id="q2", prompt_tokens=9000), r.view).target in ("e0", "e1")


def test_length_stage_plans_again_when_replicas_are_added_or_removed():
    """A replica added at run time joins the plan (stage_sizes fill in configuration order,
    extras join the last stage) when the next dispatch is committed; a removed one leaves it — no
    re-plan while the set is the same."""
    r = stage_router()
    assert r.route(Request(id="q", prompt_tokens=9000)).target == "e3"
    r.add_endpoint(Endpoint("e4", kv_blocks=1000))
    r.endpoints[3].inflight = 5  # e3 busy: the longest stage now has e4 as well
    assert r.route(Request(id="q2", prompt_tokens=9000)).target == "e4"
    assert r.policy.context_limit("e4") is None
    r.remove_endpoint("e0")  # the stages shift: e1, e2 | e3 | e4
    assert r.route(Request(id="q3", prompt_tokens=10)).target in ("e1", "e2")
    assert [r.policy.context_limit(e) for e in ("e1", "e2", "e3", "e4")] == [1000, 1000, 8000, None]
    stages = stage_filter(r.policy)
    assert stages is not None and stages.stages == [["e1", "e2"], ["e3"], ["e4"]]
    stages.set_plan([["e1"], ["e2", "e3", "e4"]], [500])  # a runtime's own plan is kept as it is
    r.add_endpoint(Endpoint("e5", kv_blocks=1000))
    r.route(Request(id="q4", prompt_tokens=10))
    assert stages.stages == [["e1"], ["e2", "e3", "e4"]] and stages.stage("e5") is None


def test_length_stage_composes_with_any_rules():
    policy = policy_from_config({"filters": [{"length_stage": {"stage_sizes": [2, 2], "bounds": [4096]}}],
                                 "cost": {"lmetric": 1}})
    r = Router(policy, [Endpoint(f"e{i}", kv_blocks=1000) for i in range(4)])
    assert r.route(Request(id="long", prompt_tokens=5000)).target in ("e2", "e3")
    assert r.route(Request(id="short", prompt_tokens=50)).target in ("e0", "e1")
    assert policy.context_limit("e1") == 4096 and policy.context_limit("e2") is None


def test_round_robin_within_a_stage():
    r = stage_router(within="round_robin")
    got = [r.route(Request(id=f"q{i}", prompt_tokens=10)) for i in range(4)]
    assert {d.target for d in got} == {"e0", "e1"} and all(d.branch == "rr" for d in got)


@pytest.mark.parametrize("params, match", [
    ({"stage_sizes": [2, 2], "bounds": []}, "bounds needs 1"),
    ({"bounds": [100]}, "bounds without stage_sizes"),
    ({"stage_sizes": [1, 1, 1], "bounds": [500, 100]}, "strictly increasing"),
    ({"bidask": "full"}, "bidask"),  # a simulator setting, not a policy parameter (a gateway never migrates)
])
def test_bad_cascade_params_name_the_problem(params, match):
    with pytest.raises(ConfigError, match=match):
        build_policy("cascadeinfer", params)


def test_simulator_settings_live_outside_the_policy_and_old_files_keep_working():
    new = scenario([{"preset": "cascadeinfer", "simulator": {"layout": "dp"}}]).policy_list()
    old = scenario([{"preset": "cascadeinfer", "params": {"layout": "dp"}}]).policy_list()
    assert [e.label for e in new] == [e.label for e in old] == ["cascadeinfer(layout=dp)"]
    with pytest.raises(ScenarioError, match=r"policies\[0\]\.simulator\.bidask"):
        scenario([{"preset": "cascadeinfer", "simulator": {"bidask": "maybe"}}]).policy_list()
    with pytest.raises(ScenarioError, match=r"simulator\.stages"):
        scenario([{"preset": "cascadeinfer", "simulator": {"stages": [6, 4]}}]).policy_list()


def scenario(policies, rate=20.0, requests=300, replicas=4):
    return parse_scenario({
        "name": "cascade test", "seed": 3,
        "replicas": [{"region": "local", "count": replicas, "profile": "h100-llama3.2-3b"}],
        "topology": {"kind": "global", "region": "local"},
        "workload": {"kind": "long-context", "rate": rate, "clients": {"local": 1}},
        "policies": policies, "limits": {"max_requests": requests}}, "test")


def test_cascadeinfer_run_plans_migrates_and_completes_every_request():
    runs = {r.label: r.result for r in run_scenario(scenario(["cascadeinfer", "llumnix", "round_robin"]))}
    casc, llum, rr = runs["cascadeinfer"], runs["llumnix"], runs["round_robin"]
    for res in (casc, llum, rr):
        assert res["requests"] == 300 and not res["failed"]
    mig = casc["migration"]
    assert len(mig["stages"]) >= 2 and sum(len(s) for s in mig["stages"]) == 4
    assert mig["handovers"] > 0 and mig["migrations"] > 0
    assert mig["bounds"] == sorted(mig["bounds"])
    assert sum(mig["out_tokens"].values()) == pytest.approx(casc["output_tps"] * casc["makespan_s"], rel=0.01)
    assert llum["migration"]["migrations"] >= 0 and "stages" not in llum["migration"]
    assert "migration" not in rr


def test_llumnix_in_its_default_configuration_dispatches_only():
    """Llumnix's own default configuration has migration off (llumnix/config/default.py,
    ENABLE_MIGRATION = False), as CascadeInfer §6.1 runs it: simulator.migrate false builds no migrator."""
    sc = scenario([{"preset": "llumnix", "simulator": {"migrate": False}}, "llumnix"], rate=40.0, requests=300)
    runs = {r.label: r.result for r in run_scenario(sc)}
    plain, migrating = runs["llumnix(migrate=False)"], runs["llumnix"]
    assert plain["requests"] == migrating["requests"] == 300 and not plain["failed"]
    assert "migration" not in plain
    assert migrating["migration"]["rebalances"] > 0  # kvroute's memory balancing, when asked for
    sim = Simulation(sc.setup(), "llumnix", {"migrate": False}, sc.make_workload())
    assert sim.migrator is None


def test_fixed_seed_runs_are_identical_and_other_presets_build_no_migrator():
    sc = scenario([{"preset": "cascadeinfer", "params": {"layout": "dp", "refinement": "equal_memory"}}],
                  requests=150)
    a = [json.dumps(r.result, sort_keys=True) for r in run_scenario(sc)]
    b = [json.dumps(r.result, sort_keys=True) for r in run_scenario(sc)]
    assert a == b
    sc2 = scenario(["least_load"], requests=10)
    sim = Simulation(sc2.setup(), "least_load", None, sc2.make_workload())
    assert sim.migrator is None and all(r.engine.limit is None for r in sim.replicas.values())


def test_no_pipeline_layout_is_one_stage_without_hand_overs():
    res = run_scenario(scenario([{"preset": "cascadeinfer", "params": {"layout": "no_pipeline"}}], requests=150))
    mig = res[0].result["migration"]
    assert mig["stages"] == [[f"local-{i}" for i in range(4)]] and mig["handovers"] == 0


def test_qoe_fit_beats_the_static_mean_predictor():
    fit = fit_profile(PROFILE)
    assert fit.fit_requests > 500 and fit.validation_requests > 500
    assert 0 < fit.model_error < fit.static_error
    assert all(d == d for d in fit.model.d)  # finite coefficients


def test_long_context_lengths_stay_within_128k_and_the_sample_leaves_arrivals_alone():
    wl = LongContext(10.0, ["local"], seed=4, max_requests=500)
    first = [(s.req.prompt_tokens, s.output_tokens, s.req.arrival_s) for s in wl.arrivals()]
    sample = wl.length_sample(2000)
    again = [(s.req.prompt_tokens, s.output_tokens, s.req.arrival_s) for s in wl.arrivals()]
    assert first == again and len(first) == 500
    assert all(16 <= p and 1 <= o <= 4096 and p + o <= MAX_CONTEXT for p, o in sample)
    prompts = sorted(p for p, _ in sample)
    assert prompts[len(prompts) // 2] < 3000 and prompts[-20] > 30_000  # skewed: short body, long tail


def test_reproduce_cascadeinfer_fills_every_row(monkeypatch):
    """Every row of `kvroute reproduce cascadeinfer` filled, at the floor of --quick's size (300
    requests per run instead of 1,200: the rows are made and judged the same way, and this was the
    suite's slowest test, 52-89 s busy); the numbers at full size are the README's table."""
    monkeypatch.setattr(reproduce_common, "QUICK_FRACTION", 0.0)  # each run at QUICK_MIN_REQUESTS
    result = reproduce("cascadeinfer", quick=True)
    assert {m["requests"] for m in result["runs"].values()} == {reproduce_common.QUICK_MIN_REQUESTS}
    rows = {r["claim"]: r for r in result["rows"]}
    assert len(rows) == 9  # QoE, partition time, heuristic vs DP, chain, refinement, layouts, RR, Llumnix, bid-ask
    for r in result["rows"]:
        assert r["kvroute"] and r["agrees"]
        assert r["agrees"] == YES or r["why_not"], r["claim"]
    assert rows["stage partition with 16 instances, 128K length"]["agrees"] == YES
    assert "static mean predictor" in rows["QoE model mean relative error (held-back runs)"]["kvroute"]


def test_periodic_replanning_within_the_envelope_reports_every_plan():
    """§4.2: planning at initialization and periodically from the period's statistics; §6.1's
    envelope (4-6 stages of 1-4 instances) holds for every plan; each plan's shape is reported."""
    sc = parse_scenario({
        "name": "replan", "seed": 3,
        "replicas": [{"region": "local", "count": 16, "profile": "h100-llama3.2-3b"}],
        "topology": {"kind": "global", "region": "local"},
        "workload": {"kind": "long-context", "rate": 30, "clients": {"local": 1}},
        "simulator": {"max_stage_instances": 4, "stages": [4, 6], "replan_interval_s": 10},
        "policies": ["cascadeinfer", "round_robin"], "limits": {"max_requests": 900}}, "test")
    runs = {r.label: r.result for r in run_scenario(sc)}
    assert set(runs) == {"cascadeinfer", "round_robin"}  # scenario-wide settings stay out of the labels
    mig = runs["cascadeinfer"]["migration"]
    plans = mig["plans"]
    assert len(plans) >= 2 and plans[0]["at_s"] == 0 and "Little's law" in plans[0]["planned_on"]
    assert all("observed" in p["planned_on"] for p in plans[1:])
    for p in plans:
        assert 4 <= len(p["sizes"]) <= 6 and max(p["sizes"]) <= 4 and sum(p["sizes"]) == 16
    assert [len(s) for s in mig["stages"]] == plans[-1]["sizes"] and not runs["cascadeinfer"]["failed"]


def test_the_bid_ask_reason_matches_its_verdict():
    """A *no* must not say the round-robin ordering holds (the direction-only reason did, for either verdict)."""
    from kvroute.reproduce.cascadeinfer import _bidask_why

    assert "round-robin ordering holds" in _bidask_why(DIRECTION)
    assert "ordering holds" not in _bidask_why(NO) and "above round robin" in _bidask_why(NO)
