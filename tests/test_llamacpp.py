"""The real-engine tier: kvroute in front of real llama.cpp servers, driven with the openai SDK.

`llama-server` is built once from the llama.cpp vendored in llama-cpp-python's sdist and cached
outside the work tree (tests/llamacpp/build.py: ~5 minutes on 2 cores the first time, then
instant); a tiny random-weight GGUF is written per session (tests/llamacpp/tiny_model.py). The
engines run on 127.0.0.1 with one thread each; the gateway runs in this process on a background
event loop. Nothing is skipped: if the build fails, every test here errors with the reason.

Each test starts its own engines (0.1 s each) so caches start cold, and stops them by PID.
Every wait is bounded: clients have timeouts and no retries, polls have deadlines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.replicas import ReplicaConfig
from tests.gateway_harness import wait_healthy
from tests.llamacpp import build
from tests.llamacpp.engine import MODEL_ALIAS, LlamaServer
from tests.llamacpp.tiny_model import WORDS, write_tiny_gguf

MODEL = MODEL_ALIAS
CLIENT_TIMEOUT = 30.0


# --- fixtures ------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def llama_server_binary(request) -> Path:
    """Builds on a fresh machine (~7 min on 2 cores, progress on the terminal); a failed build raises
    `BuildError` with the tool's output, so every test here errors with the reason (never a skip)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def log(line: str) -> None:
        if capture is None:
            print(line, file=sys.stderr, flush=True)
            return
        with capture.global_and_fixture_disabled():  # past pytest's output capture
            print(line, file=sys.stderr, flush=True)

    return build.ensure_llama_server(log=log)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf")


@pytest.fixture
def engines(llama_server_binary, tiny_gguf, tmp_path) -> Iterator[Callable[..., list[LlamaServer]]]:
    """`engines(n)` starts n llama-servers (healthy on return); all are stopped at teardown."""
    started: list[LlamaServer] = []

    def start(n: int, *extra: str) -> list[LlamaServer]:
        new = [LlamaServer(llama_server_binary, tiny_gguf, tmp_path, f"llama-{len(started) + i}", extra)
               for i in range(n)]
        for e in new:
            started.append(e)
            e.start()
        return new

    yield start
    for e in started:
        e.stop()


