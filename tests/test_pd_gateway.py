"""Prefill/decode disaggregation through the gateway, end to end over real HTTP on 127.0.0.1:
the openai SDK → kvroute → emulated prefill and decode engines speaking vLLM's
(kv_transfer_params) and SGLang's (bootstrap room) protocols (gateway/pd.py, emulator/pd.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import openai
import pytest

from kvroute.emulator.server import Faults, start_emulator
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.replicas import ReplicaConfig
from kvroute.yamlconf import ConfigFileError, validate

PROFILE = "h100-llama3.2-3b"
PROMPT = "you are a careful assistant; " * 40


class PDDeployment:
    """Prefill and decode emulators and a gateway with `pd:`, on a background loop."""

    def __init__(self, protocol: str, prefill: int = 1, decode: int = 1, mixed: int = 0,
                 disaggregate: object = "always", **gateway):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.emus = {}
        engine = "sglang" if protocol == "sglang" else "vllm"
        replicas = []
        for role, n in (("prefill", prefill), ("decode", decode), ("mixed", mixed)):
            for i in range(n):
                boot = 0 if engine == "sglang" and role == "prefill" else None
                runner, emu, port = self.call(start_emulator("127.0.0.1", 0, PROFILE, engine, Faults(),
                                                             pd_role=role, bootstrap_port=boot))
                name = f"{role[0]}{i}"
                self.emus[name] = (runner, emu, port)
                replicas.append(ReplicaConfig(url=f"http://127.0.0.1:{port}", id=name, role=role,
                                              bootstrap_port=emu.pd.bootstrap_port))
        pd = {"protocol": protocol, "disaggregate": disaggregate}
        self.config = GatewayConfig(host="127.0.0.1", port=0, replicas=replicas, pd=pd, **gateway)
        self.gw = Gateway(self.config)
        self.call(self.gw.start())
        self.url = f"http://127.0.0.1:{self.gw.port}"

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=20)

    def emu(self, name: str):
        return self.emus[name][1]

    def fault(self, name: str, **faults) -> None:
        self.emu(name).faults.update(faults)

    def settled(self, timeout: float = 5.0) -> bool:
        rt = self.gw.runtime
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not rt.router.tickets and not rt.router.prefill.tickets \
                    and all(e.inflight == 0 and e.queued_prefill_tokens == 0 for e in rt.router.all_endpoints):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.call(self.gw.stop())
        for runner, _, _ in self.emus.values():
            self.call(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(params=["vllm", "sglang"])
def pd(request):
    dep = PDDeployment(request.param)
    yield dep
    dep.close()


def test_a_split_request_streams_from_the_decode_engine_after_a_kv_transfer(pd):
    """Chat streamed and not, completions: the answer comes from the decode engine, the prefill
    engine computed the prompt (max_tokens 1) and the decode engine received the KV once."""
    client = pd.client()
    chunks = list(client.chat.completions.create(model="emulated", stream=True, max_tokens=12,
                                                 messages=[{"role": "user", "content": PROMPT + "stream"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    raw = client.chat.completions.with_raw_response.create(
        model="emulated", max_tokens=5, messages=[{"role": "user", "content": PROMPT + "whole"}])
    assert raw.headers["x-kvroute-replica"] == "d0" and raw.headers["x-kvroute-prefill"] == "p0"
    answer = raw.parse()
    assert answer.usage.completion_tokens == 5 and answer.usage.prompt_tokens > 200
    done = client.completions.create(model="emulated", prompt=PROMPT + "completion", max_tokens=3)
    assert len(done.choices[0].text.split()) == 3
    p, d = pd.emu("p0"), pd.emu("d0")
    assert p.requests_total == 3 and p.generation_tokens_total == 3  # one token per prefill leg
    assert d.pd.transfers == 3 and d.requests_total == 3
    assert pd.settled()
    branches = pd.gw.runtime.router.policy_state()
    assert branches["pd.split"] == 3 and branches["pd.local"] == 0


def test_the_decode_engine_needs_the_prefill_engines_kv(pd):
    """The protocol is really spoken: a decode leg whose KV is nowhere fails (vLLM: no offer under
    that id; SGLang: a room whose prefill failed), answered with an error, not a hang."""
    d = pd.emus["d0"][2]

    async def post(body):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{d}/v1/chat/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status, await r.json()

    body = {"model": "emulated", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    if pd.config.pd.protocol == "vllm":
        body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                      "remote_request_id": "nope", "remote_engine_id": pd.emu("p0").pd.engine_id,
                                      "remote_host": "127.0.0.1", "remote_port": pd.emus["p0"][2]}
    else:
        room = 12345

        async def fail_room():
            pd.emu("p0").pd._sglang_prefill(room).failed("test")
        pd.call(fail_room())
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=pd.emu("p0").pd.bootstrap_port, bootstrap_room=room)
    status, answer = pd.call(post(body))
    assert status == 500 and "KV" in answer["error"]["message"], answer


def test_a_failed_prefill_leg_is_retried_on_another_prefill_engine():
    """p0 answers 500: the attempt fails naming the prefill engine and is retried with p1; with
    every prefill engine failing, the client gets a 502 that names the prefill leg."""
    for protocol in ("vllm", "sglang"):
        dep = PDDeployment(protocol, prefill=2, decode=1, retry={"backoff_s": 0.0})
        try:
            dep.fault("p0", fail_rate=1.0)
            client = dep.client()
            for i in range(4):
                raw = client.chat.completions.with_raw_response.create(
                    model="emulated", max_tokens=3, messages=[{"role": "user", "content": f"{PROMPT} {i}"}])
                assert raw.parse().usage.completion_tokens == 3
            assert dep.emu("p1").requests_total == 4
            dep.fault("p1", fail_rate=1.0)
            started = time.monotonic()
            messages = [{"role": "user", "content": PROMPT + " last"}]
            if protocol == "vllm":  # vLLM's decode engines (kv_both) serve alone: llm-d's decode-only fallback
                raw = client.chat.completions.with_raw_response.create(model="emulated", max_tokens=3,
                                                                        messages=messages)
                assert raw.headers["x-kvroute-replica"] == "d0" and raw.parse().usage.completion_tokens == 3
                assert dep.emu("d0").pd.transfers == 4
            else:  # SGLang's decode engines cannot: the last prefill failure answers
                with pytest.raises(openai.APIStatusError) as err:
                    client.chat.completions.create(model="emulated", max_tokens=3, stream=True, messages=messages)
                assert err.value.status_code == 502 and "prefill engine p" in str(err.value), err.value
            assert time.monotonic() - started < 5
            assert dep.settled()
        finally:
            dep.close()


def test_a_client_that_leaves_mid_stream_cancels_the_decode_leg(pd):
    """Disconnecting mid-stream closes the decode engine's request; nothing stays in flight."""
    async def leave():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{pd.url}/v1/chat/completions",
                              json={"model": "emulated", "stream": True, "max_tokens": 4000,
                                    "messages": [{"role": "user", "content": PROMPT}]}) as r:
                assert r.status == 200
                await r.content.readline()
    pd.call(leave())
    assert pd.settled()
    deadline = time.monotonic() + 5
    while pd.emu("d0").engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pd.emu("d0").engine.running == 0


