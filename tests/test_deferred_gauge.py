"""llama-server's waiting gauge (sim/deferred_gauge.py): requests_deferred counts only requests that
found no free slot when the engine's loop took them up between steps, not arrivals during a step
that will take a free slot at its end; and a simulated balancer knows an engine's batch limit only
where the deployment says it (``batch_limit_known``: a gateway learns none from llama-server)."""

from kvroute.perf.profile import HardwareProfile
from kvroute.sim.deferred_gauge import DeferredGauge
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop

# prefills of 1 ms per token (a 1,000-token prompt: one 1 s step), two slots
LLAMA = HardwareProfile(name="unit", hardware="test", model="test", c0_s=0.0, c_prefill_s=1e-3, c_decode_s=0.01,
                        c_attn_s=0.0, c_prefill_attn_s=0.0, h_cv=0.0, kv_blocks=10000, block_size=16, max_running=2,
                        prefix_reuse="idle_slots", waiting_gauge="llama_server")


def _seq(rid: str, base: int) -> Seq:
    return Seq(rid, 1000, 5, tuple(range(base, base + 62)), 16)


def test_an_arrival_during_a_step_is_not_deferred_one_without_a_slot_is():
    loop = EventLoop()
    e = Engine("e", LLAMA, loop, lambda s, t: None, lambda s, t: None)
    assert isinstance(e.gauge, DeferredGauge)
    e.submit(_seq("a", 0))  # starts a 1 s prefill step at once
    loop.at(0.5, lambda _: e.submit(_seq("b", 1000)))  # a free slot is left: taken at the step's end
    loop.at(0.6, lambda _: e.submit(_seq("c", 2000)))  # both slots taken at that end: deferred then
    seen: dict[float, tuple[int, int, int]] = {}
    for t in (0.7, 1.2):
        loop.at(t, lambda _, t=t: seen.__setitem__(t, (e.gauge.read(t), e.gauge.running, e.queued)))
    loop.run(until=1.5)
    assert seen[0.7] == (0, 1, 2)  # the live queue holds b and c; llama-server defers neither yet
    assert seen[1.2] == (1, 2, 1)  # at the step's end b took the free slot and c found none


def test_the_gauge_is_the_profiles_choice():
    loop = EventLoop()
    assert Engine("v", LLAMA.model_copy(update={"waiting_gauge": "live"}), loop,
                  lambda s, t: None, lambda s, t: None).gauge is None


def test_a_balancer_told_no_batch_limit_assumes_none():
    from kvroute.sim.scenario import parse_scenario
    from kvroute.sim.simulation import Simulation

    def limits(known: bool | None) -> list[int]:
        group = {"region": "us", "count": 2, "profile": "l4-llama3.1-8b", "max_running": 4}
        if known is not None:
            group["batch_limit_known"] = known
        sc = parse_scenario({"replicas": [group], "workload": {"kind": "chat", "clients": {"us": 2}},
                             "policies": ["skywalker"], "seed": 1})
        sim = Simulation(sc.setup(None), "skywalker", None, sc.make_workload())
        return [e.max_running for lb in sim.lbs for e in lb.router.all_endpoints]

    assert limits(None) == limits(True) == [4, 4]  # the default: the profile's (or group's) limit
    assert limits(False) == [256, 256]  # Endpoint's default: none known
