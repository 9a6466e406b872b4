"""SGLang's waiting gauge (sim/queue_gauge.py): a probe sees arrivals only once a scheduling pass
forms a prefill batch or a decode step logs (every 40th), never at the instant they arrive."""

import asyncio
import time

import aiohttp
import pytest
from test_sim_engine import Harness, small_profile

from kvroute.emulator.server import start_emulator
from kvroute.gateway.probes import parse_prometheus, read_indicators
from kvroute.perf.loader import load_profile
from kvroute.sim.engine import Seq
from kvroute.sim.queue_gauge import DECODE_LOG_INTERVAL, SGLangQueueGauge
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.seq import steps_done

SMALL, BIG = 200, 4000  # max_new: fits SGLang's budget beside the running request / is held by it

# (what arrives, live queue at arrival, gauge at arrival, live queue / gauge after the next pass,
#  gauge once the next decode log has run)
CASES = [
    ("one request the budget admits", [SMALL], 1, 0, (0, 0), 0),
    ("one request the budget holds back", [BIG], 1, 0, (1, 0), 1),
    ("one admitted, one held behind it", [SMALL, BIG], 2, 0, (1, 1), 1),
]


def decoded(h: Harness) -> int:
    """Decode steps run so far, counting those of a jump in progress."""
    jump = h.eng._jump
    return h.eng.steps + (steps_done(jump, h.loop.now - jump[0]) if jump is not None else 0)


@pytest.mark.parametrize(("arrivals", "live0", "gauge0", "after_pass", "after_log"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_gauge_lags_arrivals_until_a_scheduling_pass_sets_it(arrivals, live0, gauge0, after_pass, after_log):
    # 300 blocks = 4,800 tokens: a running request of up to 4,000 new tokens reserves ~2,800 of them
    h = Harness(small_profile(kv_blocks=300, admission="sglang", waiting_gauge="sglang"))
    gauge = h.eng.gauge
    assert isinstance(gauge, SGLangQueueGauge)
    h.eng.submit(Seq("long", 100, 3000, (), 16, max_new=BIG))
    start: list[int] = []  # decode steps run when the arrivals came
    trace = []  # (decode steps run incl. a jump's, steps the engine has booked, live queue, gauge)

    def probe(_):  # a /metrics read every 2 ms; the arrivals come 45 steps in, inside a decode jump
        d = decoded(h)
        if not start and d >= 45:
            start.append(d)
            for i, max_new in enumerate(arrivals):
                h.eng.submit(Seq(f"r{i}", 100, 50, (), 16, max_new=max_new))
            assert (h.eng.queued, gauge.read(h.loop.now)) == (live0, gauge0)  # a live read's transient
        elif start:
            trace.append((d, h.eng.steps, h.eng.queued, gauge.read(h.loop.now)))

    for i in range(1, 3000):
        h.loop.at(i * 0.002, probe, None)
    h.loop.run()
    s0 = start[0]
    log = (s0 // DECODE_LOG_INTERVAL + 1) * DECODE_LOG_INTERVAL  # the next decode log's step
    assert s0 + 1 < log  # the step in progress is not the one that logs
    passed = [t for t in trace if t[1] > s0]  # the jump was cut at its next step; the pass ran
    assert passed[0][2:] == after_pass
    before_log = [t[3] for t in passed if t[0] < log]
    assert before_log and set(before_log) == {after_pass[1]}  # unchanged until the decode log
    assert next(t[3] for t in passed if t[0] >= log) == after_log


def test_engines_are_probed_live_unless_the_profile_asks_for_the_gauge():
    """vLLM's num_requests_waiting is rebuilt every engine step (make_stats): no gauge; the L4
    profile runs SGLang (SkyWalker §5.1) and exports SGLang's gauge; a scenario may override it."""
    assert Harness(small_profile()).eng.gauge is None
    assert Harness(small_profile(admission="sglang")).eng.gauge is None
    assert isinstance(Harness(load_profile("l4-llama3.1-8b")).eng.gauge, SGLangQueueGauge)
    group = {"region": "us", "count": 1, "profile": "l4-llama3.1-8b"}
    for override, want in ((None, "sglang"), ("live", "live")):
        sc = parse_scenario({"replicas": [{**group, "waiting_gauge": override} if override else group],
                             "workload": {"kind": "chat", "clients": {"us": 1}}, "policies": ["skywalker"]})
        assert sc.setup().replicas[0].profile.waiting_gauge == want


def test_a_probe_reads_the_running_count_the_gauge_last_wrote():
    """num_running_reqs is written with num_queue_reqs: requests admitted after the last log do not
    show as running either."""
    h = Harness(small_profile(kv_blocks=300, admission="sglang", waiting_gauge="sglang"))
    gauge = h.eng.gauge
    assert isinstance(gauge, SGLangQueueGauge)
    h.eng.submit(Seq("long", 100, 3000, (), 16, max_new=BIG))
    seen = []

    def probe(_):
        gauge.read(h.loop.now)
        seen.append((len(h.eng.decoding), gauge.running))

    for i in range(1, 3000):  # 6 s: past the 40th decode step (~50 ms a step)
        h.loop.at(i * 0.002, probe, None)
    h.loop.run()
    assert (1, 0) in seen  # decoding, and no log has written the batch yet
    assert (1, 1) in seen  # the 40th decode step logged it


def test_an_emulated_sglang_engine_exports_the_gauge_not_the_live_queue():
    """The emulator's sglang:num_queue_reqs is the gauge too: a request the budget holds back is not
    in it at once, only after the next 40th decode step (~2 s of real time on the L4 profile)."""
    profile = load_profile("l4-llama3.1-8b").model_copy(update={"kv_blocks": 300})

    async def scenario():
        runner, emu, port = await start_emulator("127.0.0.1", 0, profile, "sglang")
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                async def ask(name: str):
                    body = {"model": "emulated", "prompt": name, "max_tokens": BIG, "stream": True}
                    async with s.post(f"{url}/v1/completions", json=body) as r:
                        async for _ in r.content:
                            pass

                async def queue_gauge() -> float:
                    async with s.get(f"{url}/metrics") as r:
                        return read_indicators(parse_prometheus(await r.text())).waiting

                first = asyncio.create_task(ask("long"))
                while not emu.engine.decoding:
                    await asyncio.sleep(0.01)
                second = asyncio.create_task(ask("held"))
                while emu.engine.queued == 0:
                    await asyncio.sleep(0.005)
                at_once = await queue_gauge()
                deadline = time.monotonic() + 10
                while await queue_gauge() == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                later = await queue_gauge()
                first.cancel(), second.cancel()
                return at_once, later, emu.engine.queued
        finally:
            await runner.cleanup()

    at_once, later, live = asyncio.run(scenario())
    assert (at_once, later, live) == (0, 1, 1)
