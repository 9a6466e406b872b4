"""A real vLLM prefill/decode pair behind the gateway's `vllm` P/D protocol (issue 23): two vLLM
CPU engines (the vLLM tier's venv and tiny model) with vLLM's ExampleConnector, which writes a
request's KV per layer to a shared folder and reads it on the other engine (no GPU, no NIXL).
The decode engine, never shown the prompt, reports the prefill engine's blocks as cached."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import openai
import pytest

from tests.vllm import engine as vllm

pytestmark = pytest.mark.skipif(not vllm.available(), reason="no .venv-vllm: `make vllm-env` installs vLLM")


@pytest.fixture(scope="module")
def pair():
    from kvroute.gateway.config import GatewayConfig
    from kvroute.gateway.server import Gateway
    from kvroute.replicas import ReplicaConfig

    root = Path(tempfile.mkdtemp(prefix="kvroute-vllm-pd-"))
    model = vllm.write_model(vllm.MODEL_DIR)
    held = vllm.held_ports(6)  # kept until the engines bind them (tests/vllm/engine.py)
    ports = [s.getsockname()[1] for s in held]
    connector = ("--kv-transfer-config", json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(root / "kv")}}))
    engines = [vllm.VLLMEngine(model, ports[3 * i], ports[3 * i + 1], ports[3 * i + 2], core=i % (os.cpu_count() or 1),
                               blocks=48, workdir=root / f"e{i}", extra_args=connector, worker_in_core=True)
               for i in range(2)]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)
    gw = None
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        vllm.release(held)
        gw = Gateway(GatewayConfig(port=0, pd={"protocol": "vllm"}, replicas=[
            ReplicaConfig(url=engines[0].url, id="p0", role="prefill", engine="vllm"),
            ReplicaConfig(url=engines[1].url, id="d0", role="decode", engine="vllm")]))
        call(gw.start())
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        vllm.release(held)
        if gw is not None:
            call(gw.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        for e in engines:
            e.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("stream", [False, True])
def test_the_decode_engine_serves_from_the_prefill_engines_kv(pair, stream):
    messages = [{"role": "user", "content": f"tell me a story, stream {stream}, " * 20}]
    if stream:
        chunks = list(pair.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        raw = pair.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=8,
                                                             temperature=0)
        assert (raw.headers["x-kvroute-replica"], raw.headers["x-kvroute-prefill"]) == ("d0", "p0")
        usage = raw.parse().usage
    assert usage.completion_tokens == 8
    # every full block before the prompt's last token came from the prefill engine's KV
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // vllm.BLOCK * vllm.BLOCK > 0
