"""The emulator's real-time clock (emulator/realtime.py) runs each event at its own model time, as
the simulator does: an engine that times its next step from ``now`` inside a step's callback keeps
its profile's pace even when the event loop wakes it late, instead of falling behind by the
loop's lateness at every step (tests/test_calibrate.py's emulated 5.8 ms decode step was fitted
at 9.6 ms at load ~7)."""

from __future__ import annotations

import asyncio
import time

from kvroute.emulator.realtime import RealtimeLoop

STEP_S = 0.01
LATE_S = 0.008  # what each step's callback costs the loop (a loaded machine's late wake-up, made here)
STEPS = 40


def test_a_chain_of_steps_keeps_its_pace_when_every_wake_up_is_late():
    async def run() -> tuple[list[float], float]:
        clock = RealtimeLoop()
        seen: list[float] = []
        done = asyncio.get_running_loop().create_future()
        start = clock.now

        def step(k: int) -> None:
            seen.append(clock.now - start)
            time.sleep(LATE_S)  # the loop is late for the next event by this much, at least
            if k == STEPS:
                done.set_result(None)
            else:
                clock.at(clock.now + STEP_S, step, k + 1)  # as sim/engine.py times its next step

        t0 = time.monotonic()
        clock.at(start + STEP_S, step, 1)
        await asyncio.wait_for(done, 30)
        return seen, time.monotonic() - t0

    seen, wall = asyncio.run(run())
    # inside each callback the clock reads the step's own time: k steps of STEP_S, whatever the lateness
    assert [round(t / STEP_S, 6) for t in seen] == [float(k) for k in range(1, STEPS + 1)]
    # a clock read at the wake-up puts STEP_S + LATE_S between steps: 0.72 s at the least for 40 steps;
    # at its own pace the chain takes 0.40 s plus the last step's lateness
    assert wall < STEPS * (STEP_S + LATE_S), wall


def test_the_clock_never_reads_earlier_than_it_has_read():
    async def run() -> list[float]:
        clock = RealtimeLoop()
        reads: list[float] = []
        done = asyncio.get_running_loop().create_future()
        clock.at(clock.now + 0.005, lambda _: (reads.append(clock.now), done.set_result(None)))
        time.sleep(0.02)  # a handler reads the wall clock (later) before the late event runs
        reads.append(clock.now)
        await asyncio.wait_for(done, 10)
        return reads

    wall_read, event_read = asyncio.run(run())
    assert event_read >= wall_read  # the event's own time (earlier) is not read after a later one


def test_the_clock_reports_how_late_its_timers_and_first_tokens_came():
    """Lateness made here (the loop held busy past a timer's time) is what ``timers`` records; a
    first token's lateness is its wall time from ``mark`` less the model's time to it."""
    async def run() -> RealtimeLoop:
        clock = RealtimeLoop()
        done = asyncio.get_running_loop().create_future()
        mark = (time.monotonic(), clock.now)
        due = clock.now + 0.005
        clock.at(due, lambda _: (clock.first_token(mark, due), done.set_result(None)))
        time.sleep(0.05)  # the loop cannot run the 5 ms timer until this returns: 45 ms late at least
        await asyncio.wait_for(done, 10)
        clock.at(clock.now, lambda _: None)  # due now: on time, as an idle loop runs it
        await asyncio.sleep(0.05)
        return clock

    clock = asyncio.run(run())
    wake, first = clock.timers.summary(), clock.first_tokens.summary()
    assert wake["timers"] == 2 and first["timers"] == 1
    assert 0.045 <= wake["max_s"] <= 2 * wake["mean_s"] and wake["p90_s"] <= wake["max_s"]
    assert 0.045 <= first["max_s"] == first["mean_s"] == first["p50_s"] < 5
    clock.first_token(None, 1.0)  # a request with no mark (none taken): nothing recorded
    assert clock.first_tokens.count == 1
