"""`kvroute reproduce`: every row filled, and the directions the model supports (never exact numbers)."""

import json

import pytest
from conftest import needs_trace

from kvroute.cli import main
from kvroute.reproduce import PAPERS, markdown, reproduce
from kvroute.reproduce.common import YES, Lab, ratio_agreement, similar
from kvroute.reproduce.lmetric import capacity
from kvroute.sim.scenario import SCENARIO_DIR


def test_agreement_rules():
    assert ratio_agreement([1.15], 1.12, 1.2) == YES
    assert ratio_agreement([1.02], 1.12, 1.2) == "direction only"
    assert ratio_agreement([0.9], 1.12, 1.2) == "no"
    assert ratio_agreement([0.5], 0.3, 0.6) == YES  # "lower" claims are ratios below 1
    assert similar(1.05) == YES and similar(1.3) == "no"


def _filled(result: dict) -> None:
    for r in result["rows"]:
        assert r["claim"] and r["paper"] and r["kvroute"] and r["agrees"]
        if r["agrees"] != YES:
            assert r["why_not"], r["claim"]


def test_cli_reproduce_writes_json_and_markdown(tmp_path):
    rc = main(["reproduce", "gorgo-v1", "--quick", "--json", str(tmp_path / "g.json"), "--md", str(tmp_path / "g.md")])
    assert rc == 0
    result = json.loads((tmp_path / "g.json").read_text())
    _filled(result)
    md = (tmp_path / "g.md").read_text()
    assert md.count("\n|") >= len(result["rows"]) + 1 and "reproduce/gorgo-v1" in md
    assert markdown(result) == md


def test_every_paper_has_a_scenario_file_a_user_can_rerun():
    scen = SCENARIO_DIR / "reproduce"
    for paper in PAPERS:
        if paper != "cascadeinfer":
            assert any(p.name.startswith(paper.split("-")[0]) for p in scen.glob("*.yaml")), paper


def test_pending_gate_beats_a_fixed_outstanding_limit_on_tail_ttft():
    """SkyWalker Fig. 9: SP-P's P90 TTFT is far below SP-O's; SP-P does not lose throughput to BP."""
    lab = Lab()
    r = lab.run("skywalker-fig9", requests=600)
    pick = lambda mode: next(v for k, v in r.items() if f"admission={mode}" in k)  # noqa: E731
    bp, spo, spp = pick("blind"), pick("outstanding"), pick("pending")
    assert spp["ttft_s"]["p90"] < 0.5 * spo["ttft_s"]["p90"]
    assert spp["throughput_rps"] >= 0.95 * bp["throughput_rps"]


@needs_trace
def test_lmetric_beats_vllm_jsq_mean_ttft_at_half_capacity():
    lab = Lab()
    lab.run("lmetric", key="lmetric-saturated", requests=1500,  # capacity() reuses this run
            overrides={"workload": {"time_scale": 0.02}, "policies": ["round_robin"]})
    cap, rate = capacity(lab)
    r = lab.run("lmetric", key="half", requests=1500,
                overrides={"workload": {"time_scale": rate / (0.5 * cap)}, "policies": ["vllm_jsq", "lmetric"]})
    assert r["lmetric"]["load"]["stable"] and r["vllm_jsq"]["load"]["stable"]
    assert r["lmetric"]["ttft_s"]["mean"] < r["vllm_jsq"]["ttft_s"]["mean"]


@needs_trace
def test_gorgo_without_queue_weight_sends_everything_to_the_nearest_replica():
    lab = Lab()
    r = lab.run("gorgo-v2", requests=400, overrides={  # App. D's setting, at the unsaturated rate
        "workload": {"time_scale": 3.0},
        "policies": [{"preset": "gorgo", "params": {"w_rtt": 0.276, "w_queue": 0.5}},
                     {"preset": "gorgo", "params": {"w_queue": 0.0}}]})
    hacked = r["gorgo(w_queue=0.0)"]
    assert hacked["by_path"]["local"]["requests"] == hacked["requests"]
    assert hacked["e2e_s"]["p95"] > r["gorgo(w_queue=0.5,w_rtt=0.276)"]["e2e_s"]["p95"]


@needs_trace
def test_gorgo_v2_windows_replay_at_the_papers_offered_rates():
    """The tuning window's time_scale (the scenario file's) and the held-out ones (computed) give the stand-in
    trace's windows the request rates of the paper's Apr 5 / 6 / 7 windows (Tables 2-4)."""
    from kvroute.reproduce.gorgo import PAPER_RPS, native_rps, paper_scale

    sc = Lab().scenario("gorgo-v2")
    n = sc.limits.max_requests
    assert native_rps(sc, 0, n) / sc.workload.time_scale == pytest.approx(PAPER_RPS[0], rel=0.01)
    assert PAPER_RPS[0] == pytest.approx(4.0, rel=0.01)  # 7,195 requests in 30 minutes
    for window in (1, 2):
        assert native_rps(sc, window, n) / paper_scale(sc, window, n) == pytest.approx(PAPER_RPS[window])


@needs_trace
def test_gorgo_v2_rows_are_filled_quickly():
    _filled(reproduce("gorgo-v2", quick=True))


def test_papers_are_named_by_title_in_what_users_see():
    """Reproduce tables and the preset listing name papers by title, never by seed file name."""
    import re

    from kvroute.policy.listing import describe_presets, presets_markdown
    from kvroute.reproduce import PAPERS

    seed_file = re.compile(r"\d{3}_[0-9a-f]{16}")
    for title, _ in PAPERS.values():
        assert ":" in title and not seed_file.search(title), title
    assert not seed_file.search(presets_markdown())
    assert not seed_file.search(str(describe_presets()))
