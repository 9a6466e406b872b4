"""`kvroute bench fidelity`'s pipeline in front of emulated engines whose profile is known: the
live run (a `kvroute serve` process, streamed chat through it) and the simulator replay the same
scripted conversations. (Real llama-servers: `kvroute bench fidelity --url ...`, see README.)"""

import asyncio
import json
import threading
from dataclasses import replace

import pytest
from test_calibrate import KNOWN

from kvroute.bench.fidelity import Workload, conversations
from kvroute.cli import main
from kvroute.emulator.server import Faults, start_emulator


def test_conversations_are_scripted_groups_sharing_a_system_prompt():
    w = Workload(users=6, groups=3, system_tokens=200, turns=(4, 6), max_tokens=16)
    convs = conversations(w, bytes_per_token=4.0, salt="x")
    systems = [c[0]["content"] for c in convs]
    assert len(convs) == 6 and sorted(systems.count(x) for x in set(systems)) == [2, 2, 2]
    # the groups start in a random order (seeded), as independent users do, not g0, g1, g2, g0, ...
    orders = set()
    for seed in range(5):
        prompts = [c[0]["content"] for c in conversations(replace(w, seed=seed), 4.0, salt="x")]
        orders.add(tuple(prompts.index(x) for x in prompts))
    assert len(orders) > 1
    assert all(4 <= sum(m["role"] == "user" for m in c) <= 6 for c in convs)
    assert abs(len(convs[0][0]["content"]) / 4 - 200) < 20
    other = conversations(w, 4.0, salt="y")
    assert other[0][0] != convs[0][0]  # fresh prompts per run ...
    assert [c[1:] for c in other] == [c[1:] for c in convs]  # ... the same turns for every policy of a repeat


def _fidelity_cli(tmp_path, capsys) -> tuple[dict, str]:
    """`kvroute bench fidelity --repeats 2` (two policies, a small workload) against three emulators
    serving on a background event loop; its JSON and its table."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    emus = [call(start_emulator("127.0.0.1", 0, KNOWN, "llamacpp", Faults(close_after_stream=True)))
            for _ in range(3)]
    profile = tmp_path / "known.yaml"
    profile.write_text(KNOWN.model_dump_json())  # JSON is YAML
    try:
        urls = [x for _, _, p in emus for x in ("--url", f"http://127.0.0.1:{p}")]
        code = main(["bench", "fidelity", *urls, "--profile", str(profile), "--policies",
                     "round_robin,sglang_cache_aware", "--users", "6", "--groups", "2", "--system-tokens", "300",
                     "--min-turns", "2", "--max-turns", "3", "--max-tokens", "8", "--repeats", "2",
                     "--json", str(tmp_path / "out.json")])
        assert code == 0
        return json.loads((tmp_path / "out.json").read_text()), capsys.readouterr().out
    finally:
        for runner, _, _ in emus:
            call(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_live_and_simulated_runs_replay_the_same_requests(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the table on one line per row
    out, table = _fidelity_cli(tmp_path, capsys)
    assert out["repeats"] == 2 and set(out["policies"]) == {"round_robin", "sglang_cache_aware"}
    assert out["engine_noise"] is True  # the profile's measured noise (the known profile has none)
    for row in out["policies"].values():
        assert row["errors"] == {"live": 0, "sim": 0}
        for rep in row["repeats"]:
            live, sim = rep["live"], rep["sim"]
            assert live["requests"] == sim["requests"] == len(live["per_request"]) == len(sim["per_request"])
            # every live request knows its conversation, turn and replica (for pairing with the sim)
            users = {r[5] for r in live["per_request"]}
            assert users == set(range(6)) and all(r[7].startswith("engine-") for r in live["per_request"])
            turns = sorted(r[6] for r in live["per_request"] if r[5] == 0)
            assert turns == list(range(len(turns))) and 2 <= len(turns) <= 3
    assert 0 <= out["within_10pct"] <= out["within_20pct"] <= out["compared"] == 10
    assert "round_robin" in table and f"{out['within_20pct']} of 10 sim/live ratios" in table
    # the stored run re-simulated (`--replay`): its salts are stored, so the same profile gives the
    # same simulated side, request by request, against the same live numbers
    stored = tmp_path / "out.json"
    code = main(["bench", "fidelity", "--replay", str(stored), "--profile", str(tmp_path / "known.yaml"),
                 "--json", str(tmp_path / "again.json")])
    assert code == 0
    again = json.loads((tmp_path / "again.json").read_text())
    for policy, row in out["policies"].items():
        for rep, rep2 in zip(row["repeats"], again["policies"][policy]["repeats"], strict=True):
            assert rep2["live"] == rep["live"] and rep2["sim"]["per_request"] == rep["sim"]["per_request"]
    assert again["within_20pct"] == out["within_20pct"] and again["replayed_from"] == out["profile"]
    # each repeat's own sim/live per metric (bench/fidelity_spread.py): 2 policies x 2 repeats, printed
    assert out["spread"]["ttft_p50"]["runs"] == 4 and len(out["spread"]["e2e_p50"]["by_repeat"]) == 2
    assert "per run, TTFT p50: sim/live per run" in table and again["spread"] == out["spread"]
    assert main(["bench", "fidelity", "--replay", str(stored)]) == 2  # no --profile: a one-line error
    assert main(["bench", "fidelity", "--replay", str(tmp_path / "known.yaml"), "--profile",
                 str(tmp_path / "known.yaml")]) == 2  # not a fidelity JSON


def _admitted_cached(reuse: str) -> dict[str, int]:
    """Cached prompt tokens of b (admitted while a, with the same 512-token prefix, decodes) and
    of c (admitted after both finished)."""
    from kvroute.perf.loader import load_profile
    from kvroute.sim.engine import Engine, Seq
    from kvroute.sim.events import EventLoop

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
    two of three concurrent requests for a prefix one idle slot held were served from cache).
    a's slot holds much more than the prefix, so b, taking it by its common prefix, keeps under
    half of it and saves it to the host cache first (server-context.cpp get_available_slot,
    f_keep < 0.5), whence c, taking an empty slot, loads it (sim/slot_cache.py)."""
    from kvroute.perf.loader import load_profile
    from kvroute.sim.engine import Engine, Seq
    from kvroute.sim.events import EventLoop

    profile = load_profile("l4-llama3.1-8b").model_copy(update={"prefix_reuse": "idle_slots"})
    loop = EventLoop()
    first: dict[str, int] = {}
    engine = Engine("e", profile, loop, lambda s, t: first.setdefault(s.rid, s.cached), lambda s, t: None)
    prefix = tuple(range(1, 33))
    engine.submit(Seq("a", 1400, 2, (*prefix, *range(100, 150)), 16))
    loop.run()
    for i, rid in enumerate("bcd"):
        engine.submit(Seq(rid, 600, 2, (*prefix, 200 + i), 16))
    loop.run()
    assert sorted(first[r] for r in "bcd") == [0, 512, 512]


