"""`kvroute plan`: the cheapest deployment meeting an SLO, its front, bad input, and the same answer on any executor."""

import json
import os
import subprocess
import sys

import pytest

from kvroute.cli import main
from kvroute.parallel import Executor, PoolExecutor
from kvroute.plan.search import Planner, allocate, pareto, run_task, verdict
from kvroute.plan.spec import PlanSpec, check
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.simulation import Simulation
from tests.ray_head import LOOPBACK_ENV, ray_binary, ray_head

PLAN = """
name: tiny plan
workload: {kind: chat-poisson, rate: 6, clients: {us: 3, eu: 1}}
network: {rtt_ms: {us-eu: 80}}
regions: [us, eu]
requests: 200
seed: 3
hardware:
  - {profile: h100-llama3.2-3b, price_per_hour: 2.5}
  - {profile: l4-llama3.1-8b, price_per_hour: 0.8}
policies: [round_robin, least_request]
layouts: [even, by-clients]
max_replicas: 12
slo:
  ttft_s: {p90: 1.0}
  goodput: {ttft_s: 2, tpot_s: 0.1, share: 0.9}
"""


def write(tmp_path, text=PLAN, **extra):
    f = tmp_path / "plan.yaml"
    f.write_text(text + "".join(f"{k}: {v}\n" for k, v in extra.items()))
    return str(f)


def spec_of(path) -> PlanSpec:
    from kvroute.plan.spec import load_plan

    return load_plan(path)


def test_replicas_spread_evenly_or_by_clients():
    assert allocate("even", 5, ["us", "eu"], {"us": 3, "eu": 1}, 1) == {"us": 3, "eu": 2}
    assert allocate("by-clients", 6, ["us", "eu"], {"us": 3, "eu": 1}, 1) == {"us": 4, "eu": 2}
    assert allocate("by-clients", 2, ["us", "eu"], {"us": 3, "eu": 1}, 1) == {"us": 1, "eu": 1}
    assert sum(allocate("even", 11, ["a", "b", "c"], {}, 1).values()) == 11


