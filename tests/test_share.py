"""Distributed load balancers that share their dispatches (topology ``share``, sim/share.py): each LB
mirrors the others' requests into its own accounting one WAN hop after they happen, for every preset."""

import pytest

from kvroute.cli import main
from kvroute.sim.runner import run_scenario
from kvroute.sim.scenario import ScenarioError, parse_scenario
from kvroute.sim.simulation import Simulation


def three_regions(policies=("least_request",), **topology):
    return parse_scenario({
        "network": {"rtt_ms": {"us-eu": 80, "us-asia": 150, "eu-asia": 200}, "in_region_ms": 2},
        "replicas": [{"region": r, "count": 2, "profile": "l4-llama3.1-8b"} for r in ("us", "eu", "asia")],
        "topology": {"kind": "distributed", **topology},
        "workload": {"kind": "rag", "rate": 3, "clients": {"us": 3, "eu": 1, "asia": 1}},
        "policies": list(policies), "limits": {"max_requests": 150}, "seed": 4})


class Watched(Simulation):
    """Checks, around each US dispatch, when the other balancers' Routers account for it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.checks: list[tuple[str, bool]] = []

    def dispatch(self, flight, lb, rid, branch):
        super().dispatch(flight, lb, rid, branch)
        if lb.id != "lb-us":
            return
        key = f"lb-us/{flight.sreq.req.id}"
        now = self.loop.now
        for other in self.lbs:
            if other is lb:
                continue
            hop = self.network.one_way("us", other.region) + 2 * self.network.one_way("us", "us")
            self.loop.at(now + hop - 1e-6, self._check, (other, key, "before"))
            self.loop.at(now + hop + 1e-6, self._check, (other, key, "after"))

    def _check(self, arg):
        other, key, when = arg
        self.checks.append((when, key in other.router.tickets))


def test_each_balancer_mirrors_the_others_dispatches_one_wan_hop_later():
    sc = three_regions(share=True)
    sim = Watched(sc.setup(), "least_request", None, sc.make_workload())
    result = sim.run()
    assert result["requests"] == 150
    before = [seen for when, seen in sim.checks if when == "before"]
    after = [seen for when, seen in sim.checks if when == "after"]
    assert before and not any(before)  # not before the message can have arrived ...
    assert sum(after) >= 0.9 * len(after)  # ... and there after it (unless the request finished already)
    for lb in sim.lbs:  # every mirrored request left again: the counters are back to zero
        assert not lb.router.tickets and lb.sharer is not None and not lb.sharer.ledger.mirrored()
        assert all(ep.inflight == 0 and ep.queued_prefill_tokens == 0 for ep in lb.router.endpoints)
    assert sum(lb.sharer.messages for lb in sim.lbs) >= 2 * 150  # an add and a free per request (+ prefills)


def test_sharing_is_off_by_default_and_changes_what_every_preset_sees():
    off = three_regions().setup().balancers
    assert all(b.share_interval_s is None for b in off)
    assert {b.share_interval_s for b in three_regions(share=True, share_interval_s=0.05).setup().balancers} == {0.05}
    for preset in ("least_request", "lmetric"):
        plain = run_scenario(three_regions((preset,)))[0].result
        shared = run_scenario(three_regions((preset,), share=True))[0].result
        again = run_scenario(three_regions((preset,), share=True))[0].result
        assert shared["requests"] == plain["requests"] == 150
        assert shared["ttft_s"] == again["ttft_s"]  # deterministic
        assert shared["ttft_s"] != plain["ttft_s"]  # the mirrored load is routed on


def test_a_publish_interval_batches_the_messages():
    sc = three_regions(share=True, share_interval_s=0.05)
    sim = Simulation(sc.setup(), "least_request", None, sc.make_workload())
    assert sim.run()["requests"] == 150
    assert all(not lb.router.tickets for lb in sim.lbs)


@pytest.mark.parametrize("topology", [{"kind": "two-layer", "share": True}, {"kind": "regional", "share": True}])
def test_sharing_needs_the_distributed_topology(topology, tmp_path, capsys):
    sc = three_regions()
    data = sc.model_dump(exclude_none=True)
    data["topology"] = topology
    with pytest.raises(ScenarioError, match="topology.share"):
        parse_scenario(data).setup()
    bad = tmp_path / "s.yaml"
    bad.write_text(f"replicas: [{{region: us}}, {{region: eu}}]\ntopology: {{kind: {topology['kind']}, share: true}}\n")
    assert main(["simulate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "topology.share" in err and "Traceback" not in err
