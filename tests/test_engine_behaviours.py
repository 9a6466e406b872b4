"""What real engines do that the emulator now reproduces (issue 12), and how the gateway copes:
fast restarts, llama-server's keep-alive and disconnect habits, its metric set, vLLM's KV usage."""

import asyncio
import time

import aiohttp
import httpx
import openai
import pytest

from kvroute.emulator.realtime import RealtimeLoop
from kvroute.emulator.server import Faults, start_emulator
from kvroute.emulator.text import emulated_text
from kvroute.gateway.probes import parse_prometheus, read_indicators
from kvroute.prefix import chat_key
from tests.gateway_harness import LiveDeployment, settled

SYSTEM = "You answer questions about the storage cluster. " * 40


@pytest.fixture
def live():
    with settled(replicas=2, policy="sglang_cache_aware",
                 probe={"interval_s": 0.05, "timeout_s": 0.5}) as dep:
        yield dep


def chat(dep, turn: int, **kw):
    c = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=20)
    return c.chat.completions.with_raw_response.create(
        model="emulated", max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {turn}"}], **kw)


def metric(dep, name: str, replica: str) -> float | None:
    for line in httpx.get(f"{dep.url}/metrics").text.splitlines():
        if line.startswith(f'{name}{{replica="{replica}"'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_fast_restart_is_detected_and_the_replicas_cache_forgotten(live):
    replica = chat(live, 0).headers["x-kvroute-replica"]
    i = int(replica.rsplit("-", 1)[1])
    rt = live.runtime
    assert live.call(_blocks(rt, replica)) > 0
    emu = live.dep.emulators[i][1]
    live.loop.call_soon_threadsafe(emu.restart)  # back within 0.2 s: probes never fail
    deadline = time.monotonic() + 5
    while metric(live, "kvroute_replica_restarts_total", replica) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(live, "kvroute_replica_restarts_total", replica) == 1
    assert live.call(_blocks(rt, replica)) == 0
    assert chat(live, 1).headers["x-kvroute-replica"] is not None


async def _blocks(rt, replica):
    return rt.router.prefix.blocks(replica)


def test_probed_indicators_are_exported_per_replica(live):
    chat(live, 0)
    time.sleep(0.2)
    for r in ("emulated-0", "emulated-1"):
        assert metric(live, "kvroute_replica_running", r) == 0
        assert metric(live, "kvroute_replica_waiting", r) == 0
        assert 0 <= metric(live, "kvroute_replica_kv_usage", r) < 0.01  # idle: nothing held
        assert metric(live, "kvroute_replica_probe_rtt_seconds", r) > 0
    assert 'kvroute_replica_engine{engine="vllm",replica="emulated-0"} 1.0' in httpx.get(f"{live.url}/metrics").text


def test_llamacpp_emulation_exports_llama_servers_metric_set():
    async def scrape():
        runner, _, port = await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", "llamacpp")
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
                return await r.text()
        finally:
            await runner.cleanup()
    text = asyncio.run(scrape())
    assert "llamacpp:requests_processing" in text and "llamacpp:prompt_tokens_total" in text
    assert "kv_cache_usage" not in text  # llama-server 0.3.36 exports none
    assert read_indicators(parse_prometheus(text)).kv_usage is None


def test_keep_alive_that_is_not_honoured_costs_no_request(live):
    for i in range(2):
        live.fault(i, close_after_stream=True)
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=20)
    for turn in range(15):
        stream = c.chat.completions.create(model="emulated", max_tokens=3, stream=True,
                                           messages=[{"role": "user", "content": f"q {turn}"}])
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == emulated_text(chat_key([{"role": "user", "content": f"q {turn}"}]), 3)
    assert all(u.breaker.failures == 0 for u in live.runtime.upstreams.values())


@pytest.mark.parametrize("bad", [{"slowdown": 0}, {"slowdown": -1}, {"fail_rate": 2}, {"hang": "yes"},
                                 {"close_after_tokens": -3}, {"typo": 1}])
def test_emulator_refuses_bad_faults_naming_the_field(live, bad):
    r = httpx.post(f"{live.emulator_url(0)}/_fault", json=bad)
    assert r.status_code == 400 and next(iter(bad)) in r.json()["error"]["message"]
    assert httpx.post(f"{live.emulator_url(0)}/_fault", json={"slowdown": 1.0}).status_code == 200


def test_emulator_clock_never_runs_backwards_when_the_pace_changes():
    clock = RealtimeLoop(slowdown=1.0)
    time.sleep(0.05)
    before = clock.now
    clock.slowdown = 20.0
    assert clock.now >= before
    clock.slowdown = 0.5
    assert clock.now >= before
    with pytest.raises(ValueError, match="slowdown"):
        Faults().update({"slowdown": 0})


def prefix_hit_ratio(dep) -> float:
    line = next(x for x in httpx.get(f"{dep.url}/metrics").text.splitlines()
                if x.startswith("kvroute_prefix_hit_ratio "))
    return float(line.split()[1])


def test_hit_ratio_is_counted_for_presets_that_do_not_match_prefixes():
    dep = LiveDeployment(replicas=2, policy="round_robin")
    try:
        for _ in range(4):  # round robin: the 3rd and 4th land where the 1st and 2nd warmed the cache
            chat(dep, 0)
        assert 0.4 < prefix_hit_ratio(dep) < 0.6
    finally:
        dep.settle()
        dep.close()


def test_a_request_the_engine_refused_is_neither_indexed_nor_counted(live):
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=20)
    with pytest.raises(openai.BadRequestError, match="exceed"):
        c.completions.create(model="emulated", prompt=SYSTEM, max_tokens=2_000_000_000)
    rt = live.runtime

    async def indexed():
        hashes, _ = live.dep.gateway.proxy.hasher(SYSTEM)
        return rt.router.prefix.match(hashes), rt.prompt_tokens_routed
    matches, routed = live.call(indexed())
    assert matches == {} and routed == 0


def counter(dep, prefix: str) -> float:
    return sum(float(x.rsplit(" ", 1)[1]) for x in httpx.get(f"{dep.url}/metrics").text.splitlines()
               if x.startswith(prefix))


def test_a_stream_the_client_abandons_is_still_counted_and_timed(live):
    live.fault(0, slowdown=20.0)
    live.fault(1, slowdown=20.0)
    requests0, e2e0 = counter(live, "kvroute_requests_total{"), counter(live, "kvroute_e2e_seconds_count")
    with httpx.stream("POST", f"{live.url}/v1/completions", timeout=10,
                      json={"prompt": "walk away", "max_tokens": 200, "stream": True}) as r:
        next(r.iter_lines())  # the first event, then hang up like guidellm after what it needed
    deadline = time.monotonic() + 5
    while counter(live, "kvroute_requests_total{") < requests0 + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter(live, "kvroute_requests_total{") == requests0 + 1
    assert counter(live, "kvroute_e2e_seconds_count") == e2e0 + 1


def test_prefix_index_is_bounded_by_the_engines_kv_capacity(live):
    rt = live.runtime
    emu_capacity = live.dep.emulators[0][1].engine.capacity

    async def capacity():
        return rt.router.prefix.capacity("emulated-0")
    assert live.call(capacity()) == emu_capacity // 16 * 16 // rt.config.block_tokens  # from vLLM's metrics
    from kvroute.gateway.config import GatewayConfig
    from kvroute.gateway.runtime import Runtime
    configured = Runtime(GatewayConfig(replicas=[{"url": "http://127.0.0.1:9", "id": "a", "kv_tokens": 6400}]))
    assert configured.router.prefix.capacity("a") == 100  # 6,400 tokens / 64-token blocks