def test_the_plan_finds_the_cheapest_passing_deployment_and_a_front(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = main(["plan", write(tmp_path), "--workers", "1", "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    a = json.loads(out.read_text())
    w = a["winner"]
    assert w["passes"] and w["stable"] and w["ttft_s"]["p90"] <= 1.0 and w["attainment"] >= 0.9
    passing = [p for p in a["points"] if p["passes"]]
    assert w["cost_per_hour"] == min(p["cost_per_hour"] for p in passing)
    for p in a["front"]:  # nothing passing is cheaper AND faster than a front point
        assert not any(q["cost_per_hour"] < p["cost_per_hour"] and q["ttft_s"]["p90"] < p["ttft_s"]["p90"]
                       for q in passing)
    for label, c in a["candidates"].items():  # each candidate's size: the next one down failed (or was never run)
        if c["min_replicas"]:
            below = [p for p in a["points"] if p["candidate"] == label and p["replicas"] == c["min_replicas"] - 1]
            assert all(not p["passes"] for p in below)
    assert all(not p["passes"] for p in a["points"] if not p["stable"])
    assert a["headroom"]["factor"] >= 1.0 and png.stat().st_size > 0
    assert "cheapest deployment meeting the SLO" in capsys.readouterr().out


def test_a_pool_plans_exactly_as_the_serial_search(tmp_path):
    spec = spec_of(write(tmp_path))
    serial = Planner(spec, Executor(1)).run()
    with PoolExecutor(2) as pool:
        pooled = Planner(spec, pool).run()
    assert json.dumps(serial, sort_keys=True) == json.dumps(pooled, sort_keys=True)


def test_the_pool_searches_ahead_without_changing_the_answer(tmp_path):
    """With two workers the search keeps both busy by running probes a later round may ask for: the
    answer and its run count stay the serial search's, and every run the answer counts was measured."""
    spec = spec_of(write(tmp_path))
    serial_planner = Planner(spec, Executor(1))
    serial = serial_planner.run()
    assert serial_planner.speculated == 0
    with PoolExecutor(2) as pool:
        planner = Planner(spec, pool)
        pooled = planner.run()
    assert pooled["runs"] == serial["runs"] == len(pooled["points"])
    assert planner.speculated > 0
    assert planner.speculative_unused <= planner.speculated


def test_bench_plan_refuses_a_busy_machine(capsys):
    """Another process spinning on a core: the speedup would measure the contention, so bench plan
    refuses to start (one line, exit 2)."""
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        assert main(["bench", "plan", "--requests", "50"]) == 2
    finally:
        spinner.kill()
        spinner.wait()
    err = capsys.readouterr().err
    assert "a speedup measured now means nothing" in err and "Traceback" not in err


def test_an_unknown_hardware_name_is_one_line_naming_the_allowed(tmp_path, capsys):
    rc = main(["plan", write(tmp_path, PLAN.replace("l4-llama3.1-8b", "b200-dreams"))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "b200-dreams" in err and "l4-llama3.1-8b" in err and "h100-llama3.2-3b" in err


def test_an_unmeetable_slo_is_exit_2_with_the_closest_configuration(tmp_path, capsys):
    rc = main(["plan", write(tmp_path, PLAN.replace("p90: 1.0", "p90: 0.001")), "--no-progress",
               "--workers", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(err) == 1
    err = err[0]
    assert "no configuration meets the SLO" in err and "closest:" in err and "TTFT p90" in err


def test_residency_keeps_pinned_clients_in_their_region(tmp_path):
    text = PLAN.replace("policies: [round_robin, least_request]", "policies: [{preset: round_robin, topology: global}]")
    spec = spec_of(write(tmp_path, text, residency="{eu: eu}"))
    planner = Planner(spec, Executor(1))
    data = planner.deployment(planner.candidates[0], 4)
    assert run_task((data, {"eu": "eu"}))["residency_violations"] == 0
    # the control: without the rule, the one global round robin sends EU clients' requests to the US
    sc = parse_scenario(data)
    sim = Simulation(sc.setup("global"), "round_robin", None, sc.make_workload())
    sim.run()
    rec = sim.recorder
    eu = rec.client_regions["eu"]
    assert any(c == eu and rec.replica_regions[r] == "us" for c, r in zip(rec.client, rec.replica))


def test_a_saturated_run_never_passes():
    spec = PlanSpec.model_validate({"hardware": [{"profile": "l4-llama3.1-8b", "price_per_hour": 1}],
                                    "slo": {"ttft_s": {"p90": 100.0}}})
    m = {"ttft_s": {"p90": 1.0}, "tpot_s": {}, "e2e_s": {}, "attainment": 1.0, "failed": 0, "issued": 10,
         "residency_violations": 0, "requests": 10, "stable": False, "offered_rps": 10.0, "served_rps": 4.0}
    ok, closeness, broke = verdict(spec, m)
    assert not ok and closeness > 1 and "saturated" in broke[0]
    assert verdict(spec, m | {"stable": True})[0]


def test_the_front_keeps_only_undominated_points():
    pts = [{"cost_per_hour": c, "ttft_s": {"p90": t}} for c, t in ((1, 5.0), (2, 3.0), (3, 4.0), (4, 1.0))]
    assert [p["cost_per_hour"] for p in pareto(pts, "ttft_s", "p90")] == [1, 2, 4]


def test_bad_plan_files_are_one_line(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert main(["plan", write(tmp_path, PLAN.replace("max_replicas: 12", "max_replicas: 12\ncolour: red"))]) == 2
    assert main(["plan", write(tmp_path, PLAN, residency="{eu: mars}")]) == 2
    # NaN passes every bound check and then compares false: a `.nan` SLO let any deployment "meet" it
    assert main(["plan", write(tmp_path, PLAN.replace("{p90: 1.0}", "{p90: .nan}"))]) == 2
    assert main(["plan", write(tmp_path, PLAN.replace("{p90: 1.0}", "{p90: -1}"))]) == 2
    assert main(["plan", write(tmp_path, PLAN.replace("price_per_hour: 0.8", "price_per_hour: .inf"))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 6 and "colour" in lines[1] and "mars" in lines[2]
    assert "plan.yaml:" in lines[3] and "slo.ttft_s.p90" in lines[3] and "finite" in lines[3]
    assert "slo.ttft_s.p90" in lines[4] and "greater than 0" in lines[4]
    assert "price_per_hour" in lines[5] and "finite" in lines[5]
    with pytest.raises(ValueError):
        check(PlanSpec.model_validate({"hardware": [{"profile": "l4-llama3.1-8b", "price_per_hour": 1}],
                                       "slo": {}}))


@pytest.mark.skipif(ray_binary() is None, reason="Ray is not installed (make test installs kvroute[ray])")
def test_plan_and_sweep_on_a_real_ray_head_equal_the_serial_runs(tmp_path):
    plan = write(tmp_path, PLAN.replace("layouts: [even, by-clients]", "layouts: [even]"))
    sweep = ["simulate", "--workload", "chat-poisson", "--rate", "5", "--replicas", "2", "--profile",
             "h100-llama3.2-3b", "--max-requests", "120", "--policy", "round_robin,least_request", "--sweep"]
    assert main(["plan", plan, "--workers", "1", "--no-progress", "--json", str(tmp_path / "serial.json")]) == 0
    assert main([*sweep, "--workers", "1", "--json", str(tmp_path / "sweep-serial.json")]) == 0
    with ray_head(cpus=2) as address:
        env = {**os.environ, **LOOPBACK_ENV}
        runs = [subprocess.run([sys.executable, "-m", "kvroute", *args, "--ray", address], env=env,
                               capture_output=True, text=True, timeout=300)
                for args in (["plan", plan, "--no-progress", "--json", str(tmp_path / "ray.json")],
                             [*sweep, "--json", str(tmp_path / "sweep-ray.json")])]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"Ray cluster {address} (2 CPUs)" in run.stderr
    serial, on_ray = (json.loads((tmp_path / f).read_text()) for f in ("serial.json", "ray.json"))
    for a in (serial, on_ray):
        a.pop("wall_s"), a.pop("executor")
    assert serial == on_ray and serial["winner"]
    assert (tmp_path / "sweep-ray.json").read_text() == (tmp_path / "sweep-serial.json").read_text()
