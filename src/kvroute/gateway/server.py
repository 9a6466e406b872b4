"""The gateway application: its routes (the proxied OpenAI endpoints, health, metrics, models,
the admin and peer paths), authentication, reload, drain and stop — usable in-process (tests,
the demo) or by ``kvroute serve``. Its JSON-lines logging is ``gateway/logs.py``.

Parsing is ``gateway/openai.py``, proxying and retries ``gateway/proxy.py`` and
``gateway/retry.py``, HTTP itself ``gateway/http.py``.
"""

import asyncio
import gc
import json
import logging
from collections.abc import Coroutine
from typing import Any, Final, Literal

from kvroute.gateway.admin import handle_admin
from kvroute.gateway.auth import KeyState, bearer
from kvroute.gateway.breaker import CircuitState
from kvroute.gateway.config import GatewayConfig, load_config
from kvroute.gateway.front import Front
from kvroute.gateway.http import HTTPServer, Responder
from kvroute.gateway.http import Request as HTTPRequest
from kvroute.gateway.httpmsg import Pending
from kvroute.gateway.openai import PROXIED
from kvroute.gateway.peers import STATUS_PATH
from kvroute.gateway.runtime import Runtime
from kvroute.shutdown import until_stopped

log = logging.getLogger("kvroute.gateway")
RESTART_ONLY = ("host", "port", "pd")  # the listening socket and the P/D router; everything else reloads
_STATUS_PATH: Final = STATUS_PATH  # Final: a C static in a compiled build, not a dict lookup per request
ROUTES: Final = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/embeddings": "POST",
          "/v1/responses": "POST", "/tokenize": "POST", "/detokenize": "POST", "/v1/models": "GET",
          "/health": "GET", "/livez": "GET", "/readyz": "GET", "/metrics": "GET"}
# a path → its method and, when proxied, its Kind: one lookup per request, not a second one in PROXIED
# (~400 instructions for a new path str; eleventh round, docs/hot-path.md)
_ROUTES: Final = {path: (method, PROXIED.get(path)) for path, method in ROUTES.items()}


