"""A calibration prompt that fills an engine's context exactly (issue 21q): vLLM 0.32 answers 400
"max_tokens must be at least 1, got 0" rather than naming the context, and the calibration must
take it as a context overflow and retry shorter, as it does for a longer prompt. Checked against an
HTTP server on 127.0.0.1 that answers as vLLM's API server does
(vllm/entrypoints/serve/utils/api_utils.py ``get_max_tokens``: ``max_model_len - input_length``)."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from kvroute.calibrate.measure import CalibrationError, ContextOverflow, Sweep, _Engine

LIMIT = 100  # the engine's max_model_len, in tokens
BYTES_PER_TOKEN = 2


async def _completions(request: web.Request) -> web.Response:
    body = await request.json()
    if body.get("model") != "m":
        return web.json_response({"error": {"message": "The model `x` does not exist."}}, status=404)
    tokens = len(body["prompt"].encode()) // BYTES_PER_TOKEN
    if tokens > LIMIT:
        message = f"This model's maximum context length is {LIMIT} tokens. However, your request has {tokens}."
        return web.json_response({"error": {"message": message}}, status=400)
    max_tokens = min(body["max_tokens"], LIMIT - tokens)
    if max_tokens < 1:
        return web.json_response({"error": {"message": f"max_tokens must be at least 1, got {max_tokens}. "
                                                       "(parameter=max_tokens, value=0)",
                                            "type": "BadRequestError", "param": "max_tokens", "code": 400}},
                                 status=400)
    return web.json_response({"usage": {"prompt_tokens": tokens, "completion_tokens": max_tokens}})


async def _with_engine(check):
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await check(session, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _engine(session, url, model="m"):
    e = _Engine(session, url, model, Sweep(timeout_s=10), None)
    e.bytes_per_token = BYTES_PER_TOKEN  # as learned: a prompt of N tokens is exactly N tokens here
    return e


def test_a_prompt_that_fills_the_context_exactly_is_retried_shorter():
    async def check(session, url):
        e = _engine(session, url)
        with pytest.raises(ContextOverflow):
            await e.complete(e.prompt(LIMIT), 1)  # exactly the limit: no room for one output token
        return await e.sized(LIMIT)

    _, tokens = asyncio.run(_with_engine(check))
    assert tokens == int(LIMIT * 0.9)  # one retry, 10 % shorter


def test_other_refusals_still_stop_the_calibration():
    async def check(session, url):
        e = _engine(session, url, model="x")
        with pytest.raises(CalibrationError) as exc:
            await e.sized(10)
        return exc.value

    err = asyncio.run(_with_engine(check))
    assert not isinstance(err, ContextOverflow) and "does not exist" in str(err)
