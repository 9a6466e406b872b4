"""Overload made visible: pre-flight check, served vs offered, stable verdict, goodput, sweep."""

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.sim.overload import preflight, warnings
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.sweep import find_knee, scaled, sweep

MOONCAKE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake/conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not MOONCAKE.exists(), reason="shared/ traces are not beside this checkout")


def poisson(rate: float, n: int = 300, replicas: int = 4, **kw):
    base = {"replicas": [{"region": "us", "count": replicas, "profile": "h100-llama3.2-3b"}],
            "workload": {"kind": "chat-poisson", "rate": rate, "clients": {"us": 1}},
            "policies": ["round_robin"], "limits": {"max_requests": n}, "seed": 4}
    base.update(kw)
    return parse_scenario(base)


def test_light_load_is_stable_and_heavy_load_is_not():
    light = run_scenario(poisson(2.0))[0].result
    heavy = run_scenario(parse_scenario({
        "replicas": [{"region": "us", "count": 1, "profile": "l4-llama3.1-8b"}],
        "workload": {"kind": "chat-poisson", "rate": 20.0, "clients": {"us": 1}},
        "policies": ["round_robin"], "limits": {"max_requests": 300}}))[0].result
    assert light["load"]["stable"] and light["load"]["served_rps"] >= 0.9 * light["load"]["offered_rps"]
    assert not heavy["load"]["stable"]
    assert heavy["load"]["served_rps"] < 0.5 * heavy["load"]["offered_rps"]
    assert any("UNSTABLE" in line for line in warnings("rr", heavy))


def test_goodput_counts_requests_meeting_both_objectives():
    sc = poisson(2.0)
    r = run_scenario(sc)[0].result
    assert 0 < r["slo"]["goodput_rps"] <= r["throughput_rps"] + 1e-9
    strict = run_scenario(parse_scenario(sc.model_dump() | {"slo": {"ttft_s": 1e-6, "tpot_s": 1e-6}}))[0].result
    assert strict["slo"]["met"] == 0 and strict["slo"]["attainment"] == 0
    loose = run_scenario(parse_scenario(sc.model_dump() | {"slo": {"ttft_s": 1e6, "tpot_s": 1e6}}))[0].result
    assert loose["slo"]["attainment"] == pytest.approx(loose["requests"] / loose["issued"])


def test_closed_loop_says_it_is_stable_by_construction():
    sc = parse_scenario({"replicas": [{"region": "us", "count": 2}], "workload": {"kind": "chat", "clients": {"us": 8}},
                         "policies": ["round_robin"], "limits": {"max_requests": 100}})
    load = run_scenario(sc)[0].result["load"]
    assert load["closed_loop"] and load["stable"] and "closed loop" in load["verdict"]


@needs_trace
def test_preflight_counts_requests_that_never_fit_and_names_the_fix():
    sc = parse_scenario({"replicas": [{"region": "us", "count": 2, "profile": "l4-llama3.1-8b"}],
                         "workload": {"kind": "mooncake", "path": str(MOONCAKE)},
                         "limits": {"max_requests": 2000}})
    pf = preflight(sc)
    assert pf["never_fit"] > 0 and pf["load"] > 1
    assert 0 < pf["slo_ttft_unreachable"] < pf["requests"]  # long prompts outlast a 5 s TTFT on an L4
    text = " ".join(pf["messages"])
    assert "can never run" in text and "--time-scale" in text and "idle replica" in text
    roomy = parse_scenario(sc.model_dump() | {"replicas": [{"region": "us", "count": 16,
                                                            "profile": "h20-qwen3-30b-a3b"}],
                                              "workload": sc.model_dump()["workload"] | {"time_scale": 4.0},
                                              "slo": {"ttft_s": 60}})
    assert preflight(roomy)["messages"] == []


@needs_trace
def test_cli_overload_run_warns_with_reasons(capsys):
    rc = main(["simulate", "--workload", str(MOONCAKE), "--replicas", "2", "--time-scale", "1",
               "--max-requests", "600", "--policy", "round_robin"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "UNSTABLE" in err and "--time-scale" in err and "rejected" in err
    assert "rejected" in out and "NO" in out  # failures by reason and the verdict in the table


def test_scaling_moves_the_offered_load():
    sc = poisson(2.0)
    assert scaled(sc, 2.0).workload.rate == 4.0
    chat = parse_scenario({"workload": {"kind": "chat", "clients": {"us": 10}}, "replicas": [{"region": "us"}]})
    assert scaled(chat, 0.5).workload.clients == {"us": 5}


def test_sweep_finds_a_knee_and_compares_below_it(tmp_path):
    sc = poisson(5.0, n=200, replicas=2, policies=["round_robin", "least_request"])
    result = sweep(sc)
    for knee in result["knees"].values():
        assert knee["factor"] is not None
        at = [p for p in knee["points"] if p["factor"] == knee["factor"]][0]
        assert at["attainment"] >= sc.slo.target
        above = [p for p in knee["points"] if p["factor"] > knee["factor"]]
        if above:  # the search stopped because a higher load missed the target
            assert min(p["attainment"] for p in above) < sc.slo.target
    assert set(result["compare"]) == {"50%", "70%", "90%"}
    for row in result["compare"]["50%"].values():
        assert row["attainment"] >= sc.slo.target  # half the highest knee is below both knees here
    rc = main(["simulate", "--workload", "chat-poisson", "--rate", "5", "--replicas", "2", "--profile",
               "h100-llama3.2-3b", "--max-requests", "150", "--policy", "round_robin", "--sweep",
               "--json", str(tmp_path / "s.json"), "--plots", str(tmp_path)])
    assert rc == 0 and (tmp_path / "sweep_goodput.png").stat().st_size > 0
    assert json.loads((tmp_path / "s.json").read_text())["sweep"]["knees"]["round_robin"]["factor"]


def test_sweep_says_when_the_slo_cannot_be_met():
    sc = poisson(5.0, n=60, replicas=1, slo={"ttft_s": 1e-5, "tpot_s": 1e-5})
    knee = find_knee(sc, "round_robin", "round_robin", None, max_doublings=2)
    assert knee["factor"] is None and "relax" in knee["note"]
