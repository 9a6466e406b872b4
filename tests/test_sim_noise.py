"""Optional engine timing noise and request reordering (sim/noise.py, scenario ``engine_noise``)
and the calibration's noise estimates (calibrate/noise.py)."""

import math
import statistics

import pytest

from kvroute.calibrate.noise import api_delay, step_sigma
from kvroute.perf.profile import HardwareProfile
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.noise import ApiDelay, NoiseSpec, StepNoise, attach
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import ScenarioError, parse_scenario

# one prefill of 1,000 tokens is one step of exactly 1 s; decode steps of 10 ms
UNIT = HardwareProfile(name="unit", hardware="test", model="test", c0_s=0.0, c_prefill_s=1e-3, c_decode_s=0.01,
                       c_attn_s=0.0, c_prefill_attn_s=0.0, h_cv=0.0, kv_blocks=10000, block_size=16, max_running=1)


def _scenario(**extra):
    return parse_scenario({"replicas": [{"region": "local", "count": 2, "profile": "l4-llama3.1-8b"}],
                           "workload": {"kind": "chat", "clients": {"local": 8}},
                           "policies": ["round_robin", "lmetric"], "limits": {"max_requests": 150}, "seed": 3, **extra})


def test_noise_is_off_by_default_and_zero_noise_changes_nothing():
    base = [r.result for r in run_scenario(_scenario())]
    zero = [r.result for r in run_scenario(_scenario(engine_noise={"step_sigma": 0, "api_delay_s": 0}))]
    assert base == zero
    noisy = [r.result for r in run_scenario(_scenario(engine_noise={"step_sigma": 0.3, "api_delay_s": 0.01}))]
    assert noisy != base
    again = [r.result for r in run_scenario(_scenario(engine_noise={"step_sigma": 0.3, "api_delay_s": 0.01}))]
    assert noisy == again  # seeded: the same scenario and seed give the same noisy run


def test_step_factors_have_mean_one_and_shrink_over_a_jump():
    n = StepNoise(0.4, "t")
    one = [n.factor(1) for _ in range(20000)]
    many = [n.factor(64) for _ in range(20000)]
    assert statistics.fmean(one) == pytest.approx(1.0, abs=0.02)
    assert statistics.fmean(many) == pytest.approx(1.0, abs=0.01)
    assert statistics.stdev(math.log(x) for x in one) == pytest.approx(0.4, rel=0.05)
    assert statistics.stdev(math.log(x) for x in many) == pytest.approx(0.05, rel=0.05)


def test_a_noisy_engine_spreads_its_step_times_around_the_model():
    loop = EventLoop()
    first: dict[str, float] = {}
    e = Engine("e", UNIT, loop, lambda s, t: first.__setitem__(s.rid, t), lambda s, t: None)
    e.step_noise = StepNoise(0.2, "e").factor
    for i in range(400):
        e.submit(Seq(f"r{i}", 1000, 1, (), 16))  # one at a time (max_running 1): a 1 s step each
    loop.run()
    times = sorted(first.values())
    steps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.fmean(steps) == pytest.approx(1.0, rel=0.05)
    assert 0.15 < statistics.stdev(steps) < 0.3  # log-normal with sigma 0.2: a CV of ~0.2


def test_api_delays_reorder_requests_dispatched_close_together():
    """Requests dispatched 1 ms apart reach the engine's queue out of order when the extra delay
    has a 5 ms mean; the mean delay stays the profile's overhead."""
    d = ApiDelay({"e": 0.005}, "t")
    arrivals = [i * 0.001 + d.delay("e", 0.008) for i in range(2000)]
    inversions = sum(1 for a, b in zip(arrivals, arrivals[1:]) if b < a)
    assert inversions > 400
    assert statistics.fmean(a - i * 0.001 for i, a in enumerate(arrivals)) == pytest.approx(0.008, rel=0.08)
    assert d.delay("other", 0.008) == 0.008  # an engine without noise: the fixed overhead