class LiveGateway:
    """A kvroute gateway on a background event loop, in front of the given engines."""

    def __init__(self, engines: list[LlamaServer], policy: str | dict = "round_robin", **overrides):
        overrides.setdefault("probe", {"interval_s": 0.1, "timeout_s": 0.5, "unhealthy_after": 2})
        overrides.setdefault("timeouts", {"connect_s": 1.0, "first_byte_s": 10.0, "idle_s": 10.0})
        self.config = GatewayConfig(host="127.0.0.1", port=0, policy=policy, access_log=False,
                                    replicas=[ReplicaConfig(url=e.url, id=e.name) for e in engines],
                                    **overrides)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateway = Gateway(self.config)
        port = self.call(self.gateway.start())
        self.url = f"http://127.0.0.1:{port}"
        self.runtime = self.gateway.runtime

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def wait_healthy(self, n: int, timeout: float = 10.0) -> int:
        return wait_healthy(self.url, n, timeout)

    def close(self) -> None:
        if not self.thread.is_alive():
            return
        try:
            self.call(self.gateway.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@pytest.fixture
def gateway() -> Iterator[Callable[..., LiveGateway]]:
    made: list[LiveGateway] = []

    def make(engines: list[LlamaServer], policy: str | dict = "round_robin", **overrides) -> LiveGateway:
        gw = LiveGateway(engines, policy, **overrides)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.close()


def sample(text: str, name: str, labels: str = "") -> float | None:
    """The value of one Prometheus sample, e.g. sample(m, "kvroute_inflight", 'replica="a"')."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(?:\{\})?") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def system_prompt(seed: int, words: int = 1480) -> str:
    """A fresh (never-seen) system prompt of about `words` tokens in the tiny model's vocabulary."""
    rng = random.Random(seed)
    return f"session {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def chat(user: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


# --- the build cache ----------------------------------------------------------------------------------------

def test_concurrent_callers_build_llama_server_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_CACHE", str(tmp_path))
    monkeypatch.delenv("KVROUTE_LLAMA_SERVER", raising=False)
    builds = []

    def fake_build(version: str, dest: Path, log) -> None:
        builds.append(version)
        time.sleep(0.3)
        dest.write_text("#!/bin/sh\n")
        dest.chmod(0o755)

    monkeypatch.setattr(build, "_build", fake_build)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: build.ensure_llama_server("9.9.9"), range(3)))
    assert builds == ["9.9.9"]
    assert paths == [tmp_path / "llama.cpp" / "9.9.9" / "llama-server"] * 3
    monkeypatch.setenv("KVROUTE_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(build.BuildError, match="not an executable"):
        build.ensure_llama_server()


# --- the OpenAI API through the gateway ----------------------------------------------------------------

def test_openai_sdk_chat_and_completions_stream_and_not(engines, gateway):
    eng = engines(2)
    gw = gateway(eng)
    c = gw.client()
    names = {e.name for e in eng}

    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=chat("hello there"), max_tokens=12,
                                                      temperature=0)
    assert raw.headers["x-kvroute-replica"] in names
    r = raw.parse()
    assert r.choices[0].finish_reason == "length"  # the tiny model never emits EOS
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 5
    text = r.choices[0].message.content
    assert text and text.isprintable()
    again = c.chat.completions.create(model=MODEL, messages=chat("hello there"), max_tokens=12, temperature=0)
    assert again.choices[0].message.content == text  # greedy decoding is deterministic

    stream = c.chat.completions.create(model=MODEL, messages=chat("hello there"), max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    r = c.completions.create(model=MODEL, prompt="once upon a time", max_tokens=7, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=7, temperature=0, stream=True) if ch.choices)
    assert streamed == r.choices[0].text and streamed

    assert MODEL in [m.id for m in c.models.list().data]  # passed through from an engine
    seen = {c.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}", max_tokens=1)
            .headers["x-kvroute-replica"] for i in range(4)}
    assert seen == names  # round robin reaches both engines


# --- routing that follows the engine's cache --------------------------------------------------------------

def _conversation(gw: LiveGateway, system: str, turns: int) -> list[tuple[str, int, int]]:
    """(replica, prompt_tokens, cached_tokens) per turn of one streamed multi-turn chat."""
    c = gw.client()
    messages = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: how do I route this request?"})
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
        chunks = list(raw.parse())
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out.append((raw.headers["x-kvroute-replica"], usage.prompt_tokens, cached or 0))
        messages.append({"role": "assistant",
                         "content": "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)})
    return out


def test_cache_following_routing_really_reuses_the_engine_cache(engines, gateway):
    eng = engines(3)
    turns = 4
    rr_gw = gateway(eng, "round_robin")
    rr = _conversation(rr_gw, system_prompt(1), turns)
    rr_gw.close()
    aware = _conversation(gateway(eng, "sglang_cache_aware"), system_prompt(2), turns)

    assert aware[0][1] > 1450  # the shared system prompt is ~1,500 tokens
    assert len({rep for rep, _, _ in aware}) == 1, aware  # x-kvroute-replica stable across turns
    for (_, prev_prompt, _), (_, _, cached) in zip(aware, aware[1:]):
        assert cached >= 0.9 * prev_prompt, aware  # the whole previous turn was reused on the engine

    assert len({rep for rep, _, _ in rr[:3]}) == 3, rr  # round robin moves every turn
    assert all(cached < 100 for _, _, cached in rr[1:3]), rr  # to engines that never saw the prompt
    share = [sum(c for _, _, c in run) / sum(p for _, p, _ in run) for run in (rr, aware)]
    assert share[1] > share[0] + 0.3, share


# --- probes read llama.cpp's metrics -----------------------------------------------------------------------

def test_probes_read_llamacpp_metrics_and_inflight_returns_to_zero(engines, gateway):
    eng = engines(2)
    gw = gateway(eng, "least_request")
    assert gw.wait_healthy(2) == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until every replica has been probed and detected
        m = gw.metrics()
        if all(sample(m, "kvroute_replica_healthy", f'replica="{e.name}"') == 1.0 for e in eng) and \
                all(f'replica="{e.name}"' in m and 'engine="llamacpp"' in m for e in eng):
            break
        time.sleep(0.05)
    for e in eng:
        assert sample(m, "kvroute_replica_healthy", f'replica="{e.name}"') == 1.0, m
    assert 'engine="llamacpp"' in m, m  # detected from llamacpp:requests_processing / requests_deferred

    c = gw.client()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: c.completions.with_raw_response.create(
            model=MODEL, prompt=f"load {i} " + "token " * 200, max_tokens=24), range(6)))
    assert {r.headers["x-kvroute-replica"] for r in results} == {e.name for e in eng}

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = gw.metrics()
        idle = [sample(m, "kvroute_inflight", f'replica="{e.name}"') for e in eng]
        running = [sample(m, "kvroute_replica_running", f'replica="{e.name}"') for e in eng]
        if idle == [0.0] * len(eng) and running == [0.0] * len(eng):
            break
        time.sleep(0.05)
    assert idle == [0.0] * len(eng), m
    assert running == [0.0] * len(eng), m  # the probes saw llamacpp:requests_processing back at 0
    for e in eng:
        engine_metrics = httpx.get(f"{e.url}/metrics", timeout=5).text
        assert sample(engine_metrics, "llamacpp:requests_processing") == 0.0
        assert sample(engine_metrics, "llamacpp:prompt_tokens_total") > 0


