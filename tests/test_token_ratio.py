"""Defect 9 of issue 12: the gateway's bytes/4 token estimate is corrected online from the
engines' own ``usage.prompt_tokens`` (gateway/tokens.py), in front of emulated engines whose
tokenizer counts 3 bytes per token."""

import asyncio
import json

import openai
import pytest

from kvroute.emulator.server import Faults, start_emulator
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.openai import PROXIED
from kvroute.gateway.server import Gateway
from kvroute.gateway.tokens import HIGH, TokenRatio, reported_prompt_tokens
from kvroute.replicas import ReplicaConfig

BYTES_PER_TOKEN = 3.0  # the emulated tokenizer; kvroute's estimate assumes 4


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": f"conversation {i}: " + "a shared system prompt. " * 60},
            {"role": "user", "content": f"question {i} " * (10 + i)}]


async def _run() -> tuple[float, list[tuple[int, int]], int]:
    emus = [await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", "llamacpp", Faults(close_after_stream=True),
                                 bytes_per_token=BYTES_PER_TOKEN) for _ in range(2)]
    gw = Gateway(GatewayConfig(host="127.0.0.1", port=0, policy="sglang_cache_aware", replicas=[
        ReplicaConfig(url=f"http://127.0.0.1:{p}", id=f"e{i}", engine="llamacpp") for i, (_, _, p) in enumerate(emus)]))
    await gw.start()
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="x", max_retries=0)
        for i in range(12):  # half streamed (usage in the last chunk), half not
            if i % 2:
                async for _ in await client.chat.completions.create(model="m", messages=_messages(i),
                                                                    max_tokens=2, stream=True):
                    pass
            else:
                await client.chat.completions.create(model="m", messages=_messages(i), max_tokens=2)
        pairs = []  # (the gateway's estimate, the engine's count) for prompts it has not seen
        for i in range(100, 104):
            body = {"model": "m", "messages": _messages(i), "max_tokens": 1}
            _, req = gw.proxy.parse(json.dumps(body).encode(), PROXIED["/v1/chat/completions"], {})
            r = await client.chat.completions.create(**body)
            pairs.append((req.prompt_tokens, r.usage.prompt_tokens))
        await gw.runtime.prober.probe_all()  # the index's block worth follows the ratio on a probe round
        return gw.runtime.tokens.scale, pairs, gw.runtime.router.index_block_tokens
    finally:
        await gw.stop()
        for runner, _, _ in emus:
            await runner.cleanup()


def test_estimate_converges_to_the_engines_count():
    scale, pairs, block_tokens = asyncio.run(asyncio.wait_for(_run(), 30))
    assert abs(scale - 4 / BYTES_PER_TOKEN) < 0.03
    for estimate, engine in pairs:  # bytes/4 alone would be 25 % low
        assert abs(estimate - engine) <= 0.02 * engine, pairs
    assert block_tokens == round(64 * 4 / BYTES_PER_TOKEN)  # a 256-byte block now holds 85 tokens


async def _forgetting() -> list[tuple[set[str], set[str]]]:
    emus = [await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", "llamacpp", Faults(),
                                 bytes_per_token=BYTES_PER_TOKEN) for _ in range(2)]
    replicas = [ReplicaConfig(url=f"http://127.0.0.1:{p}", id=f"e{i}", engine="llamacpp")
                for i, (_, _, p) in enumerate(emus)]
    config = GatewayConfig(host="127.0.0.1", port=0, policy="round_robin", replicas=replicas)
    gw = Gateway(config)
    await gw.start()
    rt, seen = gw.runtime, []
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="x", max_retries=0)
        for i in range(4):  # round robin: both replicas answer
            await client.chat.completions.create(model="m", messages=_messages(i), max_tokens=1)
        seen.append((set(rt.tokens.ratios), set(rt.drained)))
        rt.upstreams["e0"].reading.prompt_tokens_total = 1e12  # its counter goes back: a restart
        await rt.prober.probe_all()
        rt.set_drained("e1", True)
        seen.append((set(rt.tokens.ratios), set(rt.drained)))
        rt.reconfigure(config.model_copy(update={"replicas": replicas[:1]}))  # a reload without e1
        seen.append((set(rt.tokens.ratios), set(rt.drained)))
        return seen
    finally:
        await gw.stop()
        for runner, _, _ in emus:
            await runner.cleanup()


def test_a_restarted_or_reloaded_away_replica_loses_its_ratio_and_drained_mark():
    seen = asyncio.run(asyncio.wait_for(_forgetting(), 20))
    assert seen == [({"e0", "e1"}, set()), ({"e1"}, {"e1"}), (set(), set())]


def test_ratio_is_an_ewma_per_replica_bounded_and_forgotten():
    r = TokenRatio(alpha=0.5)
    r.observe("a", 100, 120)
    assert r.scale == 1.2 and r.tokens(100) == 120
    r.observe("a", 100, 100)
    assert r.ratios["a"] == 1.1
    r.observe("b", 100, 10_000)  # a broken count is clamped, not believed
    assert r.ratios["b"] == HIGH
    r.observe("c", 3, 300)  # too short to say anything
    assert "c" not in r.ratios
    r.forget("b")
    assert r.scale == 1.1 and r.block_tokens(64) == 70
    assert r.tokens(0) == 0


def test_reported_prompt_tokens_reads_the_last_usage():
    tail = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens": 1234,"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    assert reported_prompt_tokens(tail) == 1234
    assert reported_prompt_tokens(b'{"usage": {"prompt_tokens":7, "total_tokens": 9}}') == 7
    assert reported_prompt_tokens(b"data: [DONE]\n\n") is None


