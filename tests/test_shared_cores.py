"""Engines sharing a machine's cores (sim.engine.Host, scenario ``host_cores``) and the calibration
that divides that sharing out of its measurements (calibrate --host-cores)."""

import pytest

from kvroute.calibrate import fit_profile
from kvroute.calibrate.measure import EngineFacts, Measurements
from kvroute.perf.profile import HardwareProfile
from kvroute.sim.engine import Engine, Host, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import ScenarioError, parse_scenario

# one prefill of 1,000 tokens is one step of exactly 1 s; decode steps of 10 ms
UNIT = HardwareProfile(name="unit", hardware="test", model="test", c0_s=0.0, c_prefill_s=1e-3, c_decode_s=0.01,
                       c_attn_s=0.0, c_prefill_attn_s=0.0, h_cv=0.0, kv_blocks=10000, block_size=16, max_running=8)


def _engines(n: int, cores: int | None):
    loop = EventLoop()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    host = Host(cores) if cores else None
    engines = [Engine(f"e{i}", UNIT, loop, lambda s, t: first.__setitem__(s.rid, t),
                      lambda s, t: done.__setitem__(s.rid, t), host=host) for i in range(n)]
    return loop, engines, first, done


def _seq(rid: str, prompt: int = 1000, output: int = 1) -> Seq:
    return Seq(rid, prompt, output, (), 16)


@pytest.mark.parametrize(("engines", "cores", "expect_s"), [(3, 2, 1.5), (2, 2, 1.0), (3, None, 1.0), (4, 1, 4.0)])
def test_engines_slow_each_other_only_beyond_the_core_count(engines, cores, expect_s):
    loop, engs, first, _ = _engines(engines, cores)
    for i, e in enumerate(engs):
        e.submit(_seq(f"r{i}"))
    loop.run()
    assert list(first.values()) == pytest.approx([expect_s] * engines)


def test_a_step_in_progress_is_retimed_when_others_start_and_stop():
    """Processor sharing: A prefills alone from 0; B and C join at 0.5 s (3 engines, 2 cores), so
    A's remaining half runs at 2/3 speed and ends at 1.25 s; B and C did 0.5 of their 1 s of work
    by then and finish the rest at full speed, at 1.75 s."""
    loop, (a, b, c), first, _ = _engines(3, 2)
    a.submit(_seq("a"))
    loop.at(0.5, lambda _: (b.submit(_seq("b")), c.submit(_seq("c"))))
    loop.run()
    assert first == pytest.approx({"a": 1.25, "b": 1.75, "c": 1.75})
    assert a.busy_s == pytest.approx(1.25) and b.busy_s == pytest.approx(1.25)


def test_a_decode_jump_slows_from_the_step_after_another_engine_starts():
    """One core: A decodes 100 tokens (1 s alone); B's 0.5 s prefill arriving at 0.3 s doubles A's
    steps while both step, so A ends later than alone and B's prefill takes twice as long."""
    loop, (a, b), first, done = _engines(2, 1)
    a.submit(_seq("a", prompt=100, output=101))  # first token after a 0.1 s prefill, then 100 steps
    loop.at(0.3, lambda _: b.submit(_seq("b", prompt=500)))
    loop.run()
    alone = 0.1 + 100 * 0.01
    overlap = 1.0  # B's 0.5 s of work at half speed
    assert first["b"] == pytest.approx(0.3 + overlap, abs=0.011)
    # A loses half of its speed for the overlap: about 0.5 s later than alone (± one step)
    assert done["a"] == pytest.approx(alone + overlap / 2, abs=0.011)


def test_a_requests_front_end_time_stretches_with_the_hosts_slowdown():
    """The time outside the engine's loop runs on the shared cores too: 2 cores, half a core of
    background, 3 engines stepping: 2x; none or one stepping: as measured alone."""
    host = Host(2, background=0.5)
    assert host.front_end_s(0.01) == pytest.approx(0.01)
    host.stepping = 1
    assert host.front_end_s(0.01) == pytest.approx(0.01)
    host.stepping = 3
    assert host.front_end_s(0.01) == pytest.approx(0.02)


def test_a_host_needs_a_core():
    with pytest.raises(ValueError, match="at least one core"):
        Host(0)


def _scenario(**group):
    return parse_scenario({"replicas": [{"region": "local", "count": 3, "profile": "l4-llama3.1-8b", **group}],
                           "workload": {"kind": "chat", "clients": {"local": 24}},
                           "limits": {"max_requests": 300}, "policies": ["round_robin"], "seed": 1})


