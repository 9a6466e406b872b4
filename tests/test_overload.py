"""Overload made visible: pre-flight check, served vs offered, stable verdict, goodput, sweep."""

import json

import pytest
from conftest import MOONCAKE, needs_trace

from kvroute.cli import main
from kvroute.sim.overload import preflight, warnings
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.sweep import find_knee, scaled, sweep


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
        slo = knee["slo"]
        assert slo["factor"] is not None
        at = [p for p in knee["points"] if p["factor"] == slo["factor"]][0]
        assert at["attainment"] >= sc.slo.target
        above = [p for p in knee["points"] if p["factor"] > slo["factor"]]
        if above:  # the search stopped because a higher load missed the target
            assert min(p["attainment"] for p in above) < sc.slo.target
        assert knee["stability"]["factor"] is not None and knee["stability"]["factor"] > 0
    assert result["reference"]["basis"] == "slo"
    assert set(result["compare"]) == {"50%", "70%", "90%"}
    for row in result["compare"]["50%"].values():
        assert row["attainment"] >= sc.slo.target  # half the highest knee is below both knees here
    rc = main(["simulate", "--workload", "chat-poisson", "--rate", "5", "--replicas", "2", "--profile",
               "h100-llama3.2-3b", "--max-requests", "150", "--policy", "round_robin", "--sweep",
               "--json", str(tmp_path / "s.json"), "--plots", str(tmp_path)])
    assert rc == 0 and (tmp_path / "sweep_goodput.png").stat().st_size > 0
    knee = json.loads((tmp_path / "s.json").read_text())["sweep"]["knees"]["round_robin"]
    assert knee["slo"]["factor"] and knee["stability"]["factor"]


def test_slo_knee_lies_at_or_below_the_stability_knee():
    """A long enough run on a slow replica with an attainable SLO: the backlog shows in TTFT
    before it outgrows the arrival window, so the SLO gives out first."""
    sc = parse_scenario({"replicas": [{"region": "us", "count": 1, "profile": "l4-llama3.1-8b"}],
                         "workload": {"kind": "chat-poisson", "rate": 1.0, "clients": {"us": 1}},
                         "policies": ["round_robin"], "limits": {"max_requests": 600}, "seed": 4})
    knee = find_knee(sc, "round_robin", "round_robin", None)
    slo, stab = knee["slo"]["factor"], knee["stability"]["factor"]
    assert slo is not None and stab is not None and 0 < slo <= stab
    by_f = {p["factor"]: p for p in knee["points"]}
    assert by_f[stab]["stable"]
    assert all(not p["stable"] for f, p in by_f.items() if f > stab * 1.5)  # well above it: unstable


def test_a_closed_loop_has_no_stability_knee():
    sc = parse_scenario({"replicas": [{"region": "us", "count": 1, "profile": "h100-llama3.2-3b"}],
                         "workload": {"kind": "chat", "clients": {"us": 2}}, "policies": ["round_robin"],
                         "limits": {"max_requests": 40}, "seed": 1})
    knee = find_knee(sc, "round_robin", "round_robin", None, bisect_steps=0, max_doublings=1)
    assert knee["stability"]["factor"] is None and "closed loop" in knee["stability"]["note"]


@needs_trace
def test_sweep_finds_a_stability_knee_when_the_slo_is_unattainable(tmp_path):
    """Issue 7's overload run: on two L4s most of the trace's prompts cannot prefill within the
    5 s TTFT objective even when idle, so no load has an SLO knee; the stability knee exists and
    the policies are compared below it."""
    out = tmp_path / "s.json"
    rc = main(["simulate", "--workload", str(MOONCAKE), "--replicas", "2", "--time-scale", "1",
               "--policy", "round_robin", "--max-requests", "600", "--sweep", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["sweep"]
    knee = result["knees"]["round_robin"]
    assert knee["slo"]["factor"] is None and "SLO unattainable" in knee["slo"]["note"]
    assert "idle replica" in knee["slo"]["note"]
    stab = knee["stability"]
    assert stab["factor"] is not None and stab["factor"] > 0 and stab["offered_rps"] > 0
    assert any(not p["stable"] for p in knee["points"] if p["factor"] > stab["factor"])
    assert result["reference"]["basis"] == "stability"
    assert result["slo_unmet"] and "at once" in result["slo_unmet"]  # the trace's bursts, named
    assert set(result["compare"]) == {"50%", "70%", "90%"}
    assert result["compare"]["50%"]["round_robin"]["stable"]


def test_sweep_says_when_the_slo_cannot_be_met():
    sc = poisson(5.0, n=60, replicas=1, slo={"ttft_s": 1e-5, "tpot_s": 1e-5})
    knee = find_knee(sc, "round_robin", "round_robin", None, max_doublings=2)
    assert knee["slo"]["factor"] is None and "relax" in knee["slo"]["note"]