# --- faults ------------------------------------------------------------------------------------------------

def _raw_stream(url: str) -> tuple[bytes, bytes]:
    """One streamed completion over a raw keep-alive socket: (response head, what followed [DONE])."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while b"[DONE]" not in data:
            piece = s.recv(65536)
            assert piece, data
            data += piece
        head, _, rest = data.partition(b"\r\n\r\n")
        s.settimeout(3)
        tail = rest[rest.index(b"[DONE]"):]
        try:
            while piece := s.recv(65536):
                tail += piece
            closed = True
        except TimeoutError:
            closed = False
    assert closed, "llama-server kept the connection open after a stream (the fault this test covers is gone)"
    return head, tail


def _wait_idle(engine: LlamaServer, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        m = httpx.get(f"{engine.url}/metrics", timeout=5).text
        if sample(m, "llamacpp:requests_processing") == 0.0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_llama_server_habits_the_gateway_must_handle(engines):
    """What this llama.cpp does, asserted directly (the emulator's llama.cpp mode copies it):
    a 200 head long before the first token, no KV-usage gauge or start time in /metrics, and a
    non-stream request that keeps generating after its client left."""
    (eng,) = engines(1)
    host, port = eng.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": system_prompt(4, 3000), "max_tokens": 2, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        arrivals = []
        data = b""
        while b"data: " not in data:
            piece = s.recv(65536)
            assert piece, data
            data += piece
            arrivals.append((time.monotonic() - t0, b"\r\n\r\n" in data, b"data: " in data))
    head_at = next(t for t, head, _ in arrivals if head)
    first_token_at = next(t for t, _, token in arrivals if token)
    assert first_token_at - head_at > 0.1, arrivals  # the head went out before the ~3,000-token prefill

    m = _wait_idle(eng)
    assert sample(m, "llamacpp:requests_processing") == 0.0 and sample(m, "llamacpp:requests_deferred") == 0.0
    assert "kv_cache_usage" not in m and "process_start_time_seconds" not in m, m

    before = sample(m, "llamacpp:tokens_predicted_total") or 0.0
    with pytest.raises(httpx.TimeoutException):  # the client gives up long before 1,500 tokens
        httpx.post(f"{eng.url}/v1/completions", json={"prompt": "left", "max_tokens": 1500}, timeout=0.2)
    # generated to the end anyway: read until the engine's own count is 1,500 more (it counts a
    # request when it ends), not after a fixed sleep — on a loaded machine the engine may not
    # have taken the request up yet, and an idle read then ends the wait at once
    deadline = time.monotonic() + 30
    while sample(m, "llamacpp:tokens_predicted_total") - before < 1500 and time.monotonic() < deadline:
        time.sleep(0.05)
        m = httpx.get(f"{eng.url}/metrics", timeout=5).text
    assert sample(m, "llamacpp:tokens_predicted_total") - before == 1500, m
    assert sample(_wait_idle(eng), "llamacpp:requests_processing") == 0.0


def test_engine_closing_after_every_stream_despite_keepalive_costs_nothing(engines, gateway):
    (eng,) = engines(1)
    head, _ = _raw_stream(eng.url)  # the engine's behaviour, seen directly: Keep-Alive advertised, then EOF
    assert b"keep-alive" in head.lower(), head

    gw = gateway([eng], "round_robin", breaker={"failures": 1, "cooldown_s": 30.0})
    breaker = gw.runtime.upstreams[eng.name].breaker
    failures: list[float] = []
    record = breaker.failure
    breaker.failure = lambda now: (failures.append(now), record(now))[-1]  # type: ignore[method-assign]

    def one(client: httpx.Client, i: int) -> tuple[int, bool]:
        with client.stream("POST", f"{gw.url}/v1/chat/completions",
                           json={"model": MODEL, "messages": chat(f"stream {i}"), "max_tokens": 4,
                                 "stream": True}) as r:
            body = r.read().decode()
        return r.status_code, body.rstrip().endswith("data: [DONE]") and '"error"' not in body

    with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
        sequential = [one(client, i) for i in range(30)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # several pooled connections go stale at once
            concurrent_ = list(pool.map(lambda i: one(client, i), range(30, 60)))
    assert sequential == [(200, True)] * 30, sequential
    assert concurrent_ == [(200, True)] * 30, concurrent_
    assert failures == []  # a stale pooled connection is never the replica's fault
    m = gw.metrics()
    assert sample(m, "kvroute_circuit_state", f'replica="{eng.name}"') == 0.0
    assert 'code="503"' not in m


def test_killed_engine_is_ejected_while_the_others_serve(engines, gateway):
    eng = engines(3)
    gw = gateway(eng, "round_robin")
    c = gw.client()
    for i in range(3):
        assert c.completions.create(model=MODEL, prompt=f"warm {i}", max_tokens=2).usage.completion_tokens == 2

    stop = threading.Event()
    errors: list[BaseException] = []
    served: list[str] = []

    def background_load() -> None:  # non-stream requests in flight while the engine dies
        i = 0
        while not stop.is_set() and i < 200:
            try:
                raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"bg {i} " * 30, max_tokens=16)
                served.append(raw.headers["x-kvroute-replica"])
            except Exception as exc:  # noqa: BLE001 — every failure is reported below
                errors.append(exc)
            i += 1

    threads = [threading.Thread(target=background_load) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    eng[1].kill()
    killed_at = len(served)
    for i in range(12):
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"after {i}", max_tokens=4)
        assert raw.headers["x-kvroute-replica"] != eng[1].name
    assert gw.wait_healthy(2, timeout=5) == 2  # probes ejected it
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(CLIENT_TIMEOUT)
    assert errors == []
    assert eng[1].name not in served[killed_at + 2:]  # at most the requests already in flight
    m = gw.metrics()
    assert sample(m, "kvroute_replica_healthy", f'replica="{eng[1].name}"') == 0.0
    assert (sample(m, "kvroute_probe_failures_total", f'replica="{eng[1].name}"') or 0) >= 2


def _served_by(gw: LiveGateway, key: str) -> str:
    raw = gw.client().completions.with_raw_response.create(model=MODEL, prompt="warm", max_tokens=1,
                                                           extra_headers={"x-session-id": key})
    return raw.headers["x-kvroute-replica"]


def test_frozen_engine_before_the_head_is_retried_after_the_first_byte_timeout(engines, gateway):
    eng = engines(2)
    by_name = {e.name: e for e in eng}
    gw = gateway(eng, "consistent_hash",
                 timeouts={"connect_s": 1.0, "first_byte_s": 1.0, "first_byte_total_s": 10.0, "idle_s": 5.0,
                           "non_stream_s": 1.0, "non_stream_total_s": 10.0},
                 probe={"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_after": 3})
    target = by_name[_served_by(gw, "user-a")]
    target.freeze()
    try:
        t0 = time.monotonic()
        raw = gw.client().chat.completions.with_raw_response.create(
            model=MODEL, messages=chat("are you there?"), max_tokens=4, extra_headers={"x-session-id": "user-a"})
        elapsed = time.monotonic() - t0
        assert raw.headers["x-kvroute-replica"] != target.name
        assert raw.parse().usage.completion_tokens == 4
        assert 0.9 < elapsed < 6, elapsed  # one first-byte timeout, then the other engine
        assert (sample(gw.metrics(), "kvroute_retries_total", 'reason="timeout"') or 0) >= 1
    finally:
        target.thaw()
    assert gw.wait_healthy(2) == 2


def test_frozen_engine_mid_prefill_is_retried_after_the_first_byte_timeout(engines, gateway):
    """llama-server sends its 200 head ~10 ms after a request arrives, before prefill; an engine
    frozen after that has produced no token, so the request must still be retried elsewhere."""
    eng = engines(2)
    by_name = {e.name: e for e in eng}
    gw = gateway(eng, "consistent_hash",
                 timeouts={"connect_s": 1.0, "first_byte_s": 2.0, "first_byte_total_s": 15.0, "idle_s": 4.0},
                 probe={"interval_s": 0.5, "timeout_s": 0.5, "unhealthy_after": 3})
    owner = {key: _served_by(gw, key) for key in (f"user-{i}" for i in range(16))}
    key = "user-0"
    target = by_name[owner[key]]
    other = next(k for k, name in owner.items() if name != target.name)  # 2 engines: 16 keys on one, p = 2^-15
    long_chat = chat("go", system_prompt(3, 3700))
    # the other engine already holds the long prompt, so the retry's prefill is short even on a busy machine
    # (sent to it directly: a cold prefill on a busy machine may outlast the gateway's 2 s first-byte timeout)
    warm = httpx.post(f"{by_name[owner[other]].url}/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                      json={"model": MODEL, "messages": long_chat, "max_tokens": 1})
    assert warm.status_code == 200, warm.text
    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        try:
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=CLIENT_TIMEOUT,
                              headers={"x-session-id": key},
                              json={"model": MODEL, "messages": long_chat, "max_tokens": 4, "stream": True}) as r:
                result.update(status=r.status_code, replica=r.headers.get("x-kvroute-replica"),
                              body=r.read().decode())
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        result["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=send)
    t.start()
    endpoint = next(e for e in gw.runtime.router.endpoints if e.id == target.name)
    deadline = time.monotonic() + 5
    while endpoint.inflight == 0 and time.monotonic() < deadline:  # dispatched to the target
        time.sleep(0.002)
    time.sleep(0.06)  # its head is out ~15 ms after the request; the cold 3,700-token prefill takes ~0.8 s
    target.freeze()
    try:
        t.join(CLIENT_TIMEOUT + 5)
        assert not t.is_alive()
    finally:
        target.thaw()
    assert result.get("status") == 200, result
    assert result["replica"] != target.name, result
    assert result["body"].rstrip().endswith("data: [DONE]") and '"error"' not in result["body"], result
    assert result["elapsed"] < 10, result
    assert gw.wait_healthy(2) == 2


# --- token counts (defect 9) -------------------------------------------------------------------------

def test_token_estimate_converges_to_llama_servers_own_count(engines, gateway):
    """No tokenizer.json in a GGUF deployment: the bytes/4 estimate is corrected from usage.prompt_tokens."""
    from kvroute.gateway.openai import PROXIED

    gw = gateway(engines(1))
    c = gw.client()
    for i in range(10):
        messages = chat(f"question {i}", system_prompt(100 + i, words=200 + 40 * i))
        if i % 2:
            for _ in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, stream=True,
                                               stream_options={"include_usage": True}):
                pass
        else:
            c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    scale = gw.runtime.tokens.scale
    assert scale != 1.0
    for i in range(3):
        body = {"model": MODEL, "messages": chat(f"another {i}", system_prompt(200 + i, words=300)), "max_tokens": 1}
        _, req = gw.call(_parse(gw, json.dumps(body).encode(), PROXIED["/v1/chat/completions"]))
        engine = c.chat.completions.create(**body).usage.prompt_tokens
        unscaled = round(req.prompt_tokens / scale)
        assert abs(req.prompt_tokens - engine) <= 0.05 * engine < abs(unscaled - engine), (req.prompt_tokens, engine)


async def _parse(gw: LiveGateway, raw: bytes, kind):
    return gw.gateway.proxy.parse(raw, kind, {})


# --- kvroute calibrate against real engines ----------------------------------------------------------

def test_calibrate_fits_real_llama_servers_loaded_together(engines, tmp_path):
    from kvroute.calibrate import Sweep, fit_profile, measure, write_profile
    from kvroute.perf.loader import load_profile

    eng = engines(2)
    # 200 decode tokens: a window of ~60 ms per stream, where 12 (~4 ms) let one time slice lost to
    # other work on a loaded machine swing a decode point by 20-40 % (once both decode slopes fit to 0)
    sweep = Sweep(prefill_lengths=(128, 512, 1024), batch_sizes=(1, 2), contexts=(128, 512), decode_tokens=200,
                  repeats=1, timeout_s=CLIENT_TIMEOUT, warm_contexts=(512,), warm_lengths=(64, 256), noise_probes=4,
                  slot_sizes=(1024,), slot_rounds=1)
    m = asyncio.run(asyncio.wait_for(measure([e.url for e in eng], sweep=sweep), 60))
    assert {f.slots for f in m.engines} == {4} and all(f.kv_tokens == 16384 for f in m.engines)  # from /props
    # a warm prefill reuses its prompt from the idle slot that just served it (llama-server says so):
    # only about the n appended tokens are prefilled again. The prompt is sized from a bytes-per-token
    # estimate, so its real length is the target's +-15 % (CI: 454 cached of a 512 target, 57 new of 64)
    assert len(m.warm) == 4, m.warm
    assert all(new <= 1.25 * n + 16 and cached >= 0.75 * ctx for ctx, n, cached, new, _ in m.warm), m.warm
    assert len(m.probes) == 8
    # a tiny prompt after a slot of 1,024 fresh tokens went idle pays llama-server's copy of that
    # slot to its host prompt cache (calibrate/slot_probe.py): ~5-20 ms here, ~0 with --cache-ram 0
    assert len(m.slot_saves) == 2 and all(n >= 900 for n, _ in m.slot_saves), m.slot_saves
    profile, report = fit_profile(m, "llama-tiny", "this machine", sweep=sweep)
    assert profile.max_running == 4 and profile.max_batched_tokens == 2048  # slots; n_batch
    assert profile.prefix_reuse == "idle_slots"
    # the copy's size is the machine's: 5-20 ms per 1,000 tokens on a busy machine here, ~1 ms on an
    # idle one, where two points of timing noise can put the median at or below 0 (CI saw +1.0 and
    # -1.3 ms) -- so the fit is checked for range, its sign in tests/test_slot_cache.py
    assert 0 <= profile.slot_save_s_per_token < 1e-4, (profile.slot_save_s_per_token, m.slot_saves)
    # its slots reuse any common prefix (cached counts like 1,762): the cache unit is one token
    assert {f.cache_block for f in m.engines} == {1} and profile.block_size == 1
    assert profile.c_prefill_s + profile.c_prefill_attn_s > 0 and profile.c_decode_s + profile.c_attn_s > 0
    assert profile.prefill_time(1024) > profile.prefill_time(128)
    # the model describes what it measured: within 25 % RMS where the engines had the cores to
    # themselves -- the sweep measured the machine's other load meanwhile (m.background_cores, host_cpu.py;
    # ~0 on an idle CI machine). Where other work took more than half a core, two one-thread
    # engines time-sliced with it and every point carries that load's swings: at 1.1-1.6 busy
    # cores of 2 (load 3-11) single points came out up to 57 % off the fit and the RMS was
    # 0.02-0.33 in 106 of 107 sweeps (2-3 repeats or 4-16x longer decode windows did not narrow
    # it), 0.58 in one where three decode points stalled 100x; the bound is then 0.5
    loaded = (m.background_cores or 0.0) > 0.5
    assert report["rms_error"] < (0.5 if loaded else 0.25), (m.background_cores, report["points"])
    write_profile(tmp_path / "llama.yaml", profile, report)
    assert load_profile(str(tmp_path / "llama.yaml")).points == report["points"]
