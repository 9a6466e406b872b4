"""The calibration sweep's repeats (issue 21w): prefill, warm and decode points in every repeat, and another
repeat while leaving one out moves a kind of point too far (calibrate/repeat_check.py) — checked against
emulated engines slowed down for one repeat, and on hand-made samples."""

import asyncio
import math
import statistics

import pytest

from kvroute.calibrate import Sweep, fit_profile, measure
from kvroute.calibrate.measure import EngineFacts, Measurements
from kvroute.calibrate.repeat_check import shifts, too_wide
from kvroute.emulator.server import Faults, start_emulator
from tests.test_calibrate import KNOWN

SMALL = Sweep(prefill_lengths=(256, 1024), batch_sizes=(1, 2), contexts=(128, 512), decode_tokens=16, repeats=2,
              max_repeats=4, timeout_s=20, warm_contexts=(512,), warm_lengths=(96,), noise_probes=2, busy_rounds=1,
              slot_rounds=0)


def _samples(levels: list[float], engines: int = 2) -> Measurements:
    """Measurements whose repeat r runs every point ``levels[r]`` times a fixed time, on ``engines`` engines."""
    m = Measurements(engines=[EngineFacts(f"http://e{i}", 3.0) for i in range(engines)])
    for level in levels:
        for n in (128, 1024):
            m.prefill += [(n, n, level * n * 1e-4)] * engines
        m.warm += [(512, 96, 512, 96, level * 0.02)] * engines
        for b in (1, 4):
            m.decode += [(b, 128, 140.0, level * 0.005 * b)] * engines
        m.repeat_ends.append((len(m.prefill), len(m.warm), len(m.decode)))
    return m


def test_leaving_one_repeat_out_measures_how_far_it_moves_the_points():
    assert shifts(_samples([1.0, 1.0])) == {"prefill": 0.0, "warm": 0.0, "decode": 0.0}
    # two repeats 30 % apart: each point's median is halfway, and either repeat alone is 13-15 % off it
    two = shifts(_samples([1.0, 1.3]))
    assert two["prefill"] == pytest.approx(1.15 - 1) and set(too_wide(_samples([1.0, 1.3]), 0.05)) == {
        "prefill", "warm", "decode"}
    # one slow repeat among three still moves a median (leave a fast one out: two fast, two slow samples)
    assert too_wide(_samples([1.0, 1.5, 1.0]), 0.05)
    # among four it does not: every median is the fast one's whichever repeat is left out
    assert too_wide(_samples([1.0, 1.5, 1.0, 1.0]), 0.05) == {}
    assert shifts(_samples([1.0])) == {}  # one repeat: nothing to leave out


def test_a_slow_repeat_brings_more_repeats_and_does_not_move_the_fit():
    """Two emulators of a known profile; every model step runs 2x slower from the second repeat's first point until
    the sweep asks for another repeat. The sweep runs on until the slow repeat no longer moves the points'
    medians (four repeats, or more on a loaded machine), and the medians the fit takes are the other repeats'."""
    async def run():
        emus = [await start_emulator("127.0.0.1", 0, KNOWN, "vllm", Faults()) for _ in range(2)]
        lines: list[str] = []

        def pace(slowdown: float) -> None:  # what POST /_fault {"slowdown": x} does (emulator/server.py)
            for _, emu, _ in emus:
                emu.faults.slowdown = emu.clock.slowdown = slowdown

        def say(line: str) -> None:
            lines.append(line)
            # the first repeat's last decode point: the second repeat runs slow from its first point
            if sum(x.startswith("decode batch") for x in lines) == len(SMALL.contexts) * len(SMALL.batch_sizes):
                pace(2.0)
            if "another repeat" in line:
                pace(1.0)

        try:
            m = await measure([f"http://127.0.0.1:{port}" for _, _, port in emus], sweep=SMALL, log=say)
        finally:
            for runner, _, _ in emus:
                await runner.cleanup()
        return m, lines

    m, lines = asyncio.run(asyncio.wait_for(run(), 120))
    assert len(m.repeat_ends) >= 3 and any("another repeat" in x for x in lines), lines
    # every repeat took every kind of point on both engines
    assert len(m.decode) == 2 * len(SMALL.contexts) * len(SMALL.batch_sizes) * len(m.repeat_ends)
    assert len(m.prefill) == 2 * len(SMALL.prefill_lengths) * len(m.repeat_ends)
    # the points' medians (what the fit takes) are the unslowed repeats' level, not the slow repeat's (compared
    # with each other, not with the profile: a loaded machine's late timers move both alike)
    bounds = [(0, 0, 0), *m.repeat_ends]
    for kind, point in ((0, 1024), (2, (2, 512))):
        fast, slow = [], []
        for r, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            rows = (m.prefill if kind == 0 else m.decode)[lo[kind]:hi[kind]]
            got = [row[-1] for row in rows if (row[0] if kind == 0 else (row[0], row[1])) == point]
            (slow if r == 1 else fast).extend(got)
        mid = statistics.median(fast + slow)
        assert abs(math.log(mid / statistics.median(fast))) < abs(math.log(mid / statistics.median(slow))), point
        assert statistics.median(slow) > 1.3 * statistics.median(fast), point  # the slow repeat was slow
    fitted, report = fit_profile(m, "mine", "emulated", sweep=m.sweep)
    assert report["repeats"] == len(m.repeat_ends) and fitted.c_prefill_s > 0