def test_scenario_host_cores_enough_for_every_replica_changes_nothing_and_fewer_slow_it():
    alone = run_scenario(_scenario())[0].result
    roomy = run_scenario(_scenario(host_cores=3))[0].result
    assert roomy["ttft_s"] == alone["ttft_s"] and roomy["e2e_s"] == alone["e2e_s"]
    shared = run_scenario(_scenario(host_cores=1))[0].result
    assert shared["e2e_s"]["p50"] > 1.5 * alone["e2e_s"]["p50"]
    with pytest.raises(ScenarioError, match="host_cores"):
        _scenario(host_cores=0)


def test_calibration_divides_the_sharing_it_measured_under():
    """Three engines on two cores, measured all at once, run 1.5x slower than one alone: with
    host_cores the fit recovers the engine's own profile."""
    # llama-servers (they have slots): their attention counts query rows in 64-row tiles
    true = UNIT.model_copy(update={"c0_s": 2e-3, "c_attn_s": 1e-6, "c_prefill_attn_s": 1e-8,
                                   "prefill_attn_tile": 64})
    facts = [EngineFacts(f"http://e{i}", 3.0, kv_tokens=16384, slots=4) for i in range(3)]
    m = Measurements(facts, "test")
    for n in (128, 512, 1024, 2048):
        m.prefill += [(n, n, 1.5 * true.prefill_time(n))] * 3
    for b in (1, 2, 4):
        for ctx in (128, 1024):
            m.decode += [(b, ctx, ctx, 1.5 * true.step_time(decode=b, decode_ctx=b * ctx))] * 3
    fitted, report = fit_profile(m, "x", "test", host_cores=2)
    assert report["sharing"] == 1.5
    for n in (300, 2000):
        assert fitted.ttft_overhead_s + fitted.prefill_time(n) == pytest.approx(true.prefill_time(n), rel=1e-6)
    assert fitted.step_time(decode=3, decode_ctx=1500) == pytest.approx(true.step_time(decode=3, decode_ctx=1500))
    folded, _ = fit_profile(m, "x", "test")  # without: the sharing stays in the constants
    assert folded.prefill_time(1000) == pytest.approx(1.5 * fitted.prefill_time(1000), rel=1e-6)

    # other CPU measured over the sweep (calibrate/host_cpu.py) shared the cores too: 3 / (2 - 0.5)
    m.background_cores = 0.5
    busy, report = fit_profile(m, "x", "test", host_cores=2)
    assert report["sharing"] == pytest.approx(2.0) and report["background_cores"] == 0.5
    assert busy.prefill_time(1000) == pytest.approx(fitted.prefill_time(1000) * 1.5 / 2.0, rel=1e-6)
    m.background_cores = 5.0  # more than the machine: kept below its cores, as a live run's is
    assert fit_profile(m, "x", "test", host_cores=2)[1]["sharing"] == pytest.approx(3 / 0.2)


def test_background_load_shares_the_cores_with_the_engines():
    """Half a core of other work on a 2-core host leaves the engines 1.5 cores: one engine alone
    runs at full speed (1 s prefill, 1 s); two share the 1.5 cores (4/3 s each)."""
    loop = EventLoop()
    first: dict[str, float] = {}
    host = Host(2, background=0.5)
    a, b = (Engine(f"e{i}", UNIT, loop, lambda s, t: first.__setitem__(s.rid, t), lambda s, t: None, host=host)
            for i in range(2))
    a.submit(_seq("alone"))
    loop.run()
    assert first["alone"] == pytest.approx(1.0)
    a.submit(_seq("a"))
    b.submit(_seq("b"))
    loop.run()
    assert first["a"] - 1.0 == pytest.approx(4 / 3) and first["b"] - 1.0 == pytest.approx(4 / 3)
    for bad in (-0.1, 2.0):
        with pytest.raises(ValueError, match="background"):
            Host(2, background=bad)


def test_scenario_background_needs_the_shared_machine():
    assert _scenario(host_cores=2, host_background_cores=0.5).replicas[0].host_background_cores == 0.5
    for group, why in (({"host_background_cores": 0.5}, "needs host_cores"),
                       ({"host_cores": 2, "host_background_cores": 2}, "below host_cores")):
        with pytest.raises(ScenarioError, match=why):
            _scenario(**group)
