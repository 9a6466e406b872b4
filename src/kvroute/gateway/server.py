"""The gateway's HTTP server: OpenAI endpoints in, the routed replica's response out.

A completion request is parsed and validated, keyed and hashed once, admitted by the runtime
(route now or wait in the LB queue), then proxied. Streams pass through chunk by chunk as the
upstream produces them. A connection failure or a 5xx before any byte reached the client is
retried on another replica (bounded, exponential backoff with jitter); once bytes are out, an
upstream failure ends the stream with an SSE error event. Every exit path undoes the router's
accounting exactly once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from kvroute.gateway.config import GatewayConfig, load_config
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.runtime import QueueFull, QueueTimeout, Runtime
from kvroute.model import DecisionKind, Request
from kvroute.prefix import BlockHasher, PromptError, chat_key, completion_key

log = logging.getLogger("kvroute.gateway")
RUNTIME = web.AppKey("runtime", Runtime)
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
               "accept-encoding", "upgrade", "te", "trailer", "proxy-authorization"}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error leaves as an OpenAI-style JSON body, including aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[RUNTIME].config.max_body_bytes
        return error_response(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    except web.HTTPMethodNotAllowed as exc:
        return error_response(405, f"method {request.method} not allowed on {request.path}; "
                                   f"allowed: {', '.join(sorted(exc.allowed_methods))}")
    except web.HTTPNotFound:
        return error_response(404, f"unknown path {request.path}", code="not_found")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug must not become a stack trace on the wire
        log.exception("unhandled error on %s", request.path)
        return error_response(500, "internal gateway error", "server_error")


class Proxy:
    """Per-request routing and forwarding; one instance per application."""

    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.hasher = BlockHasher(runtime.config.block_tokens, runtime.config.tokenizer_path)
        self.rng = random.Random()

    # -- request parsing --------------------------------------------------------------------
    def parse(self, raw: bytes, chat: bool, headers) -> tuple[dict, Request] | web.Response:
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            return error_response(400, "request body is not valid UTF-8")
        except json.JSONDecodeError as exc:
            return error_response(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                                       f"column {exc.colno}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        field = "messages" if chat else "prompt"
        if field not in body:
            return error_response(400, f"missing required field '{field}'", param=field)
        checks = (("model", str), ("stream", bool), ("user", str))
        for name, typ in checks:
            if name in body and body[name] is not None and not isinstance(body[name], typ):
                return error_response(400, f"field '{name}' must be a {typ.__name__}", param=name)
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                return error_response(400, f"field '{name}' must be a positive integer", param=name)
        try:
            key = chat_key(body["messages"]) if chat else completion_key(body["prompt"])
        except PromptError as exc:
            return error_response(400, str(exc), param=field)
        hashes, tokens = self.hasher(key)
        routing_key = next((headers[h] for h in self.rt.config.session_headers if h in headers), None)
        if routing_key is None and isinstance(body.get("user"), str):
            routing_key = body["user"]
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        req = Request(id=uuid.uuid4().hex, arrival_s=time.monotonic(), routing_key=routing_key,
                      block_hashes=hashes, block_tokens=self.hasher.block_tokens,
                      prompt_tokens=tokens, max_output_tokens=max_out,
                      region=headers.get("x-kvroute-region"), residency=headers.get("x-kvroute-residency"))
        return body, req

    # -- the handler ----------------------------------------------------------------------------
    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rt = self.rt
        route = "chat" if chat else "completions"
        t0 = time.monotonic()
        if rt.draining:
            return self._count(route, error_response(503, "gateway is draining", "server_error",
                                                     headers={"Retry-After": "1"}))
        raw = await request.read()
        parsed = self.parse(raw, chat, request.headers)
        if isinstance(parsed, web.Response):
            return self._count(route, parsed)
        body, req = parsed
        stream = bool(body.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        rc = rt.config.retry
        excluded: list[str] = []
        for attempt in range(1, rc.max_attempts + 1):
            try:
                decision = await rt.admit(req)
            except QueueFull as exc:
                rt.metrics.rejected.labels("full").inc()
                return self._count(route, error_response(429, str(exc), "rate_limit_error", code="queue_full",
                                                         headers={"Retry-After": "1"}))
            except QueueTimeout as exc:
                rt.metrics.rejected.labels("timeout").inc()
                return self._count(route, error_response(503, str(exc), "server_error", code="queue_timeout",
                                                         headers={"Retry-After": "2"}))
            if decision.kind is DecisionKind.NONE:
                return self._count(route, error_response(503, f"no replica can serve this request: {decision.reason}",
                                                         "server_error", code=decision.branch))
            target = decision.target
            rt.dispatched(req, decision)
            rt.metrics.branches.labels(rt.policy_name, decision.branch).inc()
            rt.metrics.prompt_tokens.inc(req.prompt_tokens)
            rt.metrics.prefix_hit_tokens.inc(req.prompt_tokens - req.new_prefill_tokens(decision.matched_blocks))
            outcome = await self._forward(request, route, raw, headers, req, target, stream, t0,
                                          last_try=attempt == rc.max_attempts)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            # retryable failure before any byte reached the client
            rt.metrics.retries.labels(outcome).inc()
            excluded.append(target)
            req.exclude = tuple(excluded)
            delay = min(rc.backoff_max_s, rc.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (0.5 + self.rng.random()))  # full jitter around the step
        return self._count(route, error_response(502, f"upstream failed after {rc.max_attempts} attempts "
                                                      f"({', '.join(excluded)})", "server_error",
                                                 code="upstream_error"))

    def _count(self, route: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.rt.metrics.requests.labels(route, str(resp.status), self.rt.policy_name).inc()
        return resp

    def _resp_headers(self, upstream: aiohttp.ClientResponse, target: str) -> dict[str, str]:
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        if self.rt.config.replica_header:
            out["x-kvroute-replica"] = target
        return out

    async def _forward(self, request, route, raw, headers, req: Request, target: str, stream: bool,
                       t0: float, last_try: bool) -> web.StreamResponse | str:
        """Proxy one attempt. Returns the response, or a retry reason if nothing was sent yet."""
        rt = self.rt
        up = rt.upstreams.get(target)
        if up is None:  # removed by a reload between decision and now
            rt.release(req.id)
            return "replica-removed"
        to = rt.config.timeouts
        timeout = aiohttp.ClientTimeout(total=None, connect=to.connect_s, sock_connect=to.connect_s,
                                        sock_read=to.first_byte_s)
        url = f"{up.config.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}"
        upstream = None
        try:
            try:
                upstream = await rt.session.post(url, data=raw, headers=headers, timeout=timeout)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, aiohttp.ClientPayloadError) as exc:
                rt.upstream_failed(target)
                log.warning("upstream %s failed before response: %s", target, exc.__class__.__name__)
                if last_try:
                    return self._count(route, error_response(502, f"upstream {target} unreachable: "
                                                                  f"{exc.__class__.__name__}", "server_error"))
                return "connect"
            if upstream.status >= 500:
                await upstream.read()
                rt.upstream_failed(target)
                if last_try:
                    return self._count(route, error_response(502, f"upstream {target} answered {upstream.status}",
                                                             "server_error", code="upstream_error"))
                return f"status-{upstream.status}"
            if not stream or upstream.status != 200:
                try:
                    payload = await upstream.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    rt.upstream_failed(target)
                    if last_try:
                        return self._count(route, error_response(502, f"upstream {target} failed mid-response: "
                                                                      f"{exc.__class__.__name__}", "server_error"))
                    return "read"
                rt.first_token(req.id)
                rt.metrics.ttft.observe(time.monotonic() - t0)
                if upstream.status < 400:
                    rt.upstream_ok(target)
                resp = web.Response(body=payload, status=upstream.status,
                                    headers=self._resp_headers(upstream, target))
                rt.metrics.e2e.observe(time.monotonic() - t0)
                return self._count(route, resp)
            return await self._stream(request, route, upstream, req, target, t0)
        finally:
            rt.release(req.id)
            if upstream is not None:
                upstream.release()  # back to the pool when fully read; closed otherwise

    async def _stream(self, request, route, upstream, req, target, t0) -> web.StreamResponse:
        rt = self.rt
        resp = web.StreamResponse(status=upstream.status, headers=self._resp_headers(upstream, target))
        resp.enable_chunked_encoding()
        idle = rt.config.timeouts.idle_s
        first = True
        try:
            await resp.prepare(request)
            it = upstream.content.iter_any()
            while True:
                try:
                    chunk = await asyncio.wait_for(it.__anext__(), idle if not first else rt.config.timeouts.first_byte_s)
                except StopAsyncIteration:
                    break
                if first:
                    first = False
                    rt.first_token(req.id)
                    rt.metrics.ttft.observe(time.monotonic() - t0)
                await resp.write(chunk)
            rt.upstream_ok(target)
            await resp.write_eof()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # bytes may already be out: end the stream cleanly with an SSE error event
            rt.upstream_failed(target)
            log.warning("upstream %s failed mid-stream: %s", target, exc.__class__.__name__)
            event = {"error": {"message": f"upstream {target} failed mid-stream ({exc.__class__.__name__})",
                               "type": "server_error", "param": None, "code": "upstream_stream_error"}}
            try:
                await resp.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                await resp.write_eof()
            except (ConnectionResetError, RuntimeError):
                pass
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: closing the upstream response (finally) cancels it there
            upstream.close()
            raise
        rt.metrics.e2e.observe(time.monotonic() - t0)
        return self._count(route, resp)


def build_app(config: GatewayConfig, runtime: Runtime | None = None) -> web.Application:
    rt = runtime or Runtime(config, GatewayMetrics)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[openai_errors])
    app[RUNTIME] = rt
    proxy = Proxy(rt)

    async def chat(request):
        return await proxy.handle(request, True)

    async def completions(request):
        return await proxy.handle(request, False)

    async def models(request):
        for up in rt.upstreams.values():
            if up.endpoint.routable:
                try:
                    async with rt.session.get(f"{up.config.url}/v1/models",
                                              timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return web.json_response(await r.json())
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    continue
        return web.json_response({"object": "list", "data": []})

    async def health(request):
        healthy = sum(1 for u in rt.upstreams.values() if u.endpoint.routable)
        body = {"status": "ok" if healthy and not rt.draining else "unavailable",
                "replicas": len(rt.upstreams), "healthy": healthy, "queue": len(rt.queue),
                "policy": rt.policy_name}
        return web.json_response(body, status=200 if healthy and not rt.draining else 503)

    async def metrics(request):
        return web.Response(body=rt.metrics.render(), content_type="text/plain", charset="utf-8")

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)

    async def on_startup(app):
        await rt.start()

    async def on_cleanup(app):
        await rt.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


class Gateway:
    """A running gateway: start, reload, drain, stop — usable in-process (tests, demo) or by `serve`."""

    def __init__(self, config: GatewayConfig, config_path: str | None = None):
        self.config = config
        self.config_path = config_path
        self.app = build_app(config)
        self.runtime: Runtime = self.app[RUNTIME]
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None
        self.port = config.port
        self.active = 0

    async def start(self) -> int:
        @web.middleware
        async def track(request, handler):
            self.active += 1
            try:
                return await handler(request)
            finally:
                self.active -= 1

        self.app.middlewares.insert(0, track)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        self.site = web.TCPSite(self.runner, self.config.host, self.config.port, reuse_address=True)
        await self.site.start()
        self.port = self.site._server.sockets[0].getsockname()[1]
        return self.port

    def reload(self) -> list[str]:
        if not self.config_path:
            return []
        new = load_config(self.config_path)
        changes = self.runtime.reconfigure(new)
        self.config = new
        return changes

    async def drain(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then stop."""
        self.runtime.draining = True
        if self.site is not None:
            await self.site.stop()
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def serve(config: GatewayConfig, config_path: str | None = None, on_ready=None) -> None:
    """Run until SIGTERM/SIGINT (graceful drain, exit 0); SIGHUP reloads the config file."""
    gw = Gateway(config, config_path)
    await gw.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def reload() -> None:
        try:
            changes = gw.reload()
            log.info("config reloaded: %s", ", ".join(changes) or "no changes")
        except Exception as exc:  # keep serving on the old config
            log.error("config reload rejected: %s", exc)

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload)
    if on_ready is not None:
        on_ready(gw)
    await stop.wait()
    log.info("draining: %d request(s) in flight", gw.active)
    await gw.drain()


def configure_logging(level: str = "INFO") -> None:
    """Structured (JSON-lines) logs; request logs carry ids, replicas and timings, never prompts."""

    class JsonFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname,
                                   "logger": record.name, "msg": record.getMessage()}
            if record.exc_info:
                out["exc"] = self.formatException(record.exc_info)
            return json.dumps(out)

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvroute")
    root.handlers[:] = [handler]
    root.setLevel(level)
