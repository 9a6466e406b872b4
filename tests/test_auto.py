"""`auto`, the default policy: which mechanism is in charge, from what a live gateway observes, and it says so."""

import hashlib

import httpx

from kvroute.cli import main
from kvroute.gateway.config import GatewayConfig
from kvroute.model import DecisionKind
from kvroute.policy.presets.auto import ADDITIVE, LEAST_WORK, PREFIX_LOAD, RTT_AWARE
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import Scenario, parse_scenario
from tests.conftest import make_request
from tests.fake_upstream import FaultyDeployment, http_response, replies


def test_auto_is_the_default_of_the_gateway_and_the_simulator():
    assert GatewayConfig.model_fields["policy"].default == "auto"
    assert Scenario().policies == ["auto"]
    assert [p.label for p in Scenario().policy_list()] == ["auto"]


def test_one_region_routes_by_least_work_and_regions_apart_by_the_rtt_aware_cost(router_for):
    near = router_for("auto", 3)
    d = near.route(make_request("a", "hello " * 50))
    assert d.kind == DecisionKind.DISPATCH and d.branch == LEAST_WORK  # one region, one hardware kind
    trials = router_for("auto", 3, params={"least_work": False})
    assert trials.route(make_request("a", "hello " * 50)).branch == ADDITIVE  # the selector measures this rule first
    plain = router_for("auto", 3, params={"least_work": False, "select": False})
    assert plain.route(make_request("a", "hello " * 50)).branch == PREFIX_LOAD
    far = router_for("auto", 3, params={"local_first": False})
    for i, e in enumerate(far.view.endpoints):
        e.rtt_s = 0.002 + 0.08 * i  # one replica nearby, two across an ocean (measured probe RTTs)
    d = far.route(make_request("b", "hello " * 50))
    assert d.branch == RTT_AWARE and d.target == "e0"  # idle everywhere: the network decides


def test_across_regions_auto_serves_from_the_nearest_free_replica_and_spills_when_none_is(router_for):
    r = router_for("auto", 4)
    for i, e in enumerate(r.view.endpoints):
        e.rtt_s = 0.002 if i < 2 else 0.15  # two replicas nearby, two across an ocean (probe RTTs)
    first = r.route(make_request("a", "alpha " * 400))
    assert first.target in ("e0", "e1") and first.branch == ADDITIVE  # only nearby candidates: one region
    second = r.route(make_request("b", "bravo " * 400))
    assert {first.target, second.target} == {"e0", "e1"}  # the first one's prefill is still queued
    third = r.route(make_request("c", "charlie " * 400))
    assert third.target in ("e2", "e3") and third.branch == RTT_AWARE  # no nearby replica free: all compete
    r.on_first_token("a", 0.5)
    assert r.route(make_request("d", "delta " * 400)).target == first.target  # free again


def test_the_simulation_report_says_which_mechanism_was_in_charge():
    common = {"replicas": [{"region": r, "count": 2, "profile": "l4-llama3.1-8b"} for r in ("us", "eu")],
              "network": {"rtt_ms": {"us-eu": 90}}, "workload": {"kind": "chat", "clients": {"us": 12, "eu": 4}},
              "limits": {"max_requests": 200}, "seed": 2}
    regional = run_scenario(parse_scenario(common))[0].result  # no policy named: auto, one LB per region
    central = run_scenario(parse_scenario({**common, "topology": {"kind": "global", "region": "us"}}))[0].result
    assert set(regional["branches"]) == {LEAST_WORK}  # each LB sees one region of one hardware kind
    assert central["branches"].get(RTT_AWARE, 0) > 0  # one LB seeing both regions weighs the 90 ms


def test_simulate_without_a_policy_runs_auto(tmp_path):
    out = tmp_path / "r.json"
    assert main(["simulate", "--workload", "chat-poisson", "--rate", "3", "--replicas", "2", "--max-requests", "60",
                 "--json", str(out)]) == 0
    import json

    assert list(json.loads(out.read_text())["results"]) == ["auto"]


def test_the_gateway_explains_auto_in_the_admin_api_and_metrics(monkeypatch):
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_KEY", "sk-admin-auto")
    keys = [{"name": "ops", "env": "KVROUTE_TEST_ADMIN_KEY", "admin": True},
            {"name": "user", "sha256": hashlib.sha256(b"sk-user-auto").hexdigest()}]
    good = replies(http_response())
    # two loopback replicas are one region; their probed RTTs can still differ by more than the default
    # 10 ms on a loaded machine (seen in a full-suite run under contention), so the threshold is raised
    dep = FaultyDeployment([good, good], policy={"preset": "auto", "params": {"rtt_spread_ms": 1000}},
                           auth={"keys": keys})
    try:
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                       headers={"Authorization": "Bearer sk-user-auto"})
        assert r.status_code == 200
        info = httpx.get(f"{dep.url}/admin/policy", headers={"Authorization": "Bearer sk-admin-auto"}).json()
        assert info["name"] == "auto" and info["in_charge"] == LEAST_WORK and info["branches"] == {LEAST_WORK: 1}
        # one region of one hardware kind: the least prefill work among the replicas LMetric ranks near its best
        assert info["state"]["uniform_fleet.mixed"] == 0.0
        assert info["state"]["lmetric_speed.mixed"] == 0.0  # replica speed: one observation, no factor yet
        text = httpx.get(f"{dep.url}/metrics").text
        assert 'kvroute_policy_state{key="lmetric_speed.mixed"} 0.0' in text
        assert f'kvroute_policy_branch_total{{branch="{LEAST_WORK}",policy="auto"}} 1.0' in text
        assert dep.settle() == (0, 0, 0)
    finally:
        dep.close()
