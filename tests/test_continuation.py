"""Stream continuation through the gateway (gateway/continuation.py): a stream that outgrows its
replica's stage migrates, a stream whose replica dies recovers, and either way the client gets
one stream equal token for token to an uninterrupted run. Real HTTP on 127.0.0.1, emulated
engines (whose text is a function of its context), the openai SDK as client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from kvroute.emulator.text import emulated_text
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.continuation import Splice
from kvroute.gateway.server import Gateway
from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, View
from kvroute.ports import free_ports, wait_for_http
from kvroute.prefix import chat_key, estimate_tokens
from kvroute.replicas import ReplicaConfig
from tests.gateway_harness import LiveDeployment, settled, wait_healthy

CHAT = [{"role": "system", "content": "You summarise incident reports."},
        {"role": "user", "content": "Summarise the outage of the storage cluster on Tuesday."}]
PROMPT = "The storage cluster went down on Tuesday because"


class TwoStages(Policy):
    """A tiny length-staged policy: emulated-0 serves sequences shorter than ``cut`` tokens,
    emulated-1 the rest (the contract CascadeInfer's preset fulfils with ``context_limit``)."""

    name = "two_stages"

    def __init__(self, cut: int | None):
        super().__init__()
        self.cut = cut

    def context_limit(self, endpoint_id: str) -> int | None:
        """emulated-0's stage ends at ``cut``; the last stage is unbounded."""
        return self.cut if endpoint_id == "emulated-0" else None

    def choose(self, req: Request, eps: list[Endpoint], view: View, dry_run: bool = False) -> Decision:
        """The first admitted endpoint of the request's stage (or any, once its stage failed)."""
        stage = "emulated-0" if self.cut is None or req.prompt_tokens < self.cut else "emulated-1"
        ep = next((e for e in eps if e.id == stage), eps[0])
        return Decision.dispatch(ep.id, "stage")


@pytest.fixture
def live():
    with settled(replicas=2, policy="round_robin") as dep:
        yield dep


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


def continuations(url: str) -> dict[tuple[str, str], float]:
    """kvroute_continuations_total by (reason, result), read once: a leg is counted as it passes
    its first bytes on, so a read at the client's [DONE] sees every continuation of that stream."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvroute_continuations_total{"):
            labels, value = line[len("kvroute_continuations_total{"):].split("} ")
            parts = dict(p.split("=") for p in labels.split(","))
            out[(parts["reason"].strip('"'), parts["result"].strip('"'))] = float(value)
    return out


def requests_served(dep: LiveDeployment) -> list[int]:
    return [emu.requests_total for _, emu, _ in dep.dep.emulators]


def chat_stream(url: str, max_tokens: int, **extra):
    stream = client(url).chat.completions.create(model="emulated", messages=CHAT, max_tokens=max_tokens,
                                                 stream=True, stream_options={"include_usage": True}, **extra)
    return list(stream)


def test_a_migrated_chat_stream_equals_an_unmigrated_one(live):
    live.runtime.router.policy = TwoStages(None)
    plain = chat_stream(live.url, 20)
    assert continuations(live.url) == {}
    cut = estimate_tokens(chat_key(CHAT)) + 7  # emulated-0's stage ends 7 tokens into the answer
    live.runtime.router.policy = TwoStages(cut)
    before = requests_served(live)
    moved = chat_stream(live.url, 20)
    assert [b - a for a, b in zip(before, requests_served(live))] == [1, 1]  # one leg on each stage
    want = {("migrate", "continued"): 1.0}
    assert continuations(live.url) == want

    def text(chunks):
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert text(moved) == text(plain) == emulated_text(chat_key(CHAT), 20)
    assert len({(c.id, c.created, c.model) for c in moved}) == 1  # what the client saw first, throughout
    assert [c.choices[0].delta.role for c in moved if c.choices and c.choices[0].delta.role] == ["assistant"]
    assert [c.choices[0].finish_reason for c in moved if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = [c.usage for c in moved if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 20
    assert usage[0].prompt_tokens == next(c.usage for c in plain if c.usage).prompt_tokens
    assert usage[0].total_tokens == usage[0].prompt_tokens + 20


def test_a_migrated_completion_stream_equals_an_unmigrated_one(live):
    cut = estimate_tokens(PROMPT) + 4
    live.runtime.router.policy = TwoStages(cut)
    with httpx.stream("POST", f"{live.url}/v1/completions", timeout=10,
                      json={"model": "emulated", "prompt": PROMPT, "max_tokens": 15, "stream": True}) as r:
        body = r.read().decode()
    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == emulated_text(PROMPT, 15)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["usage"]["prompt_tokens"] == estimate_tokens(PROMPT)  # the original prompt
    assert chunks[-1]["usage"]["completion_tokens"] == 15
    want = {("migrate", "continued"): 1.0}
    assert continuations(live.url) == want


def test_non_stream_requests_are_not_continued(live):
    live.runtime.router.policy = TwoStages(estimate_tokens(PROMPT) + 2)
    raw = client(live.url).completions.with_raw_response.create(model="emulated", prompt=PROMPT, max_tokens=12)
    assert raw.headers["x-kvroute-replica"] == "emulated-0"
    assert raw.parse().choices[0].text == emulated_text(PROMPT, 12)
    assert continuations(live.url) == {}


def test_a_stream_cut_mid_way_recovers_on_another_replica(live, caplog):
    live.runtime.router.policy = TwoStages(None)  # everything to emulated-0 while it is up
    live.fault(0, close_after_tokens=5)
    with caplog.at_level("INFO", logger="kvroute.access"):
        chunks = chat_stream(live.url, 18)
        live.settle()
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == emulated_text(chat_key(CHAT), 18)
    assert next(c.usage for c in chunks if c.usage).completion_tokens == 18
    want = {("recover", "continued"): 1.0}
    assert continuations(live.url) == want
    line = next(r.fields for r in caplog.records if r.name == "kvroute.access")
    assert line["legs"] == 2 and line["replica"] == "emulated-1" and line["failed_on"] == ["emulated-0"]


def test_a_continuation_is_counted_while_its_leg_still_streams(live):
    """The count comes as the new leg passes its first bytes on: a scrape while it still streams
    sees it (it used to come when the leg returned, after the client's [DONE], whose relay waits
    for the engine's end of stream — so a scrape right after [DONE] could miss it)."""
    live.runtime.router.policy = TwoStages(None)  # emulated-0 while it is up
    live.fault(0, close_after_tokens=3)
    live.fault(1, slowdown=20.0)  # the second leg's 9 tokens take about a second
    seen, tokens, lines = None, 0, []
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", timeout=20,
                      json={"model": "emulated", "messages": CHAT, "max_tokens": 12, "stream": True}) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                tokens += 1
                if tokens == 5:  # the second leg's second token: that leg is streaming
                    seen = continuations(live.url)
    assert lines[-1] == "data: [DONE]" and tokens == 12
    assert seen == {("recover", "continued"): 1.0}
    assert continuations(live.url) == seen


def test_a_stream_whose_later_stage_is_down_stays_where_it_is(live):
    """CascadeInfer with its second stage drained: the migrated leg falls back to the first stage,
    whose limit the sequence already reached — the stream stays there to the end instead of
    being re-routed after every token until the continuation bound ends it."""
    from kvroute.policy.registry import build_policy

    cut = estimate_tokens(chat_key(CHAT)) + 6
    live.runtime.router.policy = build_policy("cascadeinfer", {"stage_sizes": [1, 1], "bounds": [cut]})
    live.runtime.set_drained("emulated-1", True)
    before = requests_served(live)
    chunks = chat_stream(live.url, 16)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == emulated_text(chat_key(CHAT), 16)
    assert [b - a for a, b in zip(before, requests_served(live))] == [2, 0]  # one migration, back to stage 1
    want = {("migrate", "continued"): 1.0}
    assert continuations(live.url) == want


def test_the_continuation_bound_ends_the_stream_with_one_sse_error(live):
    live.runtime.config.retry.max_continuations = 1
    for i in range(2):
        live.fault(i, close_after_tokens=3)
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", timeout=10,
                      json={"model": "emulated", "messages": CHAT, "max_tokens": 30, "stream": True}) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert body.endswith("\n\n")
    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_stream_error" and "1 continuation(s) already made" in error["message"]
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == emulated_text(chat_key(CHAT), 6)  # 3 tokens from each leg, none lost or repeated
    want = {("recover", "continued"): 1.0, ("recover", "refused"): 1.0}
    assert continuations(live.url) == want


