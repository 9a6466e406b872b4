"""What real vLLM engines exposed (issue 26), reproduced with the emulator set to behave as vLLM
did (emulator/quirks.py): streams with many empty-text events, HEAD requests, a frozen engine
core behind a live API server, the context limit in /v1/models. Real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from kvroute.errors import ConfigError
from kvroute.gateway.config import load_config
from kvroute.gateway.continuation import Splice
from kvroute.gateway.outlier import StallDetector
from kvroute.gateway.probes import next_probe_interval
from kvroute.gateway.tokens import token_events
from tests.gateway_harness import LiveDeployment, settled
from tests.test_continuation import CHAT, PROMPT, TwoStages, continuations


@pytest.fixture
def live():
    with settled(replicas=2, policy="round_robin") as dep:
        yield dep


def sse(url: str, path: str, body: dict) -> list[dict]:
    """A streamed request's events (without [DONE], which must come exactly once, last)."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=20) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def generated(live: LiveDeployment) -> list[int]:
    return [emu.generation_tokens_total for _, emu, _ in live.dep.emulators]


# -- 1. tokens counted by stream events ---------------------------------------------------------------

def test_a_vllm_shaped_stream_cut_mid_way_is_continued_for_exactly_the_tokens_left(live):
    """vLLM streams one event per token, many with empty text: the continuation asks for
    max_tokens minus the events seen, the engines generate the request's tokens in all, and the
    client's usage and its count of token events are both the request's max_tokens."""
    live.runtime.router.policy = TwoStages(None)  # emulated-0 while it is up
    for i in (0, 1):
        live.fault(i, empty_text=0.75)
    live.fault(0, close_after_tokens=60)
    events = sse(live.url, "/v1/completions", {"model": "emulated", "prompt": PROMPT, "max_tokens": 200,
                                               "stream_options": {"include_usage": True}})
    live.settle()
    tokens = [e for e in events if e["choices"]]
    empty = sum(1 for e in tokens if e["choices"][0]["text"] == "")
    assert len(tokens) == 200 and empty > 100  # every token event reached the client, empty ones too
    assert events[-1]["usage"]["completion_tokens"] == 200
    first, second = generated(live)
    assert second == 140  # the continuation asked for exactly the 200 - 60 tokens left
    assert 60 <= first <= 62  # what the cut leg generated before its connection dropped
    want = {("recover", "continued"): 1.0}
    assert continuations(live.url) == want


def test_a_vllm_shaped_chat_stream_keeps_its_empty_events_and_one_role_on_every_leg(live):
    live.runtime.router.policy = TwoStages(None)
    for i in (0, 1):
        live.fault(i, empty_text=0.75)
    live.fault(0, close_after_tokens=30)
    events = sse(live.url, "/v1/chat/completions", {"model": "emulated", "messages": CHAT, "max_tokens": 90,
                                                    "stream_options": {"include_usage": True}})
    live.settle()
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert [d for d in deltas if "role" in d] == [{"role": "assistant", "content": ""}]  # announced once
    assert sum(1 for d in deltas if "role" not in d and "content" in d) == 90
    assert events[-1]["usage"]["completion_tokens"] == 90
    assert generated(live)[1] == 60
    assert len({(e["id"], e["created"]) for e in events}) == 1


