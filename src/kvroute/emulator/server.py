"""`kvroute emulate`: an engine replica emulated in real time behind the OpenAI API.

Requests go through the simulator's engine model (continuous batching, chunked prefill, paged
KV cache with prefix caching, preemption), stepping token by token so streams arrive at the
modelled pace. ``/metrics`` exports the chosen engine's own metric names so the gateway's probes
read it exactly as they read vLLM, SGLang or llama.cpp; SGLang's ``/get_load`` is served too.

Fault knobs, for tests and chaos drills (flags, or ``POST /_fault`` with the same keys):
``fail_rate`` (fraction answered 500 before any byte), ``hang`` (accept, never answer),
``close_after_tokens`` (drop the connection mid-stream), ``slowdown`` (model time ×N),
``probe_hang`` (``/metrics`` and ``/health`` never answer). What real vLLM did that the plain
emulator does not — empty-text stream events, a frozen engine core behind a live API server,
``max_model_len`` — are options too (``emulator/quirks.py``).

Generated text is deterministic in its context: each token is a word chosen by a hash of every
word before it (prompt, then what was generated), so a request continued elsewhere with its
prompt plus the text generated so far produces exactly what an uninterrupted run would have.
Chat requests continue a trailing assistant message the way the engines do: on
``continue_final_message: true`` with ``add_generation_prompt: false`` (vLLM, SGLang and
llama-server alike), and in llama-server also unasked (its default assistant prefill).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from kvroute.emulator.faults import Faults
from kvroute.emulator.kv_events import EmulatorEvents, KVEventsOptions, pseudo_token_ids
from kvroute.emulator.pd import PDEngine, PDRefused, add_routes, start_bootstrap
from kvroute.emulator.quirks import EmptyText, Freeze, context_error, filtered_metrics, model_card
from kvroute.emulator.realtime import RealtimeLoop, timers_handler
from kvroute.emulator.text import TextModel, chat_context
from kvroute.gateway.http import error_object
from kvroute.perf.loader import load_profile
from kvroute.perf.profile import HardwareProfile
from kvroute.prefix import BlockHasher, PromptError, completion_key
from kvroute.sim.engine import DONE, Engine, Seq

ENGINES = ("vllm", "sglang", "llamacpp")
EMULATOR = web.AppKey("emulator", object)
DEFAULT_MAX_TOKENS = 16


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0


class Emulator:
    """An engine without a GPU: the simulator's engine model stepped in real time behind a
    vLLM/SGLang/llama.cpp-compatible API, answering with deterministic text and the engine's own metric
    names."""

    def __init__(self, profile: HardwareProfile, engine_type: str = "vllm", model: str = "emulated",
                 faults: Faults | None = None, seed: int = 0, block_tokens: int = 64,
                 bytes_per_token: float = 4.0, pd: PDEngine | None = None,
                 max_model_len: int | None = None, events: EmulatorEvents | None = None):
        """``events``: publish the cache's KV events (``emulator/kv_events.py``)."""
        if engine_type not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine_type!r}")
        self.profile = profile
        self.engine_type = engine_type
        self.model = model
        self.faults = faults or Faults()
        self.rng = random.Random(seed)
        self.hasher = BlockHasher(block_tokens)
        if not 0.5 <= bytes_per_token <= 16:
            raise ValueError(f"bytes_per_token must be from 0.5 to 16, got {bytes_per_token}")
        # a tokenizer other than kvroute's bytes/4 estimate: text prompts count bytes / this
        # many tokens (prefix blocks stay the hasher's byte spans, worth more or fewer tokens)
        self.bytes_per_token = bytes_per_token
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len}")
        self.max_model_len = max_model_len  # vLLM's context limit: in /v1/models, enforced
        self.freeze = Freeze()
        self.freeze.set(self.faults.frozen)
        self.clock = RealtimeLoop(slowdown=self.faults.slowdown)
        # prefill/decode disaggregation (emulator/pd.py); a mixed engine by default
        self.pd = pd or PDEngine(kv_bytes_per_token=profile.kv_bytes_per_token, sglang=engine_type == "sglang")
        self.streams: dict[str, _Stream] = {}
        self.events = events
        self.restart()

    def restart(self) -> None:
        """A fast engine restart: empty cache, counters from zero, a new process start time;
        requests in flight are cut."""
        for st in self.streams.values():
            st.queue.put_nowait(None)
        self.streams.clear()
        self.engine = Engine("emulated", self.profile, self.clock, self._first_token, self._finished,
                             on_step=self._stepped, max_jump_steps=1)
        if self.events is not None:
            self.events.restart(self.engine)
        self.started_at = time.time()
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- engine callbacks: one token per decoding sequence per step ----------------------------
    def _push(self, seq: Seq, n: int) -> None:
        st = self.streams.get(seq.rid)
        if st is None:
            return
        for _ in range(n):
            st.sent += 1
            st.queue.put_nowait(st.sent)
        self.generation_tokens_total += n

    def _first_token(self, seq: Seq, t: float) -> None:
        self.clock.first_token(seq.payload, t)  # its lateness (emulator/realtime.py)
        self._push(seq, 1)

    def _stepped(self, seqs: list[Seq]) -> None:
        for seq in seqs:
            if seq.state != DONE:
                self._push(seq, 1)

    def _finished(self, seq: Seq, t: float) -> None:
        st = self.streams.get(seq.rid)
        if st is not None:
            self._push(seq, max(0, seq.output - st.sent))
            st.queue.put_nowait(None)

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, key, max_tokens: int, usage: dict, remote=None):
        """Yields token indexes as the model produces them; fills ``usage`` when done.
        ``remote``: the prompt's KV comes from a prefill engine (``Seq.remote``)."""
        entered = time.monotonic()
        hashes, prompt_tokens = self.hasher(key)
        block_tokens = self.hasher.block_tokens
        if isinstance(key, str) and self.bytes_per_token != 4.0:
            prompt_tokens = math.ceil(len(key.encode("utf-8", "surrogatepass")) / self.bytes_per_token)
            block_tokens = max(1, round(block_tokens * 4.0 / self.bytes_per_token))
        rid = uuid.uuid4().hex
        seq = Seq(rid, max(1, prompt_tokens), max(1, max_tokens), hashes, block_tokens, max_new=max(1, max_tokens))
        seq.remote = remote
        too_long = context_error(seq.prompt, seq.output, self.max_model_len)
        if too_long:
            raise web.HTTPBadRequest(text=json.dumps(error_object(too_long, param="max_tokens")),
                                     content_type="application/json")
        if not self.engine.fits(seq.prompt, seq.output):
            raise web.HTTPBadRequest(
                text=json.dumps(error_object(f"prompt ({seq.prompt} tokens) + max_tokens ({seq.output}) "
                                             f"exceed the KV capacity ({self.engine.capacity} tokens)",
                                             code="exceed_context_size_error")),
                content_type="application/json")
        st = self.streams[rid] = _Stream()
        self.requests_total += 1
        self.prompt_tokens_total += seq.prompt
        events = self.events
        if events is not None:
            events.tokens[rid] = pseudo_token_ids(key)
        try:
            await self.freeze.wait()  # a frozen core takes the request and schedules nothing
            seq.payload = (entered, self.clock.now)  # for RealtimeLoop.first_token
            self.engine.submit(seq)
            while True:
                item = await st.queue.get()
                await self.freeze.wait()
                if item is None:
                    break
                yield item
        finally:
            self.streams.pop(rid, None)
            if events is not None:
                events.tokens.pop(rid, None)
            if seq.state != DONE:  # client went away: free the engine's resources
                self.engine.cancel(seq)
        usage.update({"prompt_tokens": seq.prompt, "completion_tokens": seq.output,
                      "total_tokens": seq.prompt + seq.output,
                      "prompt_tokens_details": {"cached_tokens": max(0, seq.cached)}})

    # -- metrics ----------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        """The Prometheus text a real engine of this type would export now: running, waiting, KV usage, token
        counters, start time."""
        e = self.engine
        running, waiting, usage = e.running, len(e.waiting), e.kv_usage(self.clock.now)
        lines = []

        def gauge(name: str, value: float, help_: str) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge",
                          f'{name}{{model_name="{self.model}"}} {value}'])

        def counter(name: str, value: float, help_: str) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"])

        if self.engine_type == "vllm":
            gauge("vllm:num_requests_running", running, "Requests in the running batch.")
            gauge("vllm:num_requests_waiting", waiting, "Requests waiting to be scheduled.")
            gauge("vllm:kv_cache_usage_perc", usage, "KV-cache usage, 0..1 (blocks held by requests).")
            counter("vllm:prompt_tokens_total", self.prompt_tokens_total, "Prefill tokens processed.")
            lines.extend(["# HELP vllm:cache_config_info KV-cache configuration.",
                          "# TYPE vllm:cache_config_info gauge",
                          f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{e.capacity // 16}"}} 1.0'])
            counter("process_start_time_seconds", self.started_at, "Start time of the process.")
        elif self.engine_type == "sglang":
            if e.gauge is not None:  # SGLang writes both at prefill batches and every 40th decode step
                waiting, running = e.gauge.read(self.clock.now), e.gauge.running  # (sim/queue_gauge.py)
            gauge("sglang:num_running_reqs", running, "Running requests.")
            gauge("sglang:num_queue_reqs", waiting, "Queued requests.")
            gauge("sglang:token_usage", usage, "KV token usage, 0..1.")
            counter("sglang:prompt_tokens_total", self.prompt_tokens_total, "Prefill tokens processed.")
            gauge("sglang:max_total_num_tokens", e.capacity, "KV capacity in tokens.")
            counter("process_start_time_seconds", self.started_at, "Start time of the process.")
        else:  # llama-server's set: no KV-usage gauge, no process metrics
            if e.gauge is not None:  # requests_deferred: found no free slot (sim/deferred_gauge.py)
                waiting, running = e.gauge.read(self.clock.now), e.gauge.running
            gauge("llamacpp:requests_processing", running, "Requests being processed.")
            gauge("llamacpp:requests_deferred", waiting, "Requests deferred (queued).")
            counter("llamacpp:prompt_tokens_total", self.prompt_tokens_total, "Prompt tokens processed.")
            counter("llamacpp:tokens_predicted_total", self.generation_tokens_total, "Tokens generated.")
        return "\n".join(lines) + "\n"


async def _settled(gen, plan, usage: dict):
    """Pass tokens through; a prefill leg that does not finish (cancelled, failed) tells its plan."""
    finished = False
    try:
        async for item in gen:
            yield item
        finished = True
    finally:
        if not finished:
            plan.failed("the prefill did not finish")
        await gen.aclose()


# -- HTTP -----------------------------------------------------------------------------------------

def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
    return web.json_response(error_object(message, type_, param), status=status)


async def _read_json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text=json.dumps(error_object("body is not valid JSON")),
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=json.dumps(error_object("body must be a JSON object")),
                                 content_type="application/json")
    return body


def build_app(emu: Emulator) -> web.Application:
    """The aiohttp app of one emulator: OpenAI chat/completions (streamed or not), /v1/models, /metrics,
    /health, SGLang's /get_load, and /_fault, /_restart and /_timers for tests."""
    app = web.Application()
    app[EMULATOR] = emu

    async def completions(request: web.Request, chat: bool) -> web.StreamResponse:
        f = emu.faults
        body = await _read_json(request)
        if f.hang:
            await asyncio.sleep(3600)
        if f.fail_rate and emu.rng.random() < f.fail_rate:
            if "bootstrap_room" in body and emu.pd.role == "prefill":  # its decode engine hears of it
                emu.pd._sglang_prefill(body["bootstrap_room"]).failed("injected failure")
            return _error(500, "injected failure", "server_error")
        key: str | list[int]
        try:
            if chat:
                key, refused = chat_context(body, emu.engine_type)
                if refused:
                    return _error(400, refused, param="messages")
            else:
                key = completion_key(body.get("prompt"))
        except PromptError as exc:
            return _error(400, str(exc), param="messages" if chat else "prompt")
        words = TextModel(key if isinstance(key, str) else " ".join(map(str, key)))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer", param="max_tokens")
        try:
            plan = await emu.pd.plan(body)  # a prefill or decode leg (emulator/pd.py)
        except PDRefused as exc:
            return _error(exc.status, str(exc), "server_error" if exc.status >= 500 else "invalid_request_error")
        if plan is not None and plan.max_tokens is not None:
            max_tokens = plan.max_tokens
        stream = bool(body.get("stream", False))
        created = int(time.time())
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        usage: dict = {}
        gen = emu.generate(key, max_tokens, usage, plan.remote if plan is not None else None)
        if plan is not None:
            gen = _settled(gen, plan, usage)
        if not stream:
            async def run_to_end() -> int:
                n = 0
                async for _ in gen:
                    n += 1
                return n
            work = asyncio.ensure_future(run_to_end())
            # llama-server keeps generating a non-stream answer after its client left
            n = await (asyncio.shield(work) if f.ignore_disconnect else work)
            text = "".join(words.next() for _ in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
            extra = plan.done(usage["prompt_tokens"]) if plan is not None else {}
            return web.json_response({"id": cid, "object": obj, "created": created, "model": emu.model,
                                      "choices": [choice], "usage": usage, **extra})
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        if f.close_after_stream:
            headers["Keep-Alive"] = "timeout=5, max=100"  # advertised, and then not honoured
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        empty = EmptyText(f.empty_text)  # on: vLLM's stream shape (emulator/quirks.py)
        if chat and empty:  # vLLM announces the role in an event of its own
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            payload = {"id": cid, "object": chunk_obj, "created": created, "model": emu.model, "choices": [role]}
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
        last = max(1, max_tokens) - 1
        i = 0
        async for _ in gen:
            if f.close_after_tokens is not None and i >= f.close_after_tokens:
                if request.transport is not None:
                    request.transport.close()  # abrupt: no terminating chunk
                await gen.aclose()
                return resp
            token = empty.text(words.next())
            finish = None
            if empty and i == last:  # vLLM: the last token's event carries the ending
                token, finish = token + empty.flush(), "length"
            delta = ({"index": 0, "delta": ({"role": "assistant", "content": token} if i == 0 and not empty
                                             else {"content": token}), "finish_reason": finish}
                     if chat else {"index": 0, "text": token, "finish_reason": finish})
            payload = {"id": cid, "object": chunk_obj, "created": created, "model": emu.model, "choices": [delta]}
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
            i += 1
        if empty:  # vLLM's usage chunk (stream_options.include_usage) has no choices
            final = []
        else:
            final = [{"index": 0, "delta": {}, "finish_reason": "length"} if chat
                     else {"index": 0, "text": "", "finish_reason": "length"}]
        tail = {"id": cid, "object": chunk_obj, "created": created, "model": emu.model, "choices": final,
                "usage": usage, **(plan.done(usage["prompt_tokens"]) if plan is not None else {})}
        await resp.write(f"data: {json.dumps(tail)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        if f.close_after_stream and request.transport is not None:
            request.transport.close()  # after the last chunk is flushed, like llama-server
        return resp

    async def chat(request):
        return await completions(request, True)

    async def complete(request):
        return await completions(request, False)

    async def models(request):
        return web.json_response({"object": "list", "data": [model_card(emu.model, emu.max_model_len)]})

    async def health(request):
        if emu.faults.probe_hang:
            await asyncio.sleep(3600)
        return web.json_response({"status": "ok"})

    async def metrics(request):
        if emu.faults.probe_hang:
            await asyncio.sleep(3600)
        return web.Response(text=emu.metrics_text(), content_type="text/plain")

    async def metrics_filtered(request):  # vLLM's prometheus_client app under /metrics/ (emulator/quirks.py)
        if emu.faults.probe_hang:
            await asyncio.sleep(3600)
        return web.Response(text=filtered_metrics(emu.metrics_text(), request.query.getall("name[]", [])),
                            content_type="text/plain")

    async def get_load(request):
        e = emu.engine
        return web.json_response([{"dp_rank": 0, "num_reqs": e.running + len(e.waiting),
                                   "num_waiting_reqs": len(e.waiting),
                                   "num_tokens": int(e.kv_usage(emu.clock.now) * e.capacity)}])

    async def fault(request):
        body = await _read_json(request)
        try:
            emu.faults.update(body)
            emu.clock.slowdown = emu.faults.slowdown
            emu.freeze.set(emu.faults.frozen)
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response({"faults": emu.faults.__dict__})

    async def restart(request):
        emu.restart()
        return web.json_response({"restarted_at": emu.started_at})

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if emu.engine_type == "vllm":
        app.router.add_get("/metrics/", metrics_filtered)
    app.router.add_get("/get_load", get_load)
    add_routes(app, emu.pd)
    app.router.add_post("/_fault", fault)
    app.router.add_post("/_restart", restart)
    app.router.add_get("/_timers", timers_handler(emu.clock))  # timer lateness (emulator/realtime.py)
    return app


async def start_emulator(host: str, port: int, profile: str | HardwareProfile = "l4-llama3.1-8b",
                         engine_type: str = "vllm", faults: Faults | None = None,
                         model: str = "emulated", bytes_per_token: float = 4.0, pd_role: str = "mixed",
                         bootstrap_port: int | None = None, kv_link_gb_s: float = 25.0,
                         max_model_len: int | None = None, kv_events: KVEventsOptions | None = None,
                         block_tokens: int = 64) -> tuple[web.AppRunner, Emulator, int]:
    """Start an emulator listening on ``host:port`` (0: any free port); returns its runner (cleanup() stops
    it), the Emulator and the port. ``pd_role``: a prefill or decode engine of a disaggregated
    deployment (emulator/pd.py); ``bootstrap_port``: also serve SGLang's bootstrap there (0: any
    free port, then ``emu.pd.bootstrap_port``); ``kv_link_gb_s``: the simulated KV link;
    ``kv_events``: publish the cache's KV events there (the runner's cleanup closes the publisher)."""
    prof = load_profile(profile) if isinstance(profile, str) else profile
    pd = PDEngine(pd_role, prof.kv_bytes_per_token, kv_link_gb_s, sglang=engine_type == "sglang")
    events = None
    if kv_events is not None:
        publisher = kv_events.publisher()
        publisher.start()
        events = EmulatorEvents(publisher, block_tokens, kv_events.hash_bytes)
    emu = Emulator(prof, engine_type, model, faults, bytes_per_token=bytes_per_token, pd=pd, events=events,
                   block_tokens=block_tokens, max_model_len=max_model_len)
    app = build_app(emu)
    app.on_cleanup.append(lambda _app: pd.close())
    if events is not None:
        async def close_events(_app: web.Application) -> None:
            await events.publisher.close()
        app.on_cleanup.append(close_events)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound: int = runner.addresses[0][1]
    pd.host, pd.port = host, bound
    if bootstrap_port is not None:
        pd.bootstrap_port = await start_bootstrap(runner, host, bootstrap_port)
    return runner, emu, bound
