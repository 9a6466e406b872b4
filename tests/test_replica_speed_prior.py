"""The declared-accelerator prior of ``lmetric_speed`` (policy/adaptive/replica_speed/datasheet.py,
prior.py): datasheet numbers per accelerator, the prior only where declared hardware differs, measured
times replacing it replica by replica, the simulator's scenario field, and the live gateway reading
``replicas[].accelerator`` from its config file over real HTTP."""

from __future__ import annotations

import asyncio
import re
import threading
import urllib.request

import openai
import pytest

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed import SpeedFit, SpeedLMetric
from kvroute.policy.adaptive.replica_speed.datasheet import ACCELERATORS, SOURCES, accelerator_key, prior_times
from kvroute.policy.adaptive.replica_speed.prior import calibrated, prior_factors, prior_predict, relative
from kvroute.policy.plugins import DecisionState


class _St:
    """A decision state whose request has 1000 uncached tokens on every replica."""

    _lmetric_of = None
    lmetric = DecisionState.lmetric  # the scorer reads LMetric's score from the decision's state

    def new_prefill(self, eps):
        return [1000 for _ in eps]


@pytest.mark.parametrize(("name", "key"), [("a100-80gb", "a100-80gb"), ("NVIDIA-A100-SXM4-80GB", "a100-80gb"),
                                           ("NVIDIA-L4", "l4"), ("L4", "l4"), ("nvidia-h100-80gb-hbm3", "h100")])
def test_declared_names_and_node_labels_map_to_the_table(name, key):
    assert accelerator_key(name) == key


def test_an_unknown_accelerator_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown accelerator 'tpu-v5'.*a100-80gb.*l4"):
        accelerator_key("tpu-v5")
    assert set(SOURCES) == set(ACCELERATORS) and all(u.startswith("https://") for u in SOURCES.values())


def test_the_prior_acts_only_where_declared_hardware_differs_in_both_measures():
    a100, l4 = ACCELERATORS["a100-80gb"], ACCELERATORS["l4"]
    p = prior_times({"a": "a100-80gb", "b": "l4", "c": "l4"}, spread=1.5)
    assert p["b"][0] / p["a"][0] == pytest.approx(a100.bf16_tflops / l4.bf16_tflops)  # 312 / 121 = 2.58
    assert p["b"][1] / p["a"][1] == pytest.approx(a100.mem_gbps / l4.mem_gbps)  # 2039 / 300 = 6.8
    assert prior_times({"a": "l4", "b": "l4"}, 1.5) == {}  # one kind
    assert prior_times({"a": "a100-40gb", "b": "a100-80gb"}, 1.5) == {}  # same compute: one generation
    assert prior_times({"a": "a100-80gb"}, 1.5) == {}


def test_measured_times_replace_the_prior_and_calibrate_it_for_the_unmeasured():
    assert calibrated({}, {"a": 1.0, "b": 3.0}) == {"a": 1.0, "b": 3.0}  # nothing measured: the prior alone
    # a measured at 0.2 s where its prior says 1, c at 0.5 s where it says 3: b, unmeasured, is its prior
    # x the median of those ratios (0.2 and 1/6); a and c keep their own
    assert calibrated({"a": 0.2, "c": 0.5}, {"a": 1.0, "b": 3.0, "c": 3.0}) == pytest.approx(
        {"a": 0.2, "b": 3.0 * (0.2 + 0.5 / 3) / 2, "c": 0.5})
    assert relative({"a": 1.0, "b": 3.0, "c": 3.0}) == pytest.approx({"a": 1 / 3, "b": 1.0, "c": 1.0})


def _observe(fit: SpeedFit, ep: str, n: int, per_token: float, tpot: float) -> None:
    for i in range(n):
        rid, work = f"{ep}-{i}", 500.0 * (i + 1)
        fit.dispatched(rid, ep, int(work), 0.0)
        fit.first_token(rid, per_token * work)
        fit.finished(rid, ep, per_token * work + tpot * (100 + i), 101 + i)