def test_splice_counts_events_not_text():
    s = Splice.open("chat", {"messages": CHAT, "stream": True, "max_tokens": 10}, 20)
    assert s is not None

    def feed(delta, finish=None, usage=None):
        event = {"id": "a", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if usage is not None:
            event = {"id": "a", "choices": [], "usage": usage}
        return s.feed(f"data: {json.dumps(event)}\n\n".encode())

    feed({"role": "assistant", "content": ""})  # the announcement is no token
    for text in ("", "", " ab", "", "c"):
        feed({"content": text})
    assert s.tokens == 5 and s.text == " abc"
    assert s.next_body()["max_tokens"] == 5
    feed({}, "length")  # a bare ending is no token either
    assert s.tokens == 5 and s.finished and s.next_body() is None
    assert s.length_ending() == b"data: [DONE]\n\n"  # the engine had said it finished
    feed({}, usage={"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27})
    assert s.tokens == 7  # the engine's own count wins (several tokens per event)


def test_token_events_counts_empty_events_but_not_announcements_or_bare_endings():
    def event(choice):
        return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    chunk = b"".join([event({"delta": {"role": "assistant", "content": ""}}), event({"delta": {"content": ""}}),
                      event({"delta": {"content": "x"}}), event({"text": ""}), event({"text": "y"}),
                      event({"text": "", "finish_reason": "length"}), event({"delta": {}, "finish_reason": "stop"}),
                      b"data: [DONE]\n\n"])
    assert token_events(chunk) == 4


# -- 2. HEAD ---------------------------------------------------------------------------------------

def _exchange(port: int, raw: bytes, responses: int) -> bytes:
    """Send ``raw`` on one connection and read until the server closes it (or is silent for 1 s);
    at least ``responses`` heads must have arrived."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        data = b""
        sock.settimeout(1.0)
        while True:
            try:
                got = sock.recv(65536)
            except TimeoutError:
                break
            if not got:
                break
            data += got
        assert data.count(b"HTTP/1.1 ") >= responses, data[:400]
        return data


def _responses(data: bytes) -> list[tuple[bytes, dict[str, str], bytes]]:
    """Split what came back into (status line, headers, body): the first answers a HEAD (no
    body, whatever its Content-Length says), the others are sized by Content-Length."""
    out: list[tuple[bytes, dict[str, str], bytes]] = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        fields = (line.decode().split(": ", 1) for line in lines[1:])
        headers = {name.lower(): value for name, value in fields}
        length = int(headers.get("content-length", 0)) if out else 0
        out.append((lines[0], headers, rest[:length]))
        data = rest[length:]
    return out


@pytest.mark.parametrize("path", ["/metrics", "/health", "/readyz", "/livez", "/v1/models", "/v1/completions",
                                  "/nowhere"])
def test_head_gets_headers_only_and_the_connection_serves_the_next_request(live, path):
    port = int(live.url.rsplit(":", 1)[1])
    # the second request closes the connection after its answer: whatever the HEAD answer wrongly
    # carried would sit before the second status line (read to the close, not to a 1 s silence)
    raw = (f"HEAD {path} HTTP/1.1\r\nHost: x\r\n\r\n"
           "GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").encode()
    (status, headers, body), (status2, _, body2) = _responses(_exchange(port, raw, 2))
    assert body == b"" and int(headers["content-length"]) > 0  # the length a GET would have
    assert status2 == b"HTTP/1.1 200 OK" and json.loads(body2) == {"status": "alive"}
    if path == "/v1/completions":
        assert status.startswith(b"HTTP/1.1 405") and headers["allow"] == "POST"
    elif path == "/nowhere":
        assert status.startswith(b"HTTP/1.1 404")
    else:
        assert status == b"HTTP/1.1 200 OK"
    if path == "/metrics":
        assert headers["content-type"].startswith("text/plain")


def test_a_get_only_route_allows_head_and_says_so(live):
    r = httpx.post(f"{live.url}/metrics")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"


# -- 3. a frozen engine core -------------------------------------------------------------------------

def _breaker(live: LiveDeployment, i: int):
    return live.runtime.upstreams[live.replica_id(i)].breaker


def _wait(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_frozen_engine_is_ejected_within_seconds_and_no_stream_waits_longer(live):
    """vLLM's engine core stopped behind a live API server: probes still see it healthy, so only
    request progress shows it. Streams on it — one mid-way, others waiting for their first
    token — are continued or retried elsewhere within seconds, and it is re-admitted once it
    generates again."""
    live.runtime.router.policy = TwoStages(None)  # emulated-0 while it is up
    for i in (0, 1):
        live.fault(i, empty_text=0.5)
    results: dict[str, tuple[float, list[dict]]] = {}

    def run(name: str, path: str, body: dict) -> None:
        t0 = time.monotonic()
        events = sse(live.url, path, {"model": "emulated", "stream_options": {"include_usage": True}, **body})
        results[name] = (time.monotonic() - t0, events)

    long = threading.Thread(target=run, args=("mid-way", "/v1/completions",
                                              {"prompt": PROMPT, "max_tokens": 400}))
    long.start()
    _wait(lambda: live.dep.emulators[0][1].generation_tokens_total >= 40, 10)
    live.fault(0, frozen=True)
    frozen_at = time.monotonic()
    waiting = [threading.Thread(target=run, args=(f"new-{k}", path, body)) for k, (path, body) in enumerate([
        ("/v1/completions", {"prompt": PROMPT + " again", "max_tokens": 30}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 30})])]
    for t in waiting:
        t.start()
    ejected_after = _wait(lambda: _breaker(live, 0).held, 6)
    assert ejected_after <= 5.0
    assert live.runtime.upstreams[live.replica_id(0)].endpoint.healthy  # probes alone saw nothing wrong
    for t in (long, *waiting):
        t.join(15)
    for name, (seconds, events) in results.items():
        assert events[-1]["usage"]["completion_tokens"] == (400 if name == "mid-way" else 30), name
        if name != "mid-way":
            assert seconds <= 5.0, (name, seconds)  # waited at most the stall threshold, then retried
    assert time.monotonic() - frozen_at < 8
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'kvroute_stall_ejections_total{replica="emulated-0"} 1.0' in metrics
    live.fault(0, frozen=False)
    _wait(lambda: not _breaker(live, 0).held and _breaker(live, 0).allows, 5)  # the canary saw it generate
    with httpx.Client() as c:
        r = c.post(f"{live.url}/v1/completions", json={"model": "emulated", "prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "emulated-0"


def test_a_long_prompt_is_allowed_its_prefill_and_a_silent_engine_is_not():
    detector = StallDetector(factor=10, min_s=1, max_s=3)
    w = detector.watch("r")
    a = detector.begin("r", 2000, 0.0)
    a.progressed(0.5)  # 2000 prompt tokens prefilled in 0.5 s: 0.25 ms per token
    detector.watch("r").end(a)
    big = detector.begin("r", 40000, 10.0)  # expected prefill 10 s
    assert not list(detector.sweep(13.5)) and not list(detector.sweep(19.0))
    assert [name for name, _, _ in detector.sweep(23.5)] == ["r"]
    assert w.stalled and w.stalls == 1
    detector.readmit(w, 30.0)
    w.end(big)
    small = detector.begin("r", 10, 30.0)
    assert not list(detector.sweep(32.0))  # a decode gap of 0.5 s seen: 10 × that = 5 s, capped at 3 s
    assert [name for name, _, _ in detector.sweep(33.1)] == ["r"]
    w.end(small)


# -- 6. the admin API on its own token; per-replica counters ----------------------------------------

def _samples(metrics: str, name: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            out[labels] = float(value)
    return out


def test_the_admin_api_has_its_own_token_and_clients_need_no_key(monkeypatch):
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_TOKEN", "s3cret-admin")
    dep = LiveDeployment(replicas=2, policy="round_robin",
                         auth={"admin_token_env": "KVROUTE_TEST_ADMIN_TOKEN"})
    try:
        for _ in range(4):  # no key: the gateway has no client keys, only an admin token
            r = httpx.post(f"{dep.url}/v1/completions", json={"model": "emulated", "prompt": PROMPT, "max_tokens": 5})
            assert r.status_code == 200
        assert httpx.get(f"{dep.url}/admin/replicas").status_code == 401
        wrong = httpx.get(f"{dep.url}/admin/replicas", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = httpx.get(f"{dep.url}/admin/replicas", headers={"Authorization": "Bearer s3cret-admin"})
        assert ok.status_code == 200
        assert [(r["requests"], r["errors"], r["stalled"]) for r in ok.json()["replicas"]] == [(2, 0, False)] * 2
        head = httpx.head(f"{dep.url}/admin/replicas", headers={"Authorization": "Bearer s3cret-admin"})
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        dep.fault(1, fail_rate=1.0)
        r = httpx.post(f"{dep.url}/v1/completions", json={"model": "emulated", "prompt": PROMPT, "max_tokens": 5})
        r = httpx.post(f"{dep.url}/v1/completions", json={"model": "emulated", "prompt": PROMPT, "max_tokens": 5})
        assert r.status_code == 200
        dep.settle()
        metrics = httpx.get(f"{dep.url}/metrics").text
        assert _samples(metrics, "kvroute_replica_requests_total") == {
            'replica="emulated-0"': 4.0, 'replica="emulated-1"': 3.0}
        assert _samples(metrics, "kvroute_replica_errors_total") == {
            'replica="emulated-0"': 0.0, 'replica="emulated-1"': 1.0}
        tokens = _samples(metrics, "kvroute_replica_tokens_total")
        assert tokens['kind="completion",replica="emulated-0"'] == 20.0  # 4 answers of 5 tokens
        assert tokens['kind="completion",replica="emulated-1"'] == 10.0
        assert tokens['kind="prompt",replica="emulated-0"'] == 2 * tokens['kind="prompt",replica="emulated-1"']
    finally:
        dep.close()


@pytest.mark.parametrize(("yaml", "message"), [
    ("auth: {admin_token_env: KVROUTE_TEST_UNSET_TOKEN}", "environment variable KVROUTE_TEST_UNSET_TOKEN is unset"),
    ("stall: {min_s: 5, max_s: 2}", "min_s (5) must not exceed max_s (2)"),
])
def test_bad_admin_token_and_stall_settings_are_one_line_errors(tmp_path, yaml, message):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"port: 0\n{yaml}\nreplicas:\n  - {{url: http://127.0.0.1:1}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(cfg))
    assert str(err.value).startswith(f"{cfg}:2:") and message in str(err.value)


# -- 5. adaptive probing -----------------------------------------------------------------------------

def test_probe_interval_backs_off_while_idle_and_comes_back_with_work():
    waits = [0.1]
    for _ in range(6):
        waits.append(next_probe_interval(waits[-1], True, 0.1, 1.0))
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert next_probe_interval(1.0, False, 0.1, 1.0) == 0.1
    assert next_probe_interval(0.1, True, 0.1, 0.1) == 0.1  # idle_interval_s = interval_s: a fixed rate


def test_an_idle_replica_is_probed_rarely_and_a_busy_one_at_the_fast_rate():
    dep = LiveDeployment(replicas=2, policy="round_robin", probe={"interval_s": 0.05, "idle_interval_s": 0.5})
    try:
        def probes() -> list[int]:
            return [up.probes for up in dep.runtime.upstreams.values()]

        time.sleep(1.0)  # back off to the idle rate
        before = probes()
        time.sleep(2.0)
        idle = [b - a for a, b in zip(before, probes(), strict=True)]
        assert all(2 <= n <= 6 for n in idle), idle  # ~4 at 0.5 s, against 40 at the fixed 50 ms
        done = threading.Event()
        for i in (0, 1):
            dep.fault(i, slowdown=4.0)  # a stream that lasts a few seconds

        def stream() -> None:
            sse(dep.url, "/v1/completions", {"model": "emulated", "prompt": PROMPT, "max_tokens": 400})
            done.set()

        threading.Thread(target=stream).start()
        time.sleep(0.3)  # the dispatch restored the fast rate
        before = probes()
        time.sleep(1.0)
        busy = [b - a for a, b in zip(before, probes(), strict=True)]
        chosen = sorted(up.probe_every_s for up in dep.runtime.upstreams.values())
        assert not done.is_set(), "the stream ended before the window: make it longer"
        # the busy one at interval_s, the idle one still at idle_interval_s; a round waits for its probes,
        # so a starved machine shrinks both counts alike: compare them, not the busy one with 20/s
        assert chosen == pytest.approx([0.05, 0.5]), chosen
        assert max(busy) >= 3 * max(1, min(busy)) and min(busy) <= 4, busy
        done.wait(20)
        sent_before = sum(probes())
        metrics = httpx.get(f"{dep.url}/metrics").text
        # the counter is read at scrape time: a probe may finish between the scrape and our reads
        assert sent_before <= sum(_samples(metrics, "kvroute_replica_probes_total").values()) <= sum(probes())
        sizes = _samples(metrics, "kvroute_replica_probe_bytes_total")
        assert all(up.filtered for up in dep.runtime.upstreams.values())  # vLLM's filtered page
        assert all(0 < sizes[f'replica="{name}"'] / up.probes < 1000 for name, up in dep.runtime.upstreams.items())
    finally:
        dep.close()


def test_a_first_prompt_is_no_freeze_a_huge_one_gets_its_prefill_and_the_last_replica_stays():
    detector = StallDetector(factor=10, min_s=1, max_s=3)
    first = detector.begin("r", 1500, 0.0)  # a CPU engine's first long prefill: its speed is unknown
    assert not list(detector.sweep(60.0))
    first.progressed(60.5)
    detector.watch("r").end(first)
    assert detector.watch("r").s_per_token == pytest.approx(60.5 / 1500)
    detector.watch("r").s_per_token = 1e-6  # say it turned out very fast: the prior still holds
    huge = detector.begin("r", 100_000, 100.0)  # 3 s (10 × a peak gap of 60.5 s, capped) + 10 s
    assert not list(detector.sweep(112.5))
    assert not list(detector.sweep(113.5, may_eject=lambda name: False))  # nowhere else to send it
    assert not detector.watch("r").stalled
    assert [name for name, _, _ in detector.sweep(113.5)] == ["r"]
    detector.watch("r").end(huge)


def test_two_replicas_silent_in_one_sweep_eject_one_and_the_last_stays():
    """A gateway starved for seconds reads no token from any engine: at its next sweep every replica
    looks silent past its threshold. One is ejected; the other is the last place requests can go and
    stays (a CI run of test_vllm_streams ejected both, the healthy engine "after 3.2 s without a
    token", and its stream ended in an error)."""
    from types import SimpleNamespace

    from kvroute.gateway.breaker import CircuitBreaker
    from kvroute.gateway.ejection import Ejector
    from kvroute.gateway.settings import StallConfig

    ejected: list[str] = []
    metrics = SimpleNamespace(stall_ejections=SimpleNamespace(
        labels=lambda name: SimpleNamespace(inc=lambda: ejected.append(name))))
    ups = {n: SimpleNamespace(endpoint=SimpleNamespace(healthy=True, circuit_open=False),
                              breaker=CircuitBreaker(failures=5, cooldown_s=5)) for n in ("v0", "v1")}
    host = SimpleNamespace(config=SimpleNamespace(stall=StallConfig()), upstreams=ups, drained=set(),
                           metrics=metrics, drain_queue=lambda: None)
    async def run() -> None:
        ejector = Ejector(host)
        for name in ups:  # one watched stream each: its first token at 0.5 s, then nothing more
            ejector.detector.begin(name, 10, 0.0).progressed(0.5)
        ejector.sweep(10.0)  # far past the 3 s cap
        assert len(ejected) == 1, ejected
        stays = "v1" if ejected == ["v0"] else "v0"
        assert not ups[ejected[0]].breaker.allows and ups[stays].breaker.allows
        assert not ejector.detector.watch(stays).stalled
        ejector.sweep(20.0)  # nor in a later sweep, while the other is out
        assert len(ejected) == 1 and ups[stays].breaker.allows
        await ejector.stop()  # the ejected one's canary, never run
    asyncio.run(run())


def test_vllms_running_usage_counts_merged_events_exactly_and_stays_unseen_unasked():
    """vLLM merges tokens into one event when its reader lags: the gateway asks vLLM for its
    running usage and counts by it, and takes out again what the client did not ask for."""
    def event(obj) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    for asked, final_kept in (({}, False), ({"include_usage": True}, True)):
        s = Splice.open("completions", {"prompt": "x", "stream": True, "max_tokens": 10, "stream_options": asked}, 3)
        assert s is not None
        sent = json.loads(s.exact_body(json.dumps(s.body).encode()))
        assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        out = s.feed(event({"id": "a", "choices": [{"index": 0, "text": "abc", "finish_reason": None}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}))
        assert s.tokens == 3 and s.prompt_reported == 5  # three tokens in one event
        assert "usage" not in json.loads(out[6:]) and json.loads(out[6:])["choices"][0]["text"] == "abc"
        tail = s.feed(event({"id": "a", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                                                  "total_tokens": 8}}))
        assert (tail != b"") == final_kept
        s.begin_leg()
        out = s.feed(event({"id": "b", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7,
                                                                 "total_tokens": 16}}))
        if final_kept:  # the later leg's usage: the first leg's own prompt count, every token generated
            assert json.loads(out[6:])["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}
