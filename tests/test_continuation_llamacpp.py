"""Stream continuation in front of real llama.cpp servers (the real-engine tier of
tests/test_llamacpp.py: its build, tiny model and fixtures): llama-server accepts the gateway's
continuation request (a trailing assistant message with ``continue_final_message: true`` and
``add_generation_prompt: false``; plain prompt + text for completions) and the client gets one
spliced stream, whether the stream migrated between stages or its engine was killed."""

from __future__ import annotations

import json

import httpx

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, View
from tests.test_llamacpp import MODEL, engines, gateway, llama_server_binary, sample, tiny_gguf  # noqa: F401

MESSAGES = [{"role": "user", "content": "please route this request to the storage team"}]


def _continued(gw, reason: str) -> float | None:
    """kvroute_continuations_total{reason, continued}, read once (counted as the leg passes its
    first bytes on, before the client can see that leg's [DONE])."""
    return sample(gw.metrics(), "kvroute_continuations_total", f'reason="{reason}",result="continued"')


class FirstUntil(Policy):
    """A two-stage plan made on the first request: the first endpoint serves sequences up to
    ``grow`` tokens past that request's prompt (as the gateway counts it), another the rest."""

    name = "first_until"

    def __init__(self, first: str, grow: int | None):
        super().__init__()
        self.first, self.grow = first, grow
        self.cut: int | None = None

    def context_limit(self, endpoint_id: str) -> int | None:
        """The first endpoint's stage ends at ``cut``."""
        return self.cut if endpoint_id == self.first else None

    def choose(self, req: Request, eps: list[Endpoint], view: View, dry_run: bool = False) -> Decision:
        """The first endpoint while the sequence is short and it is admitted, else another."""
        if self.cut is None and self.grow is not None:
            self.cut = req.prompt_tokens + self.grow
        short = self.cut is None or req.prompt_tokens < self.cut
        ep = next((e for e in eps if (e.id == self.first) == short), eps[0])
        return Decision.dispatch(ep.id, "stage")


def _sse(gw, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{gw.url}{path}", json={"model": MODEL, "stream": True, "temperature": 0,
                                                       "stream_options": {"include_usage": True}, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _text(chunks: list[dict]) -> str:
    return "".join((c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
                   for c in chunks if c.get("choices"))


def test_llama_server_continues_a_migrated_chat_stream(engines, gateway):  # noqa: F811
    eng = engines(2)
    gw = gateway(eng)
    gw.runtime.router.policy = FirstUntil(eng[0].name, None)
    plain = _sse(gw, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24})
    gw.runtime.router.policy = FirstUntil(eng[0].name, 5)  # five tokens in, the sequence changes stage
    moved = _sse(gw, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24})
    assert _continued(gw, "migrate") == 1.0
    assert "error" not in json.dumps(moved)
    assert len({c["id"] for c in moved}) == 1
    assert sum(1 for c in moved if c.get("choices") and c["choices"][0]["delta"].get("role")) == 1
    assert [c["choices"][0]["finish_reason"] for c in moved if c.get("choices")][-1] == "length"
    usage = moved[-1]["usage"]
    assert usage["completion_tokens"] == 24  # the first leg's 5 tokens and the second leg's 19
    assert usage["prompt_tokens"] == plain[-1]["usage"]["prompt_tokens"]
    pieces = [c["choices"][0]["delta"]["content"] for c in moved if c.get("choices") and
              c["choices"][0]["delta"].get("content")]
    assert len(pieces) == 24 and _text(plain).startswith("".join(pieces[:5]))  # the first leg, as uninterrupted


def test_a_killed_llama_server_mid_stream_leaves_the_client_a_whole_stream(engines, gateway):  # noqa: F811
    eng = engines(2)
    gw = gateway(eng)
    gw.runtime.router.policy = FirstUntil(eng[0].name, None)
    c = gw.client()
    # the kill must land while the engine still decodes: unthrottled it makes the 400 tokens in
    # 0.4-0.6 s (load ~6 here), and a client lagging that long behind (its gateway shares this
    # process) would see the whole stream before it kills at chunk three; at a tenth of its speed
    # that takes seconds, and the survivor makes the rest at its own pace
    eng[0].throttle()
    stream = c.completions.create(model=MODEL, prompt="the storage team will", max_tokens=400, temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    chunks, text = [], ""
    for chunk in stream:
        chunks.append(chunk)
        text += chunk.choices[0].text if chunk.choices else ""
        if len(chunks) == 3:
            eng[0].kill()  # SIGKILL mid-decode
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 400
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) == 400
    assert len({ch.id for ch in chunks}) == 1
    assert _continued(gw, "recover") == 1.0