def test_prior_factors_and_predictions_before_and_after_measurements():
    prior = prior_times({"a": "a100-80gb", "b": "l4", "c": "l4"}, 1.5)
    fit = SpeedFit(min_samples=2)
    pf, df = prior_factors(fit, prior)
    assert pf["a"] == pytest.approx(121 / 312) and df["a"] == pytest.approx(300 / 2039) and pf["b"] == 1.0
    assert prior_predict(fit, [("a", 1000.0), ("b", 1000.0)], prior) is None  # no seconds known yet
    _observe(fit, "a", 6, per_token=1e-4, tpot=0.02)
    a, b, other = prior_predict(fit, [("a", 1000.0), ("b", 1000.0), ("x", 0.0)], prior)
    assert a == pytest.approx(0.1, rel=1e-6) and b == pytest.approx(0.1 * 312 / 121, rel=1e-6)
    assert other == pytest.approx((a + b) / 2)  # undeclared and unmeasured: the median
    _observe(fit, "b", 6, per_token=5e-4, tpot=0.05)  # b measured: its own times, 5x at prefill
    pf, df = prior_factors(fit, prior)
    assert pf["b"] / pf["a"] == pytest.approx(5.0, rel=0.01) and df["b"] / df["a"] == pytest.approx(2.5, rel=0.05)
    # c, an L4 not measured yet: its prior calibrated on both measured replicas (the median of their
    # measured ÷ prior ratios) — between the datasheet's 2.58x and the 5x measured on its sibling b
    assert 312 / 121 < pf["c"] / pf["a"] < 5.0


def test_the_scorer_prefers_the_declared_fast_replica_from_the_first_request():
    eps = [Endpoint("l4", accelerator="l4", running=0), Endpoint("a100", accelerator="a100-80gb", running=3)]
    scorer = SpeedLMetric(min_samples=2, ttft_pick=True)
    l4, a100 = scorer.values(_St(), eps)
    assert a100 < l4  # 4 x the batch, but ~17 x faster per the datasheets
    assert scorer.state()["prior"] == 1.0 and scorer.state()["mixed"] == 1.0
    same = [Endpoint("x", accelerator="l4", running=0), Endpoint("y", accelerator="l4", running=3)]
    plain = [Endpoint("x", running=0), Endpoint("y", running=3)]
    assert SpeedLMetric(min_samples=2).values(_St(), same) == SpeedLMetric(min_samples=2).values(_St(), plain)
    off = SpeedLMetric(learn=False)
    assert off.values(_St(), eps) == [1000 * 1, 1000 * 4] and "prior" not in off.state()


def test_a_scenario_declares_accelerators_and_rejects_unknown_ones():
    from kvroute.sim.scenario import ScenarioError, load_scenario, parse_scenario

    sc = load_scenario("mixed-hardware")
    assert [g.accelerator for g in sc.replicas] == ["a100-80gb", "l4"]
    data = sc.model_dump(exclude_none=True)
    data["replicas"][0]["accelerator"] = "gpu9000"
    with pytest.raises(ScenarioError, match="unknown accelerator 'gpu9000'"):
        parse_scenario(data, "bad")


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in re.findall(r'kvroute_policy_state\{key="([^"]+)"\} (\S+)', text)}


def test_the_live_gateway_reads_declared_accelerators_from_its_config(tmp_path):
    """Two emulated engines declared as an L4 and an A100 (a node label) in a gateway YAML file: `auto`
    sends the first requests, one at a time, to the A100 before it has measured either, and exports the prior."""
    from kvroute.gateway.config import load_config
    from kvroute.gateway.server import Gateway
    from kvroute.live.embedded import start_emulators

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    emus = call(start_emulators(2, "h100-llama3.2-3b"))
    gw = None
    try:
        cfg = tmp_path / "gateway.yaml"
        cfg.write_text("host: 127.0.0.1\nport: 0\n"
                       "replicas:\n"
                       f"  - {{url: http://127.0.0.1:{emus[0][2]}, id: slow, engine: vllm, accelerator: l4}}\n"
                       f"  - {{url: http://127.0.0.1:{emus[1][2]}, id: fast, engine: vllm, "
                       "accelerator: NVIDIA-A100-SXM4-80GB}\n")
        gw = Gateway(load_config(str(cfg)))
        call(gw.start())
        url = f"http://127.0.0.1:{gw.port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
        served = []
        for i in range(6):
            raw = client.chat.completions.with_raw_response.create(
                model="emulated", max_tokens=4, messages=[{"role": "user", "content": f"question {i} " * 20}])
            served.append(raw.headers["x-kvroute-replica"])
        assert served == ["fast"] * 6
        st = _metrics(url)
        assert st["lmetric_speed.prior"] == 1.0 and st["lmetric_speed.mixed"] == 1.0
        assert st["lmetric_speed.fast.prefill_factor"] < st["lmetric_speed.slow.prefill_factor"]
    finally:
        if gw is not None:
            call(gw.stop())
        for runner, _, _ in emus:
            call(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_gateway_config_with_an_unknown_accelerator_is_one_line_and_exit_2(tmp_path, capsys):
    from kvroute.cli import main

    cfg = tmp_path / "gw.yaml"
    cfg.write_text("port: 0\nreplicas:\n  - {url: http://127.0.0.1:9, accelerator: gpu9000}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown accelerator 'gpu9000'" in err and "gw.yaml" in err and "Traceback" not in err
