"""A step started beside busy engines of the same machine (issue 21i): the calibration's probe and
fit (calibrate/newcomer_probe.py, profile ``newcomer_slowdown``) and the simulated host's transient
(sim/host.py ``newcomer_factor``, applied by sim/engine.py)."""

import asyncio

import pytest

from kvroute.calibrate import fit_profile
from kvroute.calibrate.measure import EngineFacts, Measurements, Sweep
from kvroute.calibrate.newcomer_probe import factors, newcomer_points
from kvroute.perf.profile import HardwareProfile, NewcomerPoint
from kvroute.sim.engine import Engine, Host, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.host import newcomer_factor

# one prefill of 1,000 tokens is one step of exactly 1 s (as tests/test_shared_cores.py)
UNIT = HardwareProfile(name="unit", hardware="test", model="test", c0_s=0.0, c_prefill_s=1e-3, c_decode_s=0.01,
                       c_attn_s=0.0, c_prefill_attn_s=0.0, h_cv=0.0, kv_blocks=10000, block_size=16, max_running=8)
POINTS = [NewcomerPoint(others=2, solo_s=0.04, factor=1.4), NewcomerPoint(others=2, solo_s=0.2, factor=1.1)]


def test_the_factor_is_flat_below_interpolated_between_and_diluted_beyond_the_measured_steps():
    assert newcomer_factor(POINTS, 2, 0.01) == pytest.approx(1.4)
    assert newcomer_factor(POINTS, 2, 0.12) == pytest.approx(1.25)
    # beyond the longest measured step its excess time (0.1 x 0.2 s) stays: 1 + 0.02 / 0.4
    assert newcomer_factor(POINTS, 2, 0.4) == pytest.approx(1.05)
    assert newcomer_factor(POINTS, 3, 0.04) == pytest.approx(1.4)  # more busy than measured: the most measured
    assert newcomer_factor(POINTS, 1, 0.04) == 1.0  # fewer than any measured count: none
    assert newcomer_factor(POINTS, 0, 0.04) == 1.0 and newcomer_factor([], 2, 0.04) == 1.0


def _three_on_two_cores(prof: HardwareProfile) -> tuple[dict[str, float], Engine]:
    loop = EventLoop()
    first: dict[str, float] = {}
    host = Host(2)
    a, b, c = (Engine(f"e{i}", prof, loop, lambda s, t: first.__setitem__(s.rid, t), lambda s, t: None, host=host)
               for i in range(3))
    a.submit(Seq("a", 1000, 1, (), 16))
    b.submit(Seq("b", 1000, 1, (), 16))
    loop.at(0.25, lambda _: c.submit(Seq("c", 1000, 1, (), 16)))
    loop.run()
    return first, c


def test_a_newcomers_first_step_runs_the_measured_factor_slower_than_sharing():
    """2 cores, 3 engines. A and B prefill from 0 (two engines: full speed each; B started beside one
    engine, for which nothing is measured); C joins at 0.25 s beside both: everyone runs at 1.5x, and
    C's first step 1.2x more. A and B end at 0.25 + 0.75 x 1.5 = 1.375 s; C has 0.675 s left then,
    re-timed to its factor alone (1.2 / 1.8): ends at 1.825 s (without the factor 1.625 s)."""
    first, c = _three_on_two_cores(UNIT.model_copy(update={
        "newcomer_slowdown": [NewcomerPoint(others=2, solo_s=1.0, factor=1.2)]}))
    assert first == pytest.approx({"a": 1.375, "b": 1.375, "c": 1.825})
    assert c.busy_s == pytest.approx(1.575)
    first, c = _three_on_two_cores(UNIT)  # nothing measured: processor sharing alone
    assert first == pytest.approx({"a": 1.375, "b": 1.375, "c": 1.625})


def test_factors_divide_by_processor_sharing_and_never_speed_a_step_up():
    """2 cores, half a core of background: two stepping share 1.5 cores (4/3x), three 2x."""
    points = [(1, "warm", 0.04, 0.04 * 4 / 3 * 1.1), (1, "warm", 0.05, 0.05 * 4 / 3 * 1.3),
              (2, "warm", 0.04, 0.04 * 2 * 1.25), (2, "cold", 0.2, 0.2 * 2 * 0.9)]
    got = factors(points, 2, 0.5)
    assert got == [pytest.approx((1, 0.045, 1.2)), pytest.approx((2, 0.04, 1.25)), pytest.approx((2, 0.2, 1.0))]


def test_the_fit_writes_the_factors_only_for_shared_cores():
    true = UNIT.model_copy(update={"c0_s": 2e-3, "c_attn_s": 1e-6, "c_prefill_attn_s": 1e-8})
    m = Measurements([EngineFacts(f"http://e{i}", 3.0) for i in range(3)], "test")
    for n in (128, 512, 1024, 2048):
        m.prefill += [(n, n, 1.5 * true.prefill_time(n))] * 3
    for bs in (1, 2, 4):
        for ctx in (128, 1024):
            m.decode += [(bs, ctx, ctx, 1.5 * true.step_time(decode=bs, decode_ctx=bs * ctx))] * 3
    m.newcomer = [(2, "warm", 0.04, 0.04 * 1.5 * 1.3)] * 3 + [(1, "cold", 0.2, 0.2 * 1.05)] * 3
    shared, report = fit_profile(m, "x", "test", host_cores=2)
    assert [(p.others, p.solo_s, p.factor) for p in shared.newcomer_slowdown] == [
        pytest.approx((1, 0.2, 1.05)), pytest.approx((2, 0.04, 1.3))]
    assert report["newcomer_probes"] == 6
    alone, _ = fit_profile(m, "x", "test")  # no shared cores: no host to apply it
    assert alone.newcomer_slowdown == []


class _Fake:
    """An engine whose request takes 0.1 s x (prompt tokens / 1,000)^2, twice that while another fake
    of the same machine is working: the probe must see the 2x beside busy ones."""

    busy = 0

    def __init__(self):
        self.n = 0

    def prompt(self, tokens: int) -> str:
        self.n += 1
        return f"p{self.n} " + "x " * tokens

    def suffix(self, tokens: int) -> str:
        return "y " * tokens

    async def sized(self, tokens: int, max_tokens: int = 1) -> tuple[float, int]:
        return await self.complete(self.prompt(tokens), max_tokens)

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]:
        tokens = len(prompt.split())
        seconds = 0.1 * (tokens / 1000) ** 2 * (2 if _Fake.busy else 1)
        _Fake.busy += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            _Fake.busy -= 1
        return seconds, tokens


def test_the_probe_times_each_engine_alone_and_beside_each_count_of_busy_ones():
    engines = [_Fake(), _Fake(), _Fake()]
    sweep = Sweep(prefill_lengths=(128, 1024), warm_contexts=(256,), warm_lengths=(96,), newcomer_rounds=1)
    lines: list[str] = []
    points = asyncio.run(newcomer_points(engines, sweep, lines.append, lead_s=0.001))
    # 3 targets x 2 counts of busy ones x (warm, cold)
    assert len(points) == 12 and {(k, kind) for k, kind, *_ in points} == {
        (1, "warm"), (2, "warm"), (1, "cold"), (2, "cold")}
    for _k, _kind, alone, beside in points:
        assert beside == pytest.approx(2 * alone, rel=0.05)
    assert len(lines) == 12
    assert asyncio.run(newcomer_points(engines[:1], sweep, lines.append)) == []
    assert asyncio.run(newcomer_points(engines, Sweep(), lines.append)) == []  # 0 rounds by default