class Gateway:
    """A running gateway: start, reload, drain, stop — usable in-process (tests, demo) or by `serve`."""

    def __init__(self, config: GatewayConfig, config_path: str | None = None):
        self.config = config
        self.config_path = config_path
        self.runtime = Runtime(config)
        self.proxy = Front(self.runtime)
        self.http = HTTPServer(self.dispatch, config.http_limits())
        self.runtime.metrics.watch_http(self.http)
        self.port = config.port

    def dispatch(self, request: HTTPRequest, resp: Responder) -> Coroutine[Any, Any, None] | Pending | None:
        """Serve one request by path. HEAD is served wherever GET is, as a GET whose body the
        responder leaves out (``gateway/http.py``). What is answered at once returns None; a
        proxied request returns what ``Front.begin`` returns: None, a coroutine for the connection
        to await, or a Pending its callbacks finish (``gateway/front.py``)."""
        route = _ROUTES.get(request.path)
        method = route[0] if route is not None else None
        if request.method == "HEAD" and (method == "GET" or method is None):
            request.method = "GET"  # resp.head_only drops the body; admin and peer paths read GET
        if request.path.startswith("/admin/"):
            handle_admin(self.runtime, request, resp)
        elif request.path == _STATUS_PATH:
            self.runtime.peering.serve_status(request, resp)
        elif method is None:
            resp.send_error(404, f"unknown path {request.path}", code="not_found")
        elif request.method != method:
            allowed = "GET, HEAD" if method == "GET" else method
            resp.send_error(405, f"method {request.method} not allowed on {request.path}; allowed: {allowed}",
                            headers=[("Allow", allowed)])
        elif route is not None and (kind := route[1]) is not None:
            key = self._authenticate(request, resp)
            if key is not False:
                return self.proxy.begin(request, resp, kind, key)
        elif request.path in ("/health", "/readyz"):
            self._health(resp)
        elif request.path == "/livez":  # the process answers: nothing more is promised
            resp.send(200, b'{"status": "alive"}')
        elif request.path == "/metrics":
            resp.send(200, self.runtime.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")
        elif self._authenticate(request, resp) is not False:
            self._models(resp)
        return None

    def _health(self, resp: Responder) -> None:
        rt = self.runtime
        healthy = sum(1 for u in rt.upstreams.values()
                      if u.endpoint.healthy and u.breaker.state is not CircuitState.OPEN)
        ok = healthy and rt.ready and not rt.draining
        unhealthy_after = rt.config.probe.unhealthy_after  # not yet answered a first probe: not counted healthy
        starting = sum(1 for u in rt.upstreams.values() if u.starting(unhealthy_after))
        body = {"status": "ok" if ok else "unavailable", "replicas": len(rt.upstreams), "healthy": healthy,
                "starting": starting, "queue": len(rt.queue), "policy": rt.policy_name}
        if rt.fleet is not None:  # routing goes on without NATS: said here, not failed
            body["fleet"] = rt.fleet.state
        resp.send(200 if ok else 503, json.dumps(body).encode())

    def _authenticate(self, request: HTTPRequest, resp: Responder) -> KeyState | None | Literal[False]:
        """The request's API key; None when the gateway has no keys; False when refused (answered)."""
        peer = self.runtime.peering.check_forwarded(request, resp)  # a forward: the origin checked the key
        if peer is not None:
            return None if peer else False
        keys = self.runtime.keys
        if not keys.enabled:
            return None
        key = keys.lookup(bearer(request.headers.get("authorization")))
        if key is None:
            resp.send_error(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key", headers=[("WWW-Authenticate", "Bearer")])
            return False
        return key

    def _models(self, resp: Responder) -> None:
        """Every model a healthy replica serves (configured, or read from its /v1/models)."""
        body = {"object": "list", "data": self.runtime.model_cards()}
        resp.send(200, json.dumps(body).encode())

    async def start(self) -> int:
        """Probe the replicas once, then listen; returns the bound port."""
        await self.runtime.start()
        try:
            tls = self.config.tls.context() if self.config.tls is not None else None
            self.port = await self.http.start(self.config.host, self.config.port, tls)
        except OSError:
            await self.runtime.stop()
            raise
        return self.port

    @property
    def active(self) -> int:
        """Requests being served right now (drain waits for this to reach 0)."""
        return self.http.active

    def reload(self) -> list[str]:
        """Apply the config file again. Everything but the listening address applies at once
        (new connections get new HTTP limits); a changed ``host`` or ``port`` is refused, named
        in the log, and needs a restart."""
        if not self.config_path:
            return []
        new = load_config(self.config_path)
        fixed = [f"{f} ({getattr(self.config, f)} → {getattr(new, f)})" for f in RESTART_ONLY
                 if getattr(new, f) != getattr(self.config, f)]
        if fixed:
            log.error("config reload: %s need a restart; kept as they are, the rest applies", ", ".join(fixed))
            new = new.model_copy(update={f: getattr(self.config, f) for f in RESTART_ONLY})
        changes = self.runtime.reconfigure(new)
        changes += self.proxy.reconfigure(new)
        if new.http_limits() != self.http.limits:
            self.http.limits = new.http_limits()
            changes.append("http limits")
        self.config = new
        return changes

    async def drain(self) -> None:
        """Readiness goes false first (``/readyz`` 503) while requests are still served for
        ``drain_delay_s``, so a front load balancer stops sending; then stop accepting, let
        in-flight requests finish (bounded by ``drain_timeout_s``), and stop."""
        self.runtime.ready = False
        if self.config.drain_delay_s:
            await asyncio.sleep(self.config.drain_delay_s)
        self.runtime.draining = True
        await self.http.stop_accepting()
        await self.http.wait_idle(self.config.drain_timeout_s)
        await self.stop()

    async def stop(self) -> None:
        """Close the listener and every connection, then stop the runtime (no draining: see :meth:`drain`)."""
        await self.http.close()
        await self.runtime.stop()


async def serve(config: GatewayConfig, config_path: str | None = None, on_ready=None) -> None:
    """Run until SIGTERM/SIGINT (graceful drain, exit 0); SIGHUP reloads the config file."""
    gw = Gateway(config, config_path)
    await gw.start()
    # what start-up built lives as long as the process: out of the collector's way, so the
    # collections that per-request garbage triggers do not walk it again and again
    gc.collect()
    gc.freeze()

    def reload() -> None:
        try:
            changes = gw.reload()
            log.info("config reloaded: %s", ", ".join(changes) or "no changes")
        except Exception as exc:  # keep serving on the old config
            log.error("config reload rejected: %s", exc)

    if on_ready is not None:
        on_ready(gw)
    await until_stopped(on_hangup=reload)
    log.info("draining: %d request(s) in flight", gw.active)
    await gw.drain()
