"""`kvroute live` end to end on a tiny scenario (real processes on 127.0.0.1), its fault flags,
and its bad input."""

from __future__ import annotations

import json
import os

import pytest

from kvroute.cli import main
from kvroute.live.clients import render_prompt
from kvroute.live.faults import Fault, parse_fault
from kvroute.live.run import Topology, routing_mode
from kvroute.model import Request
from kvroute.prefix import BlockHasher, chat_key
from kvroute.workload.base import SimRequest

SCENARIO = """\
name: live smoke
seed: 2
network: {rtt_ms: {a-b: 40}}
replicas:
  - {region: a, count: 1, profile: h100-llama3.2-3b}
  - {region: b, count: 1, profile: h100-llama3.2-3b}
workload: {kind: chat, clients: {a: 3, b: 1}}
policies: [{preset: round_robin, topology: two-layer}]
limits: {max_requests: 6}
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it is gone once its parent reaped it, which run_live does
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] == "Z"


def test_a_short_live_run_end_to_end_with_a_gateway_killed_and_restarted(tmp_path):
    path = tmp_path / "smoke.yaml"
    path.write_text(SCENARIO)
    out = tmp_path / "live.json"
    assert main(["live", str(path), "--kill", "gateway:a@0.3s+0.4s", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    r = rep["results"]["round_robin@two-layer"]
    assert r["issued"] == 6
    assert r["requests"] + sum(r["failed"].values()) + r["live"]["unfinished"] == 6
    assert r["requests"] >= 1 and r["ttft_s"]["p50"] > 0 and r["output_tps"] > 0
    assert set(r["failed"]) <= {"cut mid-stream"}  # nothing lost before it streamed
    faults = r["live"]["faults"]
    assert faults[0]["fault"] == "kill gateway:a@0.3s+0.4s" and "restarted" in faults[1]
    assert faults[1]["restarted"] != faults[0]["pid"]
    assert len(rep["pids"]) == 2 + 2 + 1 + 1  # replicas, gateways, controller, the restarted gateway
    assert all(_gone(pid) for pid in rep["pids"])
    row = rep["compare"]["table"]["round_robin@two-layer"]  # the simulated twin, side by side
    assert row["requests"]["live"] == r["requests"] and row["ttft_p50_s"]["sim"] > 0


def test_fault_flags_parse_and_bad_ones_name_the_flag():
    assert parse_fault("kill", "gateway:us@10s+5s") == Fault("kill", "gateway", "us", 10.0, 5.0)
    assert parse_fault("pause", "replica:eu-0@2.5") == Fault("pause", "replica", "eu-0", 2.5, None)
    assert parse_fault("kill", "controller@3s").kind == "controller"
    for bad in ("gateway:us", "router:x@1s", "controller:x@1s", "gateway@1s", "gateway:us@soon"):
        with pytest.raises(ValueError, match="--kill"):
            parse_fault("kill", bad)


def test_live_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "smoke.yaml"
    path.write_text(SCENARIO)
    assert main(["live", str(path), "--kill", "gateway:us@nope"]) == 2
    assert "--kill" in capsys.readouterr().err
    assert main(["live", str(tmp_path / "missing.yaml")]) == 2
    assert "no such scenario" in capsys.readouterr().err
    assert main(["live", str(path), "--kill", "replica:zz-9@1s"]) == 2
    err = capsys.readouterr().err
    assert "replica:zz-9" in err and "a-0" in err and len(err.strip().splitlines()) == 1


def test_prompts_share_text_exactly_where_the_workload_shares_blocks():
    base = Request("r1", block_hashes=(11, 22, 33), block_tokens=64, prompt_tokens=64 * 3 + 10)
    turn = Request("r2", block_hashes=(11, 22, 44), block_tokens=64, prompt_tokens=64 * 3)
    a, b = render_prompt(SimRequest(base, 5)), render_prompt(SimRequest(turn, 5))
    assert len(a) == base.prompt_tokens * 4 and len(b) == turn.prompt_tokens * 4
    shared = len(os.path.commonprefix([a, b]))
    assert 2 * 256 <= shared < 3 * 256
    hasher = BlockHasher(64)
    ha, _ = hasher(chat_key([{"role": "user", "content": a}]))
    hb, _ = hasher(chat_key([{"role": "user", "content": b}]))
    common = len(os.path.commonprefix([ha, hb]))
    assert common >= 1 and common < min(len(ha), len(hb))  # the gateway sees the shared head, not more


def test_topologies_map_to_gateway_routing_modes():
    two = Topology({"a": ["a"], "b": ["b"]}, "two-layer", True)
    assert routing_mode(two, "skywalker") == "skywalker"
    assert routing_mode(two, "gorgo") == "gorgo_distributed"  # GORGO v1 §3.3, the simulator's GorgoPeering
    assert routing_mode(Topology({"a": ["a", "b"]}, "global", False), "gorgo") == "gorgo_proxy"
    assert routing_mode(Topology({"a": ["a", "b"]}, "global", False), "round_robin") == "local"
    assert routing_mode(Topology({"a": ["a"], "b": ["b"]}, "regional", False), "skywalker") == "local"


def test_the_live_size_scenario_keeps_the_skew_and_the_three_policies():
    from kvroute.sim.scenario import load_scenario

    sc = load_scenario("live-3region-skewed")
    sc.setup()
    assert [e.label for e in sc.policy_list()] == ["round_robin@regional", "skywalker@two-layer", "gorgo@global"]
    clients = sc.clients()
    assert clients["us"] == 3 * clients["eu"] == 3 * clients["asia"]


def test_a_paused_child_answers_nothing_until_resumed_and_every_pid_is_stopped(tmp_path):
    import asyncio

    import aiohttp

    from kvroute.processes import Fleet

    async def run() -> list[int]:
        fleet = Fleet(tmp_path)
        child = fleet.add("replica x", ["emulate", "--port", "0", "--profile", "h100-llama3.2-3b"])
        try:
            await fleet.start([child.name])
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                async with s.get(f"{child.url}/health") as r:
                    assert r.status == 200
                child.pause()
                with pytest.raises(TimeoutError):
                    async with s.get(f"{child.url}/health") as r:
                        pass
                child.resume()
                async with s.get(f"{child.url}/health") as r:
                    assert r.status == 200
        finally:
            await fleet.stop_all()
        assert not child.alive and (tmp_path / "replica_x.log").read_text().count("on http://127.0.0.1:")
        return fleet.all_pids()

    pids = asyncio.run(asyncio.wait_for(run(), 30))
    assert len(pids) == 1 and _gone(pids[0])


def test_each_policy_gets_the_simulators_balancer_layout_as_gateways():
    from kvroute.live.run import topology_of
    from kvroute.sim.scenario import load_scenario, parse_scenario

    sc = load_scenario("chat-3region-skewed")
    layouts = {e.label: topology_of(sc, e) for e in sc.policy_list()}
    assert layouts["round_robin@global"].gateways == {"us": ["us", "eu", "asia"]}
    sky = layouts["skywalker"]
    assert (sky.kind, sky.forward, sorted(sky.gateways)) == ("two-layer", True, ["asia", "eu", "us"])
    assert routing_mode(sky, "skywalker") == "skywalker"
    by_hand = parse_scenario({"replicas": [{"region": "a"}, {"region": "b"}],
                              "balancers": [{"region": "a", "forward": True}, {"region": "b", "forward": True}],
                              "policies": ["skywalker"]})
    (entry,) = by_hand.policy_list()
    assert topology_of(by_hand, entry).kind == "two-layer"
