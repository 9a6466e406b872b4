"""One executor for independent simulations: a local process pool gives the serial run's results, bit for bit.

The Ray cluster case (a real head on loopback) is in test_plan.py: a plan and a sweep on it."""

import json

from kvroute import parallel
from kvroute.cli import main
from kvroute.parallel import Executor, ExecutorError, PoolExecutor, make_executor
from kvroute.policy.catalog import PRESETS_TABLE
from kvroute.sim.runner import run_scenario, run_scenario_on
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.sweep import sweep


def small(policies, n=150, rate=5.0):
    return parse_scenario({"replicas": [{"region": "us", "count": 2, "profile": "h100-llama3.2-3b"}],
                           "workload": {"kind": "chat-poisson", "rate": rate, "clients": {"us": 1}},
                           "policies": policies, "limits": {"max_requests": n}, "seed": 7})


def test_pool_sweep_equals_the_serial_sweep():
    sc = small(["round_robin", "least_request", "lmetric"])
    serial = sweep(sc, executor=Executor(1))
    with PoolExecutor(2) as pool:
        parallel = sweep(sc, executor=pool)
    assert json.dumps(serial, sort_keys=True) == json.dumps(parallel, sort_keys=True)
    assert serial["reference"] is not None and len(serial["compare"]["90%"]) == 3


def test_pool_runs_every_policy_as_the_serial_runner_does():
    sc = small(["round_robin", "sglang_cache_aware", "skywalker"], n=200)
    direct = run_scenario(sc)
    with PoolExecutor(2) as pool:
        pooled = run_scenario_on(sc, pool)
    assert [r.label for r in pooled] == [r.label for r in direct]
    for a, b in zip(direct, pooled):
        assert a.result == b.result
        assert list(a.recorder.ttft) == list(b.recorder.ttft)


def test_the_pool_keeps_item_order_and_reports_each_result():
    seen = []
    with PoolExecutor(2) as pool:
        out = pool.map(abs, [-3, 1, -2, 5], on_done=lambda i, r: seen.append((i, r)))
    assert out == [3, 1, 2, 5] and sorted(seen) == [(0, 3), (1, 1), (2, 2), (3, 5)]
    assert isinstance(make_executor(1), Executor) and not isinstance(make_executor(1), PoolExecutor)
    assert isinstance(make_executor(2), PoolExecutor)


def test_a_policy_file_preset_reaches_the_pool_workers(tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("name: filed_least\ncost: {inflight: 1}\nbranch: least\n")
    try:
        rc = main(["simulate", "--workload", "chat-poisson", "--rate", "4", "--replicas", "2", "--profile",
                   "h100-llama3.2-3b", "--max-requests", "100", "--policy", "round_robin", "--policy-file", str(f),
                   "--sweep", "--workers", "2", "--json", str(tmp_path / "s.json")])
    finally:
        PRESETS_TABLE.pop("filed_least", None)
    assert rc == 0, capsys.readouterr().err
    assert not parallel._PRELUDE  # the command forgot its prelude
    knees = json.loads((tmp_path / "s.json").read_text())["sweep"]["knees"]
    assert set(knees) == {"round_robin", "filed_least"}


def test_an_unreachable_ray_address_is_one_line_and_exit_2(capsys):
    for addr in ("127.0.0.1:1", "not-an-address"):
        rc = main(["simulate", "--workload", "chat-poisson", "--max-requests", "50", "--sweep", "--ray", addr])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "--ray" in err, err
    for cmd in (["plan", "skywalker-cost", "--no-progress"], ["bench", "auto", "--scenarios", "rag"]):
        rc = main([*cmd, "--ray", "127.0.0.1:1"])  # issue 22: plan and bench auto answer alike
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "no Ray cluster answers" in err, err
    try:
        make_executor(ray="127.0.0.1:1")
    except ExecutorError as exc:
        assert "no Ray cluster answers" in str(exc)
    else:
        raise AssertionError("expected ExecutorError")



def test_a_bad_worker_count_is_refused(capsys):
    import pytest

    for bad in ("0", "-2", "many"):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", "--sweep", "--workers", bad])
        assert exc.value.code == 2
    assert "--workers" in capsys.readouterr().err
