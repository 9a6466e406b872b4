"""Defect 5 of issue 12: a replica added mid-run gets no traffic from cache-following policies
when every request shares a system prompt. The warm-up rule (policy/builtin/warmup.py) gives it a
way in; checked live (gateway in front of emulated engines) and on the pure rule."""

import asyncio
import random

import aiohttp
import pytest

from kvroute.emulator.server import Faults, start_emulator
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.model import Endpoint, Request
from kvroute.policy import Router, build_policy
from kvroute.prefix import BlockHasher, chat_key
from kvroute.replicas import ReplicaConfig

SYSTEMS = [f"group {g}: " + "you are a helpful assistant with a long shared system prompt. " * 30 for g in range(3)]
PROFILE = "h100-llama3.2-3b"  # answers in milliseconds: hundreds of requests in a few seconds


async def _user(session, url, u, stop, seen, stats):
    rng = random.Random(u)
    messages = [{"role": "system", "content": SYSTEMS[u % 3]}]
    while not stop.is_set():
        messages.append({"role": "user", "content": f"user {u} asks {rng.random()}"})
        async with session.post(f"{url}/v1/chat/completions",
                                json={"model": "emulated", "messages": messages, "max_tokens": 4}) as r:
            body = await r.json()
            assert r.status == 200, body
            seen.append((asyncio.get_running_loop().time(), r.headers["x-kvroute-replica"]))
            stats[0] += body["usage"]["prompt_tokens"]
            stats[1] += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        if len(messages) > 12:  # a new conversation in the same group
            messages = messages[:1]


async def _run(policy) -> tuple[float, float, float]:
    """(share of the answers from the new replica's first one on that it served, the same in the
    last two fifths of them, the cached-token share of the whole run)."""
    emus = [await start_emulator("127.0.0.1", 0, PROFILE, "vllm", Faults()) for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for _, _, p in emus]
    gw = Gateway(GatewayConfig(host="127.0.0.1", port=0, policy=policy, replica_header=True,
                               replicas=[ReplicaConfig(url=u, id=f"r{i}") for i, u in enumerate(urls[:3])]))
    await gw.start()
    seen: list[tuple[float, str]] = []
    stats = [0, 0]
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession() as session:
            users = [asyncio.create_task(_user(session, f"http://127.0.0.1:{gw.port}", u, stop, seen, stats))
                     for u in range(12)]
            # counted in answers, not seconds: on a loaded machine a second holds few of them
            await _until(lambda: len(seen) >= WARM)
            gw.runtime.add_replica(ReplicaConfig(url=urls[3], id="new"))
            # its first request comes some time after it joins (about 0.8 s here unloaded, seconds on a
            # loaded machine); its share is counted from there, in answers rather than seconds
            await _until(lambda: any(r == "new" for _, r in seen[WARM:]))
            added = next(i for i in range(WARM, len(seen)) if seen[i][1] == "new")
            await _until(lambda: len(seen) >= added + AFTER)
            stop.set()
            await asyncio.gather(*users)
    finally:
        await gw.stop()
        for runner, _, _ in emus:
            await runner.cleanup()
    after = [r for _, r in seen[added:]]
    last = after[len(after) * 3 // 5:]
    return after.count("new") / len(after), last.count("new") / len(last), stats[1] / stats[0]


WARM, AFTER = 150, 600  # answers before the replica joins, and counted from its first one


async def _until(done) -> None:
    """Poll until ``done()`` holds (the caller's wait_for bounds the time)."""
    while not done():
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("preset", ["sglang_cache_aware", "gorgo"])
def test_a_replica_added_mid_run_gets_a_fair_share_and_the_cache_still_works(preset):
    """Without the rule the new replica gets (almost) nothing, as issue 12 saw (the pure test
    below shows it; measured here with warm_up false: 0.0 for both presets). The rule is off by
    default in both presets (neither the papers nor SGLang's router has it): switched on here."""
    share, last_share, hit = asyncio.run(asyncio.wait_for(_run({"preset": preset, "params": {"warm_up": True}}), 60))
    assert last_share >= 0.15, (share, last_share)  # a fair share is 0.25, reached soon after joining
    assert hit > 0.8, hit


def _request(rid: str, system: str, user: str) -> Request:
    key = chat_key([{"role": "system", "content": system}, {"role": "user", "content": user}])
    hashes, tokens = BlockHasher()(key)
    return Request(id=rid, prompt_key=key, block_hashes=hashes, prompt_tokens=tokens)


@pytest.mark.parametrize("preset", ["sglang_cache_aware", "gorgo"])
def test_warm_up_lets_a_cold_replica_in_then_affinity_keeps_it_busy(preset):
    assert not build_policy(preset).params.warm_up  # off unless asked for (issue 21)
    router = Router(build_policy(preset, {"warm_up": True}), [Endpoint("a"), Endpoint("b")])
    systems = [f"group {g}: " + "a shared system prompt " * 1000 for g in range(2)]  # 90 blocks each
    for i in range(8):  # each group settles on one replica, 4 in flight each
        router.route(_request(f"w{i}", systems[i % 2], f"warm {i}"))
    router.add_endpoint(Endpoint("new"))
    decisions = [router.route(_request(f"n{i}", systems[i % 2], f"next {i}")) for i in range(8)]
    to_new = [d for d in decisions if d.target == "new"]
    assert decisions[0].target == "new" and decisions[0].branch == "warm-up"
    assert len(to_new) >= 3  # then followers of the prefix it now holds, by load among holders
    assert router.endpoint("new").inflight <= 4  # filled to the others' level, no further
    # a fleet starting together is not cold: the rule waits for the others to hold min_blocks
    fresh = Router(build_policy(preset, {"warm_up": True}), [Endpoint("x"), Endpoint("y")])
    assert fresh.route(_request("f", "short", "q")).branch != "warm-up"
    off = Router(build_policy(preset, {"warm_up": False}), [Endpoint("a"), Endpoint("b")])
    for i in range(8):
        off.route(_request(f"w{i}", systems[i % 2], f"warm {i}"))
    off.add_endpoint(Endpoint("new"))
    assert all(off.route(_request(f"n{i}", systems[i % 2], f"x {i}")).target != "new" for i in range(8))
