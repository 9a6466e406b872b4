"""The gateway's request handling: OpenAI endpoints in, the routed replica's response out.

A completion request is parsed and validated, keyed and hashed once, admitted by the runtime
(route now or wait in the LB queue), then proxied. Streams pass through chunk by chunk as the
upstream produces them. A connection failure or a 5xx before any byte reached the client is
retried on another replica (bounded, exponential backoff with jitter); once bytes are out, an
upstream failure ends the stream with an SSE error event. Every exit path undoes the router's
accounting exactly once. HTTP itself is ``gateway/http.py``; upstreams are ``gateway/upstream.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import signal
import time
import uuid
from typing import Any

import aiohttp

from kvroute.gateway.config import GatewayConfig, load_config
from kvroute.gateway.http import HTTPServer, Request as HTTPRequest, Responder
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.runtime import QueueFull, QueueTimeout, Runtime
from kvroute.gateway.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from kvroute.model import DecisionKind, Request
from kvroute.prefix import BlockHasher, PromptError, chat_key, completion_key

log = logging.getLogger("kvroute.gateway")
access = logging.getLogger("kvroute.access")
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect",
               "accept-encoding", "upgrade", "te", "trailer", "proxy-authorization", "server", "date"}
ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET",
          "/health": "GET", "/metrics": "GET"}


class BadInput(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Proxy:
    """Per-request routing and forwarding; one instance per application."""

    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.hasher = BlockHasher(runtime.config.block_tokens, runtime.config.tokenizer_path)
        self.rng = random.Random()
        self.id_prefix = f"{uuid.uuid4().hex[:8]}-"  # request ids: unique per process, cheap per request
        self.ids = itertools.count(1)
        self.session_headers = [h.lower() for h in runtime.config.session_headers]

    # -- request parsing --------------------------------------------------------------------
    def parse(self, raw: bytes, chat: bool, headers: dict[str, str]) -> tuple[dict, Request]:
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            raise BadInput("request body is not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                           f"column {exc.colno}") from None
        if not isinstance(body, dict):
            raise BadInput("request body must be a JSON object")
        field = "messages" if chat else "prompt"
        if field not in body:
            raise BadInput(f"missing required field '{field}'", field)
        for name, typ in (("model", str), ("stream", bool), ("user", str)):
            if body.get(name) is not None and not isinstance(body[name], typ):
                raise BadInput(f"field '{name}' must be a {typ.__name__}", name)
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise BadInput(f"field '{name}' must be a positive integer", name)
        try:
            key = chat_key(body["messages"]) if chat else completion_key(body["prompt"])
        except PromptError as exc:
            raise BadInput(str(exc), field) from None
        hashes, tokens = self.hasher(key)
        routing_key = next((headers[h] for h in self.session_headers if h in headers), None)
        if routing_key is None and isinstance(body.get("user"), str):
            routing_key = body["user"]
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        req = Request(id=f"{self.id_prefix}{next(self.ids)}", arrival_s=time.monotonic(),
                      routing_key=routing_key, block_hashes=hashes, block_tokens=self.hasher.block_tokens,
                      prompt_tokens=tokens, max_output_tokens=max_out,
                      region=headers.get("x-kvroute-region"), residency=headers.get("x-kvroute-residency"))
        return body, req

    # -- the handler ----------------------------------------------------------------------------
    async def handle(self, request: HTTPRequest, resp: Responder, chat: bool) -> None:
        rt = self.rt
        route = "chat" if chat else "completions"
        t0 = time.monotonic()
        try:
            body, req = self.parse(request.body, chat, request.headers)
        except BadInput as exc:
            resp.send_error(400, str(exc), param=exc.param)
            return self._count(route, resp)
        if rt.draining:
            resp.send_error(503, "gateway is draining", "server_error", headers=[("Retry-After", "1")])
            return self._count(route, resp)
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_HEADERS]
        served: dict[str, Any] = {"excluded": []}  # where it went, for the access line
        if rt.config.access_log:
            resp.extra_headers.append(("x-request-id", req.id))
        try:
            await self._route_and_forward(request, resp, route, bool(body.get("stream")), req, headers,
                                          served, t0)
        finally:
            if rt.config.access_log:
                self._access(resp, route, body, req, served, t0)

    def _access(self, resp: Responder, route: str, body: dict, req: Request, served: dict, t0: float) -> None:
        """One JSON line per request: what happened, never the prompt unless asked."""
        fields = {"rid": req.id, "route": route, "status": resp.status or 499,  # 499: client left
                  "replica": served.get("replica"), "branch": served.get("branch"),
                  "prompt_tokens": req.prompt_tokens, "stream": bool(body.get("stream")),
                  "ms": round((time.monotonic() - t0) * 1000, 2)}
        if served["excluded"]:
            fields["failed_on"] = served["excluded"]
        if self.rt.config.log_prompts:
            fields["prompt"] = (chat_key(body["messages"]) if route == "chat" else str(body.get("prompt")))[:512]
        access.info("request", extra={"fields": fields})

    async def _route_and_forward(self, request: HTTPRequest, resp: Responder, route: str, stream: bool,
                                 req: Request, headers, served: dict, t0: float) -> None:
        rt = self.rt
        rc = rt.config.retry
        excluded = served["excluded"]
        for attempt in range(1, rc.max_attempts + 1):
            try:
                decision = await rt.admit(req)
            except QueueFull as exc:
                rt.metrics.rejected.labels("full").inc()
                resp.send_error(429, str(exc), "rate_limit_error", code="queue_full", headers=[("Retry-After", "1")])
                return self._count(route, resp)
            except QueueTimeout as exc:
                rt.metrics.rejected.labels("timeout").inc()
                resp.send_error(503, str(exc), "server_error", code="queue_timeout", headers=[("Retry-After", "2")])
                return self._count(route, resp)
            if decision.kind is DecisionKind.NONE:
                resp.send_error(503, f"no replica can serve this request: {decision.reason}", "server_error",
                                code=decision.branch)
                return self._count(route, resp)
            target = decision.target
            served["replica"], served["branch"] = target, decision.branch
            rt.dispatched(req, decision)
            rt.metrics.count_branch(rt.policy_name, decision.branch)
            retry = await self._forward(request.body, resp, route, headers, req, target, stream, t0,
                                        last_try=attempt == rc.max_attempts)
            if retry is None:
                return self._count(route, resp)
            # retryable failure before any byte reached the client
            rt.metrics.retries.labels(retry).inc()
            excluded.append(target)
            req.exclude = tuple(excluded)
            delay = min(rc.backoff_max_s, rc.backoff_s * 2 ** (attempt - 1))
            await asyncio.sleep(delay * (0.5 + self.rng.random()))  # jitter around the step

    def _count(self, route: str, resp: Responder) -> None:
        self.rt.metrics.count_request(route, resp.status, self.rt.policy_name)

    def _resp_headers(self, upstream: UpstreamResponse, target: str) -> list[tuple[str, str]]:
        out = [(k, v) for k, v in upstream.headers if k.lower() not in HOP_HEADERS]
        if self.rt.config.replica_header:
            out.append(("x-kvroute-replica", target))
        return out

    async def _forward(self, raw: bytes, resp: Responder, route: str, headers, req: Request, target: str,
                       stream: bool, t0: float, last_try: bool) -> str | None:
        """Proxy one attempt. Returns None when a response was sent, or a retry reason if nothing
        was sent yet."""
        rt = self.rt
        up = rt.upstreams.get(target)
        if up is None:  # removed by a reload between decision and now
            rt.release(req.id)
            return "replica-removed"
        to = rt.config.timeouts
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        upstream = None
        try:
            try:
                upstream = await up.pool.post(path, raw, headers, connect_s=to.connect_s,
                                              first_byte_s=to.first_byte_s, idle_s=to.idle_s)
                if upstream.status >= 500:
                    await upstream.read()
                    raise UpstreamError(f"answered {upstream.status}")
                payload = await upstream.read() if not stream or upstream.status != 200 else None
            except UpstreamError as exc:  # nothing has reached the client yet: retryable
                rt.upstream_failed(target)
                log.warning("upstream %s failed before responding: %s", target, exc)
                if last_try:
                    resp.send_error(502, f"upstream {target} failed: {exc}", "server_error", code="upstream_error")
                    return None
                return "timeout" if isinstance(exc, UpstreamTimeout) else "error"
            if payload is None:
                await self._stream(resp, upstream, req, target, t0)
                return None
            rt.first_token(req.id)
            rt.metrics.ttft.observe(time.monotonic() - t0)
            if upstream.status < 400:
                rt.upstream_ok(target)
            resp.send(upstream.status, payload, self._resp_headers(upstream, target), content_type=None)
            rt.metrics.e2e.observe(time.monotonic() - t0)
            return None
        finally:
            rt.release(req.id)
            if upstream is not None:
                upstream.release()  # kept alive when fully read; closed (cancelling upstream) otherwise

    async def _stream(self, resp: Responder, upstream: UpstreamResponse, req: Request, target: str,
                      t0: float) -> None:
        rt = self.rt
        resp.start(upstream.status, self._resp_headers(upstream, target))
        first = True
        try:
            while (chunk := await upstream.next_chunk()) is not None:
                if first:
                    first = False
                    rt.first_token(req.id)
                    rt.metrics.ttft.observe(time.monotonic() - t0)
                await resp.write(chunk)
            rt.upstream_ok(target)
        except UpstreamError as exc:
            # bytes may already be out: end the stream cleanly with an SSE error event
            rt.upstream_failed(target)
            log.warning("upstream %s failed mid-stream: %s", target, exc)
            event = {"error": {"message": f"upstream {target} failed mid-stream: {exc}",
                               "type": "server_error", "param": None, "code": "upstream_stream_error"}}
            await resp.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
        await resp.end()
        rt.metrics.e2e.observe(time.monotonic() - t0)


class Gateway:
    """A running gateway: start, reload, drain, stop — usable in-process (tests, demo) or by `serve`."""

    def __init__(self, config: GatewayConfig, config_path: str | None = None):
        self.config = config
        self.config_path = config_path
        self.runtime = Runtime(config, GatewayMetrics)
        self.proxy = Proxy(self.runtime)
        self.http = HTTPServer(self.dispatch, config.max_body_bytes)
        self.port = config.port

    async def dispatch(self, request: HTTPRequest, resp: Responder) -> None:
        method = ROUTES.get(request.path)
        if method is None:
            resp.send_error(404, f"unknown path {request.path}", code="not_found")
        elif request.method != method:
            resp.send_error(405, f"method {request.method} not allowed on {request.path}; allowed: {method}",
                            headers=[("Allow", method)])
        elif request.path == "/v1/chat/completions":
            await self.proxy.handle(request, resp, True)
        elif request.path == "/v1/completions":
            await self.proxy.handle(request, resp, False)
        elif request.path == "/health":
            self._health(resp)
        elif request.path == "/metrics":
            resp.send(200, self.runtime.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")
        else:
            await self._models(resp)

    def _health(self, resp: Responder) -> None:
        rt = self.runtime
        healthy = sum(1 for u in rt.upstreams.values() if u.endpoint.routable)
        ok = healthy and not rt.draining
        body = {"status": "ok" if ok else "unavailable", "replicas": len(rt.upstreams), "healthy": healthy,
                "queue": len(rt.queue), "policy": rt.policy_name}
        resp.send(200 if ok else 503, json.dumps(body).encode())

    async def _models(self, resp: Responder) -> None:
        rt = self.runtime
        for up in rt.upstreams.values():
            if up.endpoint.routable:
                try:
                    async with rt.session.get(f"{up.config.url}/v1/models",
                                              timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            resp.send(200, await r.read())
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue
        resp.send(200, b'{"object": "list", "data": []}')

    async def start(self) -> int:
        await self.runtime.start()
        self.port = await self.http.start(self.config.host, self.config.port)
        return self.port

    @property
    def active(self) -> int:
        return self.http.active

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
        await self.http.stop_accepting()
        await self.http.wait_idle(self.config.drain_timeout_s)
        await self.stop()

    async def stop(self) -> None:
        await self.http.close()
        await self.runtime.stop()


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
            out.update(getattr(record, "fields", {}))
            if record.exc_info:
                out["exc"] = self.formatException(record.exc_info)
            return json.dumps(out)

    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvroute")
    root.handlers[:] = [handler]
    root.setLevel(level)
