"""The OpenAI surface through the gateway, with the official SDK: routing by ``model``, the
aggregated model list, and the pass-through endpoints (embeddings, responses, tokenize)."""

import json

import httpx
import openai
import pytest

from tests.fake_upstream import FaultyDeployment, chunk, http_response

EMBEDDING = json.dumps({"object": "list", "model": "embedder", "usage": {"prompt_tokens": 2, "total_tokens": 2},
                        "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}]}).encode()
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 0, "model": "chatter", "status": "completed",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "hi there", "annotations": []}]}],
            "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}


def engine(name: str):
    """A scripted engine answering by path, naming itself in every answer."""
    async def script(head, body, w):
        path = head.split(b" ", 2)[1]
        if path == b"/v1/embeddings":
            w.write(http_response(body=EMBEDDING))
        elif path == b"/v1/responses" and json.loads(body).get("stream"):
            events = [("response.created", {"type": "response.created", "sequence_number": 0,
                                            "response": {**RESPONSE, "status": "in_progress", "output": []}}),
                      ("response.completed", {"type": "response.completed", "sequence_number": 1,
                                              "response": RESPONSE})]
            sse = b"".join(chunk(f"event: {e}\ndata: {json.dumps(d)}\n\n".encode()) for e, d in events)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + sse + b"0\r\n\r\n")
        elif path == b"/v1/responses":
            w.write(http_response(body=json.dumps(RESPONSE).encode()))
        elif path == b"/tokenize":
            w.write(http_response(body=json.dumps({"tokens": [1, 2, 3], "engine": name}).encode()))
        else:
            w.write(http_response(body=json.dumps({"id": "x", "object": "text_completion", "model": name,
                                                   "choices": [{"index": 0, "text": name,
                                                                "finish_reason": "stop"}]}).encode()))
        await w.drain()
        return True
    return script


@pytest.fixture(scope="module")
def dep():
    d = FaultyDeployment([engine("a"), engine("b"), engine("c")])
    d.upstreams[0].models = ["chatter"]
    d.upstreams[1].models = ["chatter", "embedder"]
    d.upstreams[2].models = ["embedder"]

    async def reread():  # the probes read /v1/models before the test changed the lists
        for up in d.runtime.upstreams.values():
            await d.runtime.prober.read_models(up)
    d.call(reread())
    yield d
    assert d.settle() == (0, 0, 0)
    d.close()


def client(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key="unused", max_retries=0, timeout=10)


def test_requests_go_only_to_replicas_serving_their_model(dep):
    c = client(dep)
    seen = {c.completions.with_raw_response.create(model="chatter", prompt=f"p{i}").headers["x-kvroute-replica"]
            for i in range(8)}
    assert seen == {"r0", "r1"}
    seen = {c.embeddings.with_raw_response.create(model="embedder", input=f"text {i}").headers["x-kvroute-replica"]
            for i in range(8)}
    assert seen == {"r1", "r2"}


def test_an_unknown_model_is_a_404_in_openais_format(dep):
    with pytest.raises(openai.NotFoundError) as info:
        client(dep).completions.create(model="nope", prompt="x")
    err = info.value.body
    assert err["code"] == "model_not_found" and "chatter" in err["message"] and "embedder" in err["message"]


def test_the_model_list_aggregates_every_healthy_replica(dep):
    assert sorted(m.id for m in client(dep).models.list().data) == ["chatter", "embedder"]


def test_embeddings_pass_through(dep):
    e = client(dep).embeddings.create(model="embedder", input="hello")
    assert e.data[0].embedding == [0.25, -0.5]


def test_responses_pass_through_streaming_and_not(dep):
    c = client(dep)
    assert c.responses.create(model="chatter", input="hi").output_text == "hi there"
    events = [e.type for e in c.responses.create(model="chatter", input="hi", stream=True)]
    assert events == ["response.created", "response.completed"]  # no [DONE], and no error appended


def test_tokenize_pass_through(dep):
    r = httpx.post(f"{dep.url}/tokenize", json={"model": "chatter", "prompt": "hello"})
    assert r.status_code == 200 and r.json()["tokens"] == [1, 2, 3] and r.json()["engine"] in ("a", "b")


def test_llama_server_serves_its_one_model_whatever_name_the_client_uses():
    d = FaultyDeployment([engine("a")], engine="llamacpp",
                         metrics=b"llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n")
    try:
        d.upstreams[0].models = ["/models/tiny.gguf"]  # llama-server lists its file path

        async def reread():
            await d.runtime.prober.read_models(d.runtime.upstreams["r0"])
        d.call(reread())
        r = client(d).completions.with_raw_response.create(model="gpt-4o", prompt="hi")
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "r0"
    finally:
        d.settle()
        d.close()
