"""`kvroute bench fidelity`'s pipeline in front of emulated engines whose profile is known: the
live run (a `kvroute serve` process, streamed chat through it) and the simulator replay the same
scripted conversations. (Real llama-servers: `kvroute bench fidelity --url ...`, see README.)"""

import asyncio

from test_calibrate import KNOWN

from kvroute.bench.fidelity import Workload, conversations, run_fidelity
from kvroute.emulator.server import Faults, start_emulator


def test_conversations_are_scripted_groups_sharing_a_system_prompt():
    w = Workload(users=6, groups=3, system_tokens=200, turns=(4, 6), max_tokens=16)
    convs = conversations(w, bytes_per_token=4.0, salt="x")
    systems = [c[0]["content"] for c in convs]
    assert len(convs) == 6 and sorted(systems.count(x) for x in set(systems)) == [2, 2, 2]
    # the groups start in a random order (seeded), as independent users do, not g0, g1, g2, g0, ...
    assert [systems.index(x) for x in systems] != [0, 1, 2, 0, 1, 2]
    assert all(4 <= sum(m["role"] == "user" for m in c) <= 6 for c in convs)
    assert abs(len(convs[0][0]["content"]) / 4 - 200) < 20
    assert conversations(w, 4.0, salt="y")[0][0] != convs[0][0]  # fresh prompts per run


async def _run(tmp_path):
    emus = [await start_emulator("127.0.0.1", 0, KNOWN, "llamacpp", Faults(close_after_stream=True))
            for _ in range(3)]
    profile = tmp_path / "known.yaml"
    profile.write_text(KNOWN.model_dump_json())  # JSON is YAML
    try:
        w = Workload(users=6, groups=2, system_tokens=300, turns=(2, 3), max_tokens=8)
        return await run_fidelity([f"http://127.0.0.1:{p}" for _, _, p in emus], str(profile),
                                  ("round_robin", "sglang_cache_aware"), w)
    finally:
        for runner, _, _ in emus:
            await runner.cleanup()


def test_live_and_simulated_runs_replay_the_same_requests(tmp_path):
    out = asyncio.run(asyncio.wait_for(_run(tmp_path), 60))
    for policy, row in out["policies"].items():
        live, sim = row["live"], row["sim"]
        assert live["errors"] == sim["errors"] == 0 and live["requests"] == sim["requests"] >= 12, policy
        assert abs(live["token_ratio"] - 1) < 0.05  # the emulator counts bytes/4, as kvroute does
        assert abs(live["cached_share"] - sim["cached_share"]) < 0.15, (policy, live, sim)
        assert set(row["sim_over_live"]) == {"ttft_p50", "ttft_p99", "e2e_p50", "throughput", "cached_share"}
    assert out["policies"]["sglang_cache_aware"]["live"]["cached_share"] > 0.5
    live = out["policies"]["round_robin"]["live"]
    assert 0 <= live["gateway_cpu_share"] < 1 and 0 < live["client_cpu_share"] < 1  # what they take from the cores
    assert live["cold_requests"] >= 1 and live["ttft_cold_p50"] > 0 and live["decode_p50"] > 0
    assert sorted(out["ranking_ttft_p99"]["live"]) == sorted(out["ranking_ttft_p99"]["sim"])


def _admitted_cached(reuse: str) -> dict[str, int]:
    """Cached prompt tokens of b (admitted while a, with the same 512-token prefix, decodes) and
    of c (admitted after both finished)."""
    from kvroute.sim.engine import Engine, Seq
    from kvroute.sim.events import EventLoop
    from kvroute.sim.profile import load_profile

    profile = load_profile("l4-llama3.1-8b").model_copy(update={"prefix_reuse": reuse})
    loop = EventLoop()
    first: dict[str, int] = {}
    engine = Engine("e", profile, loop, lambda s, t: first.setdefault(s.rid, s.cached), lambda s, t: None)
    prefix = tuple(range(1, 33))  # 32 blocks of 16 tokens
    engine.submit(Seq("a", 600, 400, (*prefix, 100), 16))
    loop.run(stop=lambda: "a" in first)  # a has prefilled and decodes for a while
    engine.submit(Seq("b", 600, 4, (*prefix, 200), 16))
    loop.run()
    engine.submit(Seq("c", 600, 4, (*prefix, 300), 16))
    loop.run()
    return first


def test_llama_server_reuses_a_prefix_only_from_an_idle_slot():
    shared, slots = _admitted_cached("shared"), _admitted_cached("idle_slots")
    assert shared["b"] == 512 and shared["c"] == 512  # vLLM: any number of sequences share it
    assert slots["b"] == 0 and slots["c"] == 512  # llama-server: a's slot was busy, then free


def test_one_idle_slot_serves_two_concurrent_requests_then_its_prefix_is_gone():
    """llama-server: the slot's copy, then the old content it saved to the host cache (measured:
    two of three concurrent requests for a prefix one idle slot held were served from cache)."""
    from kvroute.sim.engine import Engine, Seq
    from kvroute.sim.events import EventLoop
    from kvroute.sim.profile import load_profile

    profile = load_profile("l4-llama3.1-8b").model_copy(update={"prefix_reuse": "idle_slots"})
    loop = EventLoop()
    first: dict[str, int] = {}
    engine = Engine("e", profile, loop, lambda s, t: first.setdefault(s.rid, s.cached), lambda s, t: None)
    prefix = tuple(range(1, 33))
    engine.submit(Seq("a", 600, 2, (*prefix, 100), 16))
    loop.run()
    for i, rid in enumerate("bcd"):
        engine.submit(Seq(rid, 600, 2, (*prefix, 200 + i), 16))
    loop.run()
    assert sorted(first[r] for r in "bcd") == [0, 512, 512]