def test_attach_gives_each_noisy_engine_its_own_stream():
    loop = EventLoop()
    engines = {k: Engine(k, UNIT, loop, lambda s, t: None, lambda s, t: None) for k in ("a", "b", "c")}
    api = attach(engines, {"a": NoiseSpec(0.1, 0.0), "b": NoiseSpec(0.0, 0.002), "c": None}, seed=1)
    assert engines["a"].step_noise is not None and engines["b"].step_noise is None
    assert engines["c"].step_noise is None and api is not None and set(api.means) == {"b"}
    assert attach(engines, {"c": None}, seed=1) is None


def test_profile_noise_comes_from_the_profile_and_bad_values_are_named():
    sc = _scenario(engine_noise="profile")
    assert all(r.noise is None for r in sc.setup().replicas)  # a bundled profile measured none
    with pytest.raises(ScenarioError, match="engine_noise"):
        _scenario(engine_noise={"step_sigma": -1})
    with pytest.raises(ScenarioError, match="engine_noise"):
        _scenario(engine_noise={"jitter": 1})


def test_calibration_estimates_the_spread_it_was_given():
    # prefill repeats: each length's times scattered by a known log-normal factor
    rng = StepNoise(0.1, "cal")
    prefill = [(n, n, n * 1e-3 * rng.factor()) for n in (512, 1024, 2048) for _ in range(40)]
    sigma, used = step_sigma(prefill + [(128, 128, 5.0)])  # short prompts do not count
    assert used == 120 and sigma == pytest.approx(0.1, rel=0.15)
    assert step_sigma([(1024, 1024, 0.5)]) == (0.0, 0)  # no repeats: nothing to say
    # probes: a fixed 5 ms per engine plus an exponential extra of mean 2 ms
    d = ApiDelay({"e": 0.002}, "probe")
    probes = [(i % 3, 0.005 + d.delay("e", 0.002)) for i in range(600)]
    got = api_delay(probes)
    assert got["api_delay_s"] == pytest.approx(0.002, rel=0.15) and got["probes"] == 600
    assert api_delay([]) == {"api_delay_s": 0.0, "probes": 0}


def test_a_busy_engine_adds_its_measured_overhead(tmp_path):
    """``ttft_overhead_busy_s`` (calibrate: a tiny prompt beside a decoding batch) replaces the
    idle overhead for requests dispatched to an engine that is stepping; equal to it, nothing
    changes."""
    import yaml

    from kvroute.perf.loader import load_profile

    base = load_profile("l4-llama3.1-8b")

    def run(busy):
        path = tmp_path / f"p-{busy}.yaml"
        path.write_text(yaml.safe_dump(base.model_copy(update={"ttft_overhead_busy_s": busy}).model_dump()))
        sc = parse_scenario({"replicas": [{"region": "local", "count": 2, "profile": str(path)}],
                             "workload": {"kind": "chat", "clients": {"local": 8}}, "policies": ["round_robin"],
                             "limits": {"max_requests": 120}, "seed": 3})
        return run_scenario(sc)[0].result

    plain = run(None)
    assert run(base.ttft_overhead_s) == plain
    slow = run(base.ttft_overhead_s + 0.5)
    assert slow["ttft_s"]["p50"] > plain["ttft_s"]["p50"] + 0.2  # most requests find their engine busy


def test_a_new_sequence_stalls_the_step_it_joins_by_c_admit():
    """``c_admit_s`` (calibrate: the decoding batch's longest token gap while a tiny prompt joined
    it; llama-server stalls its slots) lengthens the step that starts a new sequence's prefill,
    for the sequences already decoding too; 0 changes nothing."""
    def run(admit: float) -> dict[str, float]:
        loop = EventLoop()
        done: dict[str, float] = {}
        prof = UNIT.model_copy(update={"c_admit_s": admit, "max_running": 4})
        e = Engine("e", prof, loop, lambda s, t: None, lambda s, t: done.__setitem__(s.rid, t))
        e.submit(Seq("a", 1000, 101, (), 16))  # 1 s prefill, then 100 decode steps of 10 ms
        loop.at(1.5, lambda _: e.submit(Seq("b", 100, 1, (), 16)), None)  # joins while a decodes
        loop.run()
        return done

    plain, stalled = run(0.0), run(0.25)
    assert stalled["b"] == pytest.approx(plain["b"] + 0.25, abs=0.021)  # up to a decode step of phase
    assert stalled["a"] == pytest.approx(plain["a"] + 0.5, abs=0.021)  # a's own first step, then b's
