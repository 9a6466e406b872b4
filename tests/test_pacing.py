"""Selective pushing: paced queue dispatch, room counted since the probe, SkyWalker's peer gate."""


import pytest
from conftest import MOONCAKE, make_request, needs_trace

from kvroute.model import Endpoint, EndpointKind
from kvroute.policy import DispatchPacer, Router, build_policy
from kvroute.policy.admission import PEER_QUEUE_LIMIT, peer_available, replica_available
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.simulation import Simulation


def test_pacer_allows_one_dispatch_per_tick():
    p = DispatchPacer(0.01)
    assert p.ready(0.0) and p.wait_s(0.0) == 0.0
    p.dispatched(0.0)
    assert not p.ready(0.005)
    assert p.wait_s(0.004) == pytest.approx(0.006)
    assert p.ready(0.01)
    p.dispatched(0.01)
    assert p.dispatches == 2 and not p.ready(0.0199)
    with pytest.raises(ValueError):
        DispatchPacer(-1)


def test_pending_gate_counts_dispatches_since_probe_against_free_slots():
    ep = Endpoint("r0", max_running=4)
    ep.apply_probe(running=2, waiting=0)
    assert replica_available(ep)
    ep.dispatched_since_probe = ep.inflight = 2  # two sent since the probe fill the two free slots
    assert not replica_available(ep)
    ep.inflight = 1  # one of them already finished: its slot is free again
    assert replica_available(ep)
    ep.apply_probe(running=2, waiting=0)
    assert replica_available(ep)
    ep.apply_probe(running=1, waiting=1)
    assert not replica_available(ep)


def test_pending_router_stops_pushing_once_the_probed_room_is_used():
    router = Router(build_policy("skywalker"), [Endpoint(f"r{i}", max_running=3) for i in range(2)])
    for ep in router.endpoints:
        ep.apply_probe(running=1, waiting=0)
    kinds = [router.route(make_request(f"q{i}", f"prompt {i}")).kind.value for i in range(6)]
    assert kinds == ["dispatch"] * 4 + ["hold"] * 2  # 2 free slots on each replica


@pytest.mark.parametrize("queue,local,avail,ok", [
    (0, 0, 1, True), (3, 2, 1, False), (3, 3, 1, True), (PEER_QUEUE_LIMIT + 1, 50, 1, False),
    (PEER_QUEUE_LIMIT, 50, 1, True), (0, 5, 0, False)])
def test_peer_gate_is_skywalkers_steal_condition(queue, local, avail, ok):
    peer = Endpoint("lb-eu", kind=EndpointKind.PEER, peer_queue=queue, peer_available=avail)
    assert peer_available(peer, local) is ok


def test_peer_router_reads_the_local_queue_from_its_view():
    router = Router(build_policy("skywalker"), [
        Endpoint("lb-eu", kind=EndpointKind.PEER, peer_queue=4, peer_available=2)])
    req = make_request("q", "hello")
    router.view.local_queue = 3
    assert router.decide(req).kind.value == "hold"
    router.view.local_queue = 4
    assert router.decide(req).target == "lb-eu"


def _burst_scenario(tick: float):
    return parse_scenario({
        "replicas": [{"region": "us", "count": 4, "profile": "l4-llama3.1-8b"}],
        "balancers": [{"region": "us", "dispatch_tick_s": tick}],
        "workload": {"kind": "chat-poisson", "rate": 200.0, "clients": {"us": 1}},
        "policies": ["skywalker"], "limits": {"max_requests": 300}, "seed": 2})