def test_conditional_disaggregation_keeps_short_prompts_on_the_decode_engine():
    """llm-d's threshold: a prompt with fewer uncached tokens than the threshold is served by the
    decode engine alone (no prefill leg, vLLM's kv_both engines can), a long one is split."""
    dep = PDDeployment("vllm", disaggregate={"pd_uncached_at_least": 150})
    try:
        client = dep.client()
        client.chat.completions.create(model="emulated", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert dep.emu("p0").requests_total == 0 and dep.emu("d0").pd.transfers == 0
        client.chat.completions.create(model="emulated", max_tokens=2,
                                       messages=[{"role": "user", "content": PROMPT}])
        assert dep.emu("p0").requests_total == 1 and dep.emu("d0").pd.transfers == 1
        state = dep.gw.runtime.router.policy_state()
        assert (state["pd.local"], state["pd.split"]) == (1, 1)
    finally:
        dep.close()


def test_a_mixed_engine_can_prefill_for_a_decode_engine_and_serve_alone():
    """vLLM deployments may mix: a mixed engine is on both sides; embeddings-like requests that
    cannot be split go whole to the decode side."""
    dep = PDDeployment("vllm", prefill=0, decode=1, mixed=1)
    try:
        client = dep.client()
        for i in range(4):
            client.chat.completions.create(model="emulated", max_tokens=2,
                                           messages=[{"role": "user", "content": f"{PROMPT} {i}"}])
        router = dep.gw.runtime.router
        assert {e.id for e in router.prefill.endpoints} == {"m0"}
        assert {e.id for e in router.endpoints} == {"d0", "m0"}
        state = router.policy_state()
        assert state["pd.split"] + state["pd.local"] == 4
        assert dep.emu("d0").pd.transfers == state["pd.split"]
        assert dep.settled()
    finally:
        dep.close()


@pytest.mark.parametrize("replicas, pd, fragment", [
    ([{"url": "http://a:1", "role": "prefill"}, {"url": "http://b:1", "role": "prefill"}], {"protocol": "vllm"},
     "prefill engines are declared but no decode"),
    ([{"url": "http://a:1", "role": "decode"}], {"protocol": "sglang"},
     "decode engines are declared but no prefill"),
    ([{"url": "http://a:1", "role": "decode"}, {"url": "http://b:1", "role": "prefill"}], None,
     "role decode needs a `pd:` section"),
    ([{"url": "http://a:1", "role": "decode"}, {"url": "http://b:1", "role": "prefill"}],
     {"protocol": "sglang", "disaggregate": {"pd_uncached_at_least": 10}}, "use disaggregate: always"),
    ([{"url": "http://a:1"}], {"protocol": "vllm"}, "no replica has role prefill or decode"),
])
def test_a_one_sided_pd_config_is_one_line_naming_its_line(tmp_path, replicas, pd, fragment):
    """Prefill engines without decode engines (or the reverse) are rejected at load: one line,
    file:line of the offending replica's role."""
    data = {"replicas": replicas, **({"pd": pd} if pd else {})}
    path = tmp_path / "gw.yaml"
    import yaml

    text = yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    with pytest.raises(ConfigFileError) as err:
        validate(GatewayConfig, yaml.safe_load(text), str(path), text)
    msg = str(err.value)
    assert "\n" not in msg and fragment in msg and f"{path}:" in msg, msg
    line = int(msg.split(f"{path}:")[1].split(":")[0])
    assert line >= 1


def test_the_cli_rejects_a_one_sided_config_with_exit_2(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "gw.yaml"
    path.write_text("pd: {protocol: vllm}\nreplicas:\n  - {url: 'http://127.0.0.1:9', role: prefill}\n")
    out = subprocess.run([sys.executable, "-m", "kvroute", "serve", "--config", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out
    assert f"{path}:3" in out.stderr and "no decode" in out.stderr and "Traceback" not in out.stderr
    assert json.dumps  # (keeps the json import used where the file grows)