def test_engine_side_means_come_from_vllm_histogram_differences():
    """vLLM's stage histograms (queue, prefill, decode, API-server TTFT, steps) between two
    scrapes give the run's means; an engine without them (llama-server) gives nothing."""
    from kvroute.bench.fidelity_engines import WANTED, engine_side
    from kvroute.gateway.probes import parse_prometheus

    def exposition(n: int, queue: float, prefill: float, ttft: float, steps: int, tokens: int) -> dict[str, float]:
        text = "\n".join([
            f'vllm:request_queue_time_seconds_sum{{engine="0"}} {queue}', f"vllm:request_queue_time_seconds_count {n}",
            f"vllm:request_prefill_time_seconds_sum {prefill}", f"vllm:request_prefill_time_seconds_count {n}",
            f"vllm:time_to_first_token_seconds_sum {ttft}", f"vllm:time_to_first_token_seconds_count {n}",
            "vllm:time_to_first_token_seconds_created 17.0",  # not a sample of the histogram
            f"vllm:iteration_tokens_total_sum {tokens}", f"vllm:iteration_tokens_total_count {steps}"])
        return {k: sum(v) for k, v in parse_prometheus(text, WANTED).items()}

    before, after = exposition(10, 0.1, 0.5, 2.0, 100, 4000), exposition(30, 0.5, 1.5, 6.0, 300, 9000)
    side = engine_side(before, after)
    assert side["requests"] == 20 and side["queue_s"] == pytest.approx(0.02)
    assert side["prefill_s"] == pytest.approx(0.05) and side["ttft_s"] == pytest.approx(0.2)
    assert side["steps"] == 200 and side["tokens_per_step"] == pytest.approx(25)
    assert "decode_s" not in side and engine_side({}, {}) == {}


def test_fidelity_calibrates_engines_without_slots_with_longer_wider_decode_sweeps():
    """Decode contexts reach the workload's; llama-server (``/props`` says its slots) keeps the
    default batches, vLLM (no ``/props``) gets batches up to 8 and a 96-token window
    (bench/fidelity.py fidelity_sweep)."""
    from kvroute.bench.fidelity_calibration import fidelity_sweep
    from kvroute.calibrate import Sweep

    llama = fidelity_sweep({"total_slots": 4})
    assert llama.batch_sizes == Sweep().batch_sizes and llama.decode_tokens == Sweep().decode_tokens
    assert max(llama.contexts) >= 1800  # the workload's prompts: ~1,800 tokens
    for props in ({}, {"detail": "Not Found"}, None):
        sweep = fidelity_sweep(props)
        assert max(sweep.batch_sizes) >= 6 and sweep.decode_tokens == 96 and max(sweep.contexts) >= 1500
        assert sweep.prefill_lengths == Sweep().prefill_lengths  # only the decode sweep differs
