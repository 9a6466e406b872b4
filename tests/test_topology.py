"""Topologies: one global LB, region-local LBs, two-layer with forwarding; per-region shapes and
per-region / per-path results."""

import pytest

from kvroute.cli import main
from kvroute.sim.overload import topology_warnings
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import ScenarioError, parse_scenario
from kvroute.workload.synthetic import Conversation, ThoughtTree


def three_regions(**kw):
    base = {"network": {"rtt_ms": {"us-eu": 80, "us-asia": 150, "eu-asia": 200}},
            "replicas": [{"region": r, "count": 2, "profile": "h100-llama3.2-3b"} for r in ("us", "eu", "asia")],
            "workload": {"kind": "chat", "clients": {"us": 12, "eu": 6, "asia": 6}},
            "policies": ["round_robin"], "limits": {"max_requests": 300}, "seed": 5}
    base.update(kw)
    return parse_scenario(base)


def test_topologies_build_the_layouts_they_name():
    sc = three_regions(topology={"kind": "global", "region": "eu"})
    (lb,) = sc.setup().balancers
    assert lb.region == "eu" and len(lb.replicas) == 6
    regional = three_regions(topology={"kind": "regional"}).setup().balancers
    assert [b.region for b in regional] == ["us", "eu", "asia"] and not any(b.forward for b in regional)
    assert all(b.forward for b in three_regions(topology={"kind": "two-layer"}).setup().balancers)
    assert len(sc.setup("two-layer").balancers) == 3  # a policy's own topology wins


def test_global_lb_makes_remote_clients_pay_the_rtt():
    r = run_scenario(three_regions(topology={"kind": "global", "region": "us"}))[0].result
    by = r["by_client_region"]
    assert sum(g["requests"] for g in by.values()) == r["requests"]
    # asia → us LB → replica and back: at least the 150 ms round trip to the LB
    assert by["asia"]["ttft_s"]["p50"] >= 0.150
    assert by["us"]["ttft_s"]["p50"] < by["asia"]["ttft_s"]["p50"]
    assert set(r["by_path"]) <= {"local", "remote"} and r["by_path"]["remote"]["requests"] > 0


def test_two_layer_reports_forwarded_requests_apart():
    sc = three_regions(topology={"kind": "two-layer"}, policies=["skywalker"],
                       workload={"kind": "chat", "clients": {"us": 60, "eu": 2, "asia": 2}})
    r = run_scenario(sc)[0].result
    assert r["by_path"]["forwarded"]["requests"] == r["cross_region_forwards"] > 0
    assert sum(g["requests"] for g in r["by_path"].values()) == r["requests"]


def test_forwarding_that_can_never_trigger_is_warned_about():
    sc = three_regions(topology={"kind": "two-layer"},
                       policies=["round_robin", "skywalker", "auto",  # auto's forward gate may hold: no warning
                                 {"preset": "least_request", "topology": "global"}])
    lines = topology_warnings(sc)
    assert len(lines) == 1 and lines[0].startswith("round_robin:") and "never" in lines[0]


def test_per_region_shapes():
    sc = three_regions(workload={"kind": "chat", "clients": {"us": 2, "eu": 2},
                                 "shapes": {"us": {"kind": "tot", "depth": 2}}})
    wl = sc.make_workload()
    assert isinstance(wl.new_program("us", 0), ThoughtTree)
    assert isinstance(wl.new_program("eu", 0), Conversation)
    tree = wl.new_program("us", 1)
    assert len(tree.start()) == 1 and tree.depth == 2
    with pytest.raises(ScenarioError, match="shapes.mars"):
        three_regions(workload={"kind": "chat", "clients": {"us": 2},
                                "shapes": {"mars": {"kind": "tot"}}}).make_workload()


def test_bad_topology_input_is_one_line_and_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text("replicas: [{region: us}]\ntopology: {kind: mesh}\n")
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "topology" in err and "Traceback" not in err
    bad.write_text("replicas: [{region: us}]\npolicies: [{preset: round_robin, topology: star}]\n")
    assert main(["simulate", str(bad)]) == 2
    assert "global" in capsys.readouterr().err


def _gorgo_two_regions(clients, **workload):
    return parse_scenario({
        "network": {"rtt_ms": {"us-eu": 100}}, "seed": 3,
        "replicas": [{"region": r, "count": 1, "profile": "a100-mistral-7b"} for r in ("us", "eu")],
        "topology": {"kind": "two-layer"}, "workload": {"kind": "chat", "clients": clients, **workload},
        "policies": [{"preset": "gorgo", "params": {"w_rtt": 1.0, "t_p": 0.0938, "w_queue": 0.0938,
                                                    "queue": "prefill", "admission": "outstanding",
                                                    "max_outstanding": 2}}],
        "limits": {"max_requests": 120}})


def test_gorgo_distributed_serves_locally_and_forwards_only_when_the_region_is_full():
    """GORGO v1 §3.3: local first; a held request goes to a peer only when its cost is lower."""
    light = run_scenario(_gorgo_two_regions({"us": 2}))[0].result
    assert light["cross_region_forwards"] == 0 and set(light["by_path"]) == {"local"}
    heavy = run_scenario(_gorgo_two_regions({"us": 12}))[0].result
    assert heavy["cross_region_forwards"] > 0
    assert heavy["by_path"]["local"]["requests"] > 0 and heavy["by_path"]["forwarded"]["requests"] > 0


def test_one_load_generator_sends_every_request_from_its_region():
    """GORGO v1 §4.3: one GuideLLM through a geo-routing tunnel: eu's users enter at the eu balancer
    but their requests (and answers) travel from and to the generator in us."""
    sc = three_regions(topology={"kind": "regional"}, workload={"kind": "chat", "clients": {"us": 3, "eu": 3}})
    per_region = run_scenario(sc)[0].result["by_client_region"]
    sc = three_regions(topology={"kind": "regional"},
                       workload={"kind": "chat", "clients": {"us": 3, "eu": 3}, "load_generator": "us"})
    one = run_scenario(sc)[0].result["by_client_region"]
    assert per_region["eu"]["ttft_s"]["p50"] < 0.080 <= one["eu"]["ttft_s"]["p50"]  # the us-eu round trip
    with pytest.raises(ScenarioError, match="load_generator"):
        three_regions(workload={"kind": "chat", "load_generator": "mars"}).setup()