class _Timed(Simulation):
    """A simulation that notes the time of each dispatch (a subclass, not a patched instance: the
    compiled build's classes refuse new attributes, docs/compiled.md)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.times: list[float] = []

    def dispatch(self, flight, lb, rid, branch):
        self.times.append(self.loop.now)
        super().dispatch(flight, lb, rid, branch)


def test_simulated_balancer_dispatches_at_most_one_request_per_tick():
    sc = _burst_scenario(0.01)
    sim = _Timed(sc.setup(), "skywalker", None, sc.make_workload())
    times = sim.times
    result = sim.run()
    assert result["requests"] == 300 and len(times) == 300
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.01 - 1e-9
    assert result["max_lb_queue"] > 10  # the burst did queue


def test_unpaced_balancer_would_send_a_queue_in_one_instant():
    sc = _burst_scenario(0.0)
    sim = _Timed(sc.setup(), "skywalker", None, sc.make_workload())
    times = sim.times
    sim.run()
    assert len(times) - len(set(times)) > 10  # many dispatches share one instant without a pace


@needs_trace
def test_selective_pushing_keeps_up_with_round_robin_on_mooncake():
    """Issue 7's done-when, on the first 1,500 requests: throughput within 5 %, CV ≤ 1.3×.

    Pacing and the room counted since the probe are judged against an exact waiting count (the
    signal issue 7 was written for), so the engines export their queue live. With SGLang's own
    gauge (the L4 profile's default since issue 21, sim/queue_gauge.py) SkyWalker reaches 0.57
    req/s against round robin's 0.67 here: on this replay, ~1,200 s deep in overload, a replica's
    held queue stays hidden for up to 40 decode steps while the paced stream goes to it, which
    SkyWalker's own balancer does too (it counts nothing sent since the last probe)."""
    sc = parse_scenario({
        "replicas": [{"region": "us", "count": 8, "profile": "l4-llama3.1-8b", "waiting_gauge": "live"}],
        "workload": {"kind": "mooncake", "path": str(MOONCAKE)},
        "policies": ["round_robin", "skywalker", "skywalker_ch"],
        "limits": {"max_requests": 1500}, "seed": 1})
    rr, sky, ch = (r.result for r in run_scenario(sc))
    for r in (sky, ch):
        assert r["throughput_rps"] >= 0.95 * rr["throughput_rps"]
        assert r["imbalance_cv"] <= 1.3 * rr["imbalance_cv"]


def test_forward_gate_holds_only_what_a_peer_would_take_at_once():
    router = Router(build_policy("auto"), [Endpoint(f"r{i}", max_running=4) for i in range(2)])
    assert router.policy.admission.name == "forward" and not router.policy.admission.holds  # never paced
    for ep in router.endpoints:
        ep.apply_probe(running=2, waiting=1)  # no local replica admits (requests waiting on both)
    req = make_request("q", "hello " * 40)
    assert router.decide(req).dispatched  # no peers (one region): never held, blind pushing
    peer = Endpoint("lb-eu", kind=EndpointKind.PEER, peer_queue=0, peer_available=1)
    router.view.peers = [peer]
    assert router.decide(req).kind.value == "hold"  # a peer would take it now: hold, so it is forwarded
    peer.peer_queue = 1  # a queue at the peer: SkyWalker's condition with nothing behind fails
    assert router.decide(req).dispatched
    peer.peer_queue, peer.peer_available = 0, 0  # no available replica there
    assert router.decide(req).dispatched
    peer.peer_available = 1
    req.from_peer = True  # a forwarded request is never forwarded again
    assert router.decide(req).dispatched
    req.from_peer = False
    router.endpoints[0].apply_probe(running=2, waiting=0)  # a local replica admits again
    assert router.decide(req).dispatched


def test_two_layer_auto_forwards_from_an_overloaded_region_and_one_region_never_holds():
    common = {"replicas": [{"region": r, "count": 1, "profile": "a100-mistral-7b"} for r in ("us", "eu")],
              "network": {"rtt_ms": {"us-eu": 80}}, "workload": {"kind": "chat", "clients": {"us": 40, "eu": 2}},
              "limits": {"max_requests": 200}, "seed": 3}
    skewed = run_scenario(parse_scenario({**common, "topology": {"kind": "two-layer"}}))[0].result
    assert skewed["cross_region_forwards"] > 0  # the busy US region sends what it cannot admit to the idle EU
    assert skewed["lb_queue_s"]["p99"] == 0.0  # held only to be forwarded at once: nothing waits
    regional = run_scenario(parse_scenario({**common, "topology": {"kind": "regional"}}))[0].result
    assert regional["cross_region_forwards"] == 0 and regional["max_lb_queue"] <= 1  # no peers: never held
