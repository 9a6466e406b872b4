"""vLLM's waiting gauge (sim/step_gauge.py): num_requests_waiting is the last finished step's, so a request
that arrives during a step and is scheduled at the next never shows as waiting, while one the schedule
leaves out (no batch slot) shows once the step it was left out of ends; calibrate writes the gauge for
engines that export vLLM's cache_config_info, and SkyWalker's pending gate keeps a conversation on its
replica through a long prefill step with it."""

from kvroute.calibrate.fit import _waiting_gauge
from kvroute.calibrate.measure import EngineFacts
from kvroute.perf.profile import HardwareProfile
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.step_gauge import VLLMStatsGauge

# prefills of 1 ms per token (a 1,000-token prompt: one 1 s step; budget 1,000 tokens a step), two batch slots
VLLM = HardwareProfile(name="unit", hardware="test", model="test", c0_s=0.0, c_prefill_s=1e-3, c_decode_s=0.01,
                       c_attn_s=0.0, c_prefill_attn_s=0.0, h_cv=0.0, kv_blocks=10000, block_size=16, max_running=2,
                       max_batched_tokens=1000, waiting_gauge="vllm")


def _seq(rid: str, base: int) -> Seq:
    return Seq(rid, 1000, 5, tuple(range(base, base + 62)), 16)


def test_an_arrival_during_a_step_does_not_show_one_left_out_shows_at_the_next_step_end():
    loop = EventLoop()
    e = Engine("e", VLLM, loop, lambda s, t: None, lambda s, t: None)
    assert isinstance(e.gauge, VLLMStatsGauge)
    e.submit(_seq("a", 0))  # a 1 s prefill step at once
    loop.at(0.5, lambda _: e.submit(_seq("b", 1000)))  # a slot is free: scheduled at the step's end
    loop.at(0.6, lambda _: e.submit(_seq("c", 2000)))  # both slots taken at that schedule: left waiting
    seen: dict[float, tuple[int, int, int]] = {}
    for t in (0.7, 1.2, 2.5):
        loop.at(t, lambda _, t=t: seen.__setitem__(t, (e.gauge.read(t), e.gauge.running, e.queued)))
    loop.run(until=2.6)
    assert seen[0.7] == (0, 0, 2)  # the live queue holds b and c; vLLM's stats are of no finished step yet
    assert seen[1.2] == (0, 1, 1)  # a's step ended before b and c entered the scheduler: none waited in it
    assert seen[2.5][0] == 1  # b's step (its schedule left c out: no slot) has ended: c shows


def test_calibrate_writes_the_gauge_of_the_engine_it_measured():
    assert _waiting_gauge([EngineFacts("http://v", 1.6, cache_block=16)]) == "vllm"
    assert _waiting_gauge([EngineFacts("http://l", 3.0, slots=4, cache_block=1)]) == "llama_server"
    assert _waiting_gauge([EngineFacts("http://s", 3.0)]) == "live"  # says neither (SGLang, others)
    assert Engine("v", VLLM.model_copy(update={"waiting_gauge": "live"}), EventLoop(),
                  lambda s, t: None, lambda s, t: None).gauge is None


def test_skywalker_keeps_more_turns_on_their_replica_with_vllms_gauge(tmp_path):
    """The fidelity bench's workload (12 users in 3 groups sharing ~1,200-token system prompts) on two
    engines sharing 2 cores with prefill steps of ~0.4 s: turns that arrive while their replica prefills
    another user's prompt went to the other replica (cold) when the probe read the live queue."""
    import yaml

    from kvroute.bench.fidelity import Workload, conversations, simulate

    slow = VLLM.model_copy(update={"c_prefill_s": 2.5e-4, "c0_s": 0.005, "max_running": 256,
                                   "max_batched_tokens": 2048})
    cold = {}
    for gauge in ("live", "vllm"):
        path = tmp_path / f"{gauge}.yaml"
        path.write_text(yaml.safe_dump(slow.model_copy(update={"waiting_gauge": gauge}).model_dump()))
        cold[gauge] = sum(simulate(conversations(Workload(system_tokens=1200, seed=seed), 4.0, f"s{seed}"),
                                   "skywalker", str(path), 2, 1.0, 16, tmp_path, seed, 2)["cold_requests"]
                          for seed in range(3))
    assert cold["vllm"] < cold["live"], cold