def test_emulated_engines_refuse_a_continuation_with_a_generation_prompt(live):
    body = {"model": "emulated", "max_tokens": 2, "continue_final_message": True,
            "messages": [*CHAT, {"role": "assistant", "content": " abc"}]}
    assert httpx.post(f"{live.emulator_url(0)}/v1/chat/completions", json=body).status_code == 400
    body["add_generation_prompt"] = False
    r = httpx.post(f"{live.emulator_url(0)}/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == emulated_text(chat_key(CHAT) + " abc", 2)


# -- a replica process killed mid-stream --------------------------------------------------------

def test_a_replica_process_killed_mid_stream_leaves_the_client_a_whole_stream():
    ports = free_ports(2)
    emus = [subprocess.Popen([sys.executable, "-m", "kvroute.cli", "emulate", "--port", str(p), "--slowdown", "6"],
                             stderr=subprocess.DEVNULL) for p in ports]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    gw = None
    try:
        for p in ports:
            wait_for_http(f"http://127.0.0.1:{p}/health", 30)  # a loaded machine starts Python slowly
        config = GatewayConfig(port=0, policy="round_robin", probe={"interval_s": 0.05},
                               replicas=[ReplicaConfig(url=f"http://127.0.0.1:{p}", id=f"r{i}", engine="vllm")
                                         for i, p in enumerate(ports)])
        gw = Gateway(config)
        port = asyncio.run_coroutine_threadsafe(gw.start(), loop).result(10)
        # the stream needs the other replica to recover on: a start-up probe that timed out on a
        # loaded machine leaves one ejected until it answers two more
        assert wait_healthy(f"http://127.0.0.1:{port}", 2) == 2
        raw = client(f"http://127.0.0.1:{port}").completions.with_raw_response.create(
            model="emulated", prompt=PROMPT, max_tokens=30, stream=True)
        idx = int(raw.headers["x-kvroute-replica"][1:])
        victim = emus[idx]
        # the kill must land while the victim still owes tokens: at slowdown 6 it makes the 30 in ~0.5 s,
        # and a client lagging that far behind (its gateway shares this process) saw the whole stream
        # before it killed at token five (once at load ~6); ten times slower from now on, the 25 tokens
        # left take ~3.6 s — what the survivor then makes keeps the usual pace
        httpx.post(f"http://127.0.0.1:{ports[idx]}/_fault", json={"slowdown": 60}, timeout=10).raise_for_status()
        text = ""
        for chunk in raw.parse():
            text += chunk.choices[0].text if chunk.choices else ""
            if len(text) == 4 * 5 and victim.poll() is None:  # five tokens in: the engine dies
                os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL  # killed (it may take a moment to be reaped)
        assert text == emulated_text(PROMPT, 30)
        want = {("recover", "continued"): 1.0}
        assert continuations(f"http://127.0.0.1:{port}") == want
    finally:
        if gw is not None:
            asyncio.run_coroutine_threadsafe(gw.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        for p in emus:
            if p.poll() is None:
                p.terminate()
                p.wait(5)


# -- the splice on its own ----------------------------------------------------------------------

def _splice(**body) -> Splice:
    splice = Splice.open("chat", {"messages": CHAT, "stream": True, "max_tokens": 10, **body}, 30)
    assert splice is not None
    return splice


def _event(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_splice_forwards_whole_events_only_and_rewrites_later_legs():
    s = _splice()
    first = _event({"id": "a", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                             "content": " x"}}]})
    assert s.feed(first[:10]) == b"" and s.feed(first[10:]) == first
    assert s.feed(b'data: {"id": "a", "cho') == b""  # a leg dying here leaves no fragment
    s.begin_leg()
    role = _event({"id": "b", "created": 2, "model": "m2", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                              "content": ""}}]})
    assert s.feed(role.replace(b"\n\n", b"\r\n\r\n")) == b""  # a second role announcement is dropped
    out = s.feed(_event({"id": "b", "created": 2, "model": "m2", "choices": [{"index": 0, "delta": {"content": " y"}}],
                         "usage": {"prompt_tokens": 41, "completion_tokens": 1, "total_tokens": 42}}))
    event = json.loads(out[6:])
    assert (event["id"], event["created"], event["model"]) == ("a", 1, "m")
    assert event["usage"] == {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    assert s.text == " x y" and s.tokens == 2


def test_splice_stops_on_an_error_event_and_on_tool_calls():
    s = _splice()
    assert s.feed(b'data: {"error": {"message": "engine died"}}\n\n') == b""
    assert s.error == "engine died"
    s = _splice()
    s.feed(_event({"id": "a", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}))
    assert not s.continuable


def test_what_cannot_be_continued_is_not():
    assert Splice.open("chat", {"messages": CHAT, "stream": True, "n": 2}, 10) is None
    assert Splice.open("completions", {"prompt": [1, 2, 3], "stream": True}, 3) is None
    assert Splice.open("completions", {"prompt": "x", "stream": True, "echo": True}, 1) is None
    structured = {"messages": CHAT, "stream": True, "response_format": {"type": "json_object"}}
    assert Splice.open("chat", structured, 1) is None
    assert Splice.open("embeddings", {"input": "x", "stream": True}, 1) is None


def test_the_next_leg_asks_for_the_rest_and_continues_the_assistant_message():
    s = _splice(min_tokens=4)
    s.feed(_event({"id": "a", "choices": [{"index": 0, "delta": {"content": " x"}}]}))
    body = s.next_body()
    assert body is not None and body["max_tokens"] == 9 and body["min_tokens"] == 3
    assert body["messages"][-1] == {"role": "assistant", "content": " x"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert s.outgrew(31) and not s.outgrew(32) and not s.outgrew(None)


def test_cascadeinfer_in_kvroute_serve_routes_by_length_and_migrates_a_growing_stream(tmp_path):
    """`kvroute serve` with the cascadeinfer preset in its YAML: two one-instance stages split at
    ``cut`` tokens; a short prompt starts in stage 1 and moves to stage 2 as its answer grows, a
    long prompt starts in stage 2. Every process is started and stopped here by PID."""
    *ports, gw_port = free_ports(3)
    cut = estimate_tokens(chat_key(CHAT)) + 6
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"port: {gw_port}\npolicy: {{preset: cascadeinfer, params: {{stage_sizes: [1, 1], "
                   f"bounds: [{cut}]}}}}\nreplicas:\n" +
                   "".join(f"  - {{url: http://127.0.0.1:{p}, id: stage{i + 1}}}\n" for i, p in enumerate(ports)))
    procs = [subprocess.Popen([sys.executable, "-m", "kvroute.cli", "emulate", "--port", str(p)],
                              stderr=subprocess.DEVNULL) for p in ports]
    url = f"http://127.0.0.1:{gw_port}"
    log = tmp_path / "gw.log"  # a file, not an unread pipe that blocks the gateway once full
    try:
        # both engines listen before the gateway starts: a replica counts as healthy until three probes
        # failed, so a gateway started beside them can route the first request to one not listening yet
        # (CI: "stage1 failed before responding: connect ... refused", retried on stage2, 2 of 12 here)
        for p in ports:
            wait_for_http(f"http://127.0.0.1:{p}/health", 30)
        with log.open("w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(cfg)],
                                          stderr=err))
        wait_for_http(f"{url}/health", 20)
        assert wait_healthy(url, 2, 20) == 2
        raw = client(url).chat.completions.with_raw_response.create(model="emulated", messages=CHAT, max_tokens=16,
                                                                    stream=True)
        assert raw.headers["x-kvroute-replica"] == "stage1", log.read_text()
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        assert text == emulated_text(chat_key(CHAT), 16)
        want = {("migrate", "continued"): 1.0}
        assert continuations(url) == want
        long_chat = [*CHAT, {"role": "user", "content": "And list every affected volume. " * 4}]
        raw = client(url).chat.completions.with_raw_response.create(model="emulated", messages=long_chat,
                                                                    max_tokens=4)
        assert raw.headers["x-kvroute-replica"] == "stage2", log.read_text()  # past the cut: the second stage
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(5)


def test_a_leg_stops_at_the_event_that_reaches_the_limit_even_inside_one_read():
    s = _splice()
    s.limit = 32  # prompt 30: the second token reaches it
    events = b"".join(_event({"id": "a", "choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}) for i in range(5))
    out = s.feed(events + b"data: [DONE]\n\n")
    assert s.outgrown and s.text == " w0 w1" and out.count(b"data: ") == 2 and not s.done