def test_reported_counts_agree_with_a_full_scan():
    """The last-occurrence shortcut gives what scanning every match gives, including when the
    field's last occurrence carries no count (then an earlier one answers)."""
    import re

    from kvroute.gateway.tokens import reported_completion_tokens

    bodies = [b'{"usage":{"prompt_tokens":5,"completion_tokens":3}}',
              b'{"a":{"prompt_tokens": 11},"usage":{"prompt_tokens" :  12 ,"completion_tokens":\n4}}',
              b'{"usage":{"prompt_tokens":7},"later":{"prompt_tokens":null,"completion_tokens":"x"}}',
              b'{"prompt_tokens":null}', b'"prompt_tokens"', b"", b'{"completion_tokens":9,"prompt_tokens":1}',
              b'{"prompt_tokens"\x0b:\x0c007,"completion_tokens" : 0}', b'{"prompt_tokens": 12x, "completion_tokens":}',
              b'{"prompt_tokens":3}{"prompt_tokens": -4}', b'{"completion_tokens":5, "x": "completion_tokens"}',
              b'data: {"usage":{"prompt_tokens":8,"completion_tokens":1}}\n\ndata: {"prompt_tokens"}\n\n']
    readers = ((b"prompt_tokens", reported_prompt_tokens), (b"completion_tokens", reported_completion_tokens))
    for body in bodies:
        for field, fn in readers:
            found = re.findall(rb'"' + field + rb'"\s*:\s*(\d+)', body)
            assert fn(body) == (int(found[-1]) if found else None), (field, body)


def test_openai_trace_counts_engine_tokens_with_the_ratio(tmp_path):
    from kvroute.sim.scenario import ScenarioError, parse_scenario
    from kvroute.workload.traces import OpenAIConversations

    conv = {"messages": [{"role": "system", "content": "s " * 400}, {"role": "user", "content": "q " * 50},
                         {"role": "assistant", "content": "a long answer " * 20}, {"role": "user", "content": "more"}],
            "max_tokens": 16}
    trace = tmp_path / "c.jsonl"
    trace.write_text(json.dumps(conv) + "\n")
    plain = OpenAIConversations(trace, {"local": 1}).queues["local"][0].turns
    scaled = OpenAIConversations(trace, {"local": 1}, token_ratio=1.25).queues["local"][0].turns
    for (a, out_a, _), (b, out_b, engine_blocks) in zip(plain, scaled, strict=True):
        assert b.prompt_tokens == round(a.prompt_tokens * 1.25) and b.block_tokens == 80
        assert b.block_hashes == a.block_hashes  # blocks stay byte spans: the same hashes
        assert out_a == out_b == 16  # the line's max_tokens caps the scripted answer (an engine stops there)
        assert engine_blocks is None  # without engine_block_tokens the engine caches the index's blocks
    bad = {"replicas": [{"region": "local", "count": 1}], "workload": {"kind": "chat", "token_ratio": 1.2}}
    with pytest.raises(ScenarioError, match="token_ratio"):
        parse_scenario(bad).make_workload()


def test_engines_cache_prefixes_in_their_own_block_size(tmp_path):
    """Issue 21: a real engine reuses a cached prefix in its own unit (vLLM: its 32-token blocks;
    llama-server: any common prefix), not in the router's 64-token index blocks; with
    ``engine_block_tokens`` the simulated engine does too, and a second turn finds the whole first
    prompt cached instead of the first prompt cut to a 64-token block."""
    from kvroute.sim.runner import run_scenario
    from kvroute.sim.scenario import ScenarioError, parse_scenario
    from kvroute.workload.traces import OpenAIConversations

    conv = {"messages": [{"role": "system", "content": "shared words " * 300}, {"role": "user", "content": "q " * 50},
                         {"role": "assistant", "content": "an answer " * 20}, {"role": "user", "content": "more " * 9}],
            "max_tokens": 4}
    trace = tmp_path / "c.jsonl"
    trace.write_text(json.dumps(conv) + "\n")
    (r1, _, e1), (r2, _, e2) = OpenAIConversations(trace, {"local": 1}, token_ratio=1.25,
                                                   engine_block_tokens=1).queues["local"][0].turns
    assert e1 is not None and e2 is not None and e1[1] == e2[1] == 1
    assert e2[0][:len(e1[0])] == e1[0]  # the second prompt extends the first, block for block
    assert abs(len(e1[0]) - r1.prompt_tokens) <= 1 and abs(len(e2[0]) - r2.prompt_tokens) <= 1
    assert r2.block_hashes[:len(r1.block_hashes)] == r1.block_hashes and r1.block_tokens == 80  # index unchanged

    def cached(block: int | None) -> list[int]:
        sc = parse_scenario({"replicas": [{"region": "local", "count": 1, "profile": "l4-llama3.1-8b"}],
                             "workload": {"kind": "openai", "path": str(trace), "clients": {"local": 1},
                                          "token_ratio": 1.25, "engine_block_tokens": block},
                             "policies": ["round_robin"]})
        return list(run_scenario(sc)[0].recorder.cached_tokens)

    index_blocks, own = cached(None), cached(1)
    assert own[1] >= r1.prompt_tokens - 1  # the whole first prompt
    assert index_blocks[1] % 80 == 0 and index_blocks[1] < own[1] - 10  # whole 80-token index blocks only
    assert cached(32)[1] % 32 == 0 and cached(32)[1] > r1.prompt_tokens - 32  # vLLM: whole 32-token blocks
    bad = {"replicas": [{"region": "local", "count": 1}], "workload": {"kind": "chat", "engine_block_tokens": 1}}
    with pytest.raises(ScenarioError, match="engine_block_tokens"):
        parse_scenario(bad).make_workload()
