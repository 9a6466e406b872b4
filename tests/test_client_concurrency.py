"""Open-loop clients with a fixed number of workers (``workload.concurrency``) and a scenario's choice of
engine scheduler (``replicas[].admission``): GORGO v2's released replay client keeps at most 64 requests in
flight and times each from its send (proxy/workload_core.py); its engines ran SGLang."""

import pytest

from kvroute.sim.scenario import ScenarioError, parse_scenario
from kvroute.sim.simulation import Simulation


def burst(**workload):
    """200 short requests offered at 40 req/s to one small replica: far past what it serves."""
    return parse_scenario({
        "replicas": [{"region": "us", "count": 1, "profile": "h100-llama3.2-3b"}],
        "workload": {"kind": "chat-poisson", "rate": 40.0, "clients": {"us": 1}, **workload},
        "policies": ["round_robin"], "limits": {"max_requests": 200}, "seed": 3})


class Watched(Simulation):
    """Records the most requests ever in flight between the clients and the engines."""

    peak = 0

    def issue(self, sreq):
        super().issue(sreq)
        self.peak = max(self.peak, self.outstanding)


def run(sc):
    sim = Watched(sc.setup(), "round_robin", None, sc.make_workload())
    return sim, sim.run()


def test_a_capped_client_keeps_its_requests_in_flight_under_the_cap_and_times_them_from_the_send():
    free_sim, free = run(burst())
    capped_sim, capped = run(burst(concurrency=4))
    assert capped_sim.peak == 4 < free_sim.peak
    assert capped["requests"] == free["requests"] == capped["issued"] == 200  # every held arrival is sent
    # the wait for a free worker is not in TTFT (the released client starts its clock at the send) ...
    assert capped["ttft_s"]["p95"] < free["ttft_s"]["p95"] / 2
    # ... but the run takes as long as serving them one worker-slot at a time does
    assert capped["sim_time_s"] >= free["sim_time_s"] * 0.9


def test_a_scenario_picks_the_engines_scheduler_over_the_profiles():
    group = {"region": "us", "count": 1, "profile": "h20-qwen3-30b-a3b"}
    for override, want in ((None, "vllm"), ("sglang", "sglang")):
        sc = parse_scenario({"replicas": [{**group, "admission": override} if override else group],
                             "workload": {"kind": "chat", "clients": {"us": 1}}, "policies": ["round_robin"]})
        assert sc.setup().replicas[0].profile.admission == want
    with pytest.raises(ScenarioError, match="admission"):
        parse_scenario({"replicas": [{**group, "admission": "tgi"}], "workload": {"kind": "chat"}})
