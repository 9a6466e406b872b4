"""The endpoint picker: an Envoy ext_proc service (``envoy.service.ext_proc.v3.ExternalProcessor``)
over a running gateway's Runtime, plus gRPC health.

One ``Process`` stream is one HTTP request, in Envoy's FULL_DUPLEX_STREAMED order (fleet-facts §2.2):

1. request headers — kept; nothing is answered yet (unless the request has no body: then it is
   routed at once).
2. request body chunks — gathered until end of stream; then the body is parsed as the gateway
   parses it (``Proxy.parse``: same prompt keys and block hashes), the Router decides, and the
   answers go out in order: the header response naming the endpoint and ordered fallbacks in
   ``x-gateway-destination-endpoint`` and ``envoy.lb`` metadata, then the body in streamed chunks.
   No replica → ImmediateResponse 503; the hold queue full → 429; a bad body → 400.
3. response headers — the status, and the endpoint Envoy actually used
   (``x-gateway-destination-endpoint-served``): a fallback moves the request's accounting there.
4. response body chunks — echoed back; the first is the first token (TTFT to the policy), the
   last completes the request (release, breaker outcome, latency to the policy's listeners).

A stream that ends or is cancelled early releases whatever it held and logs one line. The
fallbacks are the policy's own next choices (a dry-run decision with the earlier picks excluded),
topped up by load: Envoy walks them on retries without asking the picker again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvroute.epp import protocol as P
from kvroute.errors import ClientError
from kvroute.gateway.breaker import CircuitState
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.holdqueue import PolicyError, QueueFull, QueueTimeout
from kvroute.gateway.openai import PROXIED
from kvroute.gateway.replica import Outcome
from kvroute.gateway.retry import RETRY_STATUSES
from kvroute.gateway.server import Gateway
from kvroute.gateway.tokens import reported_completion_tokens
from kvroute.model import DecisionKind, Request

log = logging.getLogger("kvroute.epp")
USAGE_TAIL = 64 * 1024  # bytes of a non-streamed response kept to read its usage


@dataclass
class Exchange:
    """One ext_proc stream's state."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    req: Request | None = None
    route: str = "other"
    target: str | None = None  # the replica the request is accounted to
    t0: float = field(default_factory=time.monotonic)
    status: int | None = None
    first: bool = False
    tail: bytearray = field(default_factory=bytearray)
    finished: bool = False
    phase: str = "request headers"
    subset: list[str] = field(default_factory=list)  # the gateway's subset hint (with the headers)


class Picker(ep_grpc.ExternalProcessorServicer):
    """The ext_proc servicer: routes with the gateway's Runtime and Proxy (one Router for both)."""

    def __init__(self, gateway: Gateway, fallbacks: int = 2):
        self.gw = gateway
        self.rt = gateway.runtime
        self.fallbacks = fallbacks

    # -- addresses ---------------------------------------------------------------------------
    def address(self, name: str) -> str:
        """host:port of a replica, as Envoy's original-destination cluster dials it."""
        return urlsplit(self.rt.upstreams[name].config.url).netloc

    def _by_address(self) -> dict[str, str]:
        return {self.address(n): n for n in self.rt.upstreams}

    def fallback_order(self, req: Request, chosen: str) -> list[str]:
        """The replicas Envoy should try after ``chosen``, best first: what the policy itself would
        pick next with the chosen ones excluded (``Router.decide`` is a dry run: no counter, state or
        random draw moves), then — when the policy would hold or refuse — the other replicas that
        are up and not broken, least loaded first."""
        order: list[str] = []
        decide = getattr(self.rt.router, "decide", None)  # a P/D router picks pairs: load order only
        while decide is not None and len(order) < self.fallbacks:
            d = decide(replace(req, exclude=(*req.exclude, chosen, *order)))
            if d.kind is not DecisionKind.DISPATCH or d.target not in self.rt.upstreams or d.target in order:
                break
            order.append(d.target)
        loads = []
        for name, up in self.rt.upstreams.items():
            ep_ = up.endpoint
            if name == chosen or name in order or name in req.exclude or not ep_.healthy \
                    or up.breaker.state is CircuitState.OPEN:
                continue
            loads.append((ep_.inflight + ep_.waiting, ep_.rtt_s, name))
        order += [name for *_, name in sorted(loads)]
        return order[:self.fallbacks]

    # -- the stream ----------------------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],  # noqa: N802 (gRPC name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        """Handle one HTTP request's ext_proc exchange (see the module docstring)."""
        ex = Exchange()
        try:
            async for msg in request_iterator:
                which = msg.WhichOneof("request")
                if which == "request_headers":
                    ex.headers = P.header_map(msg.request_headers)
                    ex.subset = P.metadata_value(msg, P.SUBSET_NAMESPACE, P.SUBSET)
                    ex.phase = "request body"
                    if msg.request_headers.end_of_stream:  # no body (a GET): route on headers alone
                        for out in await self._pick(ex, msg, with_body=False):
                            yield out
                elif which == "request_body":
                    ex.body += msg.request_body.body
                    if len(ex.body) > self.rt.config.max_body_bytes:
                        yield P.immediate(413, f"request body over {self.rt.config.max_body_bytes} bytes",
                                          "body_too_large")
                        return
                    if msg.request_body.end_of_stream:
                        for out in await self._pick(ex, msg, with_body=True):
                            yield out
                elif which == "request_trailers":
                    yield P.trailers_ack(request=True)
                elif which == "response_headers":
                    yield self._response_headers(ex, msg)
                elif which == "response_body":
                    yield self._response_body(ex, msg.response_body)
                elif which == "response_trailers":
                    self._finish(ex)
                    yield P.trailers_ack(request=False)
            if ex.req is not None and not ex.finished:
                log.warning("ext_proc stream for %s ended early (during the %s); its replica %s is released",
                            ex.req.id, ex.phase, ex.target)
            elif ex.req is None and ex.phase != "done":
                log.warning("ext_proc stream ended early (during the %s): nothing was routed", ex.phase)
        finally:  # ended, cancelled by Envoy, or the client left: undo what this stream holds, once
            self._finish(ex)

    async def _pick(self, ex: Exchange, msg: ep.ProcessingRequest, with_body: bool) -> list[ep.ProcessingResponse]:
        """Route the request; the answers to send, in order."""
        rt, proxy = self.rt, self.gw.proxy
        path = ex.headers.get(":path", "").split("?")[0]
        kind = PROXIED.get(path)
        ex.phase = "routing"
        if kind is not None and with_body:
            try:
                body, req = proxy.parse(bytes(ex.body), kind, ex.headers)
            except ClientError as exc:
                return self._refuse(ex, 400, str(exc), "invalid_request")
            ex.route = kind.label
            model = body.get("model")
        else:  # no prompt to key (a GET, another path): routed by load, as a one-token request
            req = Request(id=proxy.next_id(), arrival_s=time.monotonic(), prompt_tokens=1,
                          max_output_tokens=1)
            model = None
        exclude = rt.excluded_for(model)
        if exclude is None:
            return self._refuse(ex, 404, f"The model '{model}' does not exist", "model_not_found")
        hint = ex.subset or P.metadata_value(msg, P.SUBSET_NAMESPACE, P.SUBSET)
        if hint:  # the gateway allows only these endpoints (endpoint picker protocol: subset hint)
            allowed = {n for a, n in self._by_address().items() if a in set(hint)}
            exclude = (*exclude, *(n for n in rt.upstreams if n not in allowed))
            if not allowed:
                return self._refuse(ex, 503, f"no known endpoint in the subset hint {','.join(hint)}",
                                    "no_endpoint")
        req.exclude = tuple(exclude)
        if rt.draining:
            return self._refuse(ex, 503, "endpoint picker is draining", "draining")
        try:
            d = await rt.admit(req)
        except QueueFull as exc:
            rt.metrics.rejected.labels("full").inc()
            return self._refuse(ex, 429, str(exc), "queue_full")
        except QueueTimeout as exc:
            rt.metrics.rejected.labels("timeout").inc()
            return self._refuse(ex, 503, str(exc), "queue_timeout")
        except PolicyError as exc:
            return self._refuse(ex, 503, f"{exc}; see the log", "policy_error")
        target = d.target
        if d.kind is not DecisionKind.DISPATCH or target is None or target not in rt.upstreams:
            if d.kind is DecisionKind.DISPATCH:  # a peer gateway: not an endpoint of this pool
                rt.release(req.id, served=False)
                rt.attempt_done(target or "", Outcome.NEUTRAL)
            return self._refuse(ex, 503, f"no replica can serve this request: {d.reason or d.branch}",
                                "no_endpoint")
        ex.req, ex.target = req, target
        rt.dispatched(req, d)
        endpoints = [self.address(n) for n in (target, *self.fallback_order(req, target))]
        ex.phase = "response headers"
        log.debug("picked %s for %s (%s), fallbacks %s", target, req.id, d.branch, endpoints[1:])
        extra = [] if "x-request-id" in ex.headers else [("x-request-id", req.id)]  # for the engine's logs
        head = P.destination_response(endpoints, len(ex.body) if with_body else None, extra)
        return [head, *(P.body_responses(bytes(ex.body)) if with_body else [])]

    def _refuse(self, ex: Exchange, status: int, message: str, code: str) -> list[ep.ProcessingResponse]:
        log.info("ext_proc request refused with %d: %s", status, message)
        ex.phase, ex.finished = "done", True
        self.rt.metrics.count_request(ex.route, status, self.rt.policy_name)
        retry = [("retry-after", "1")] if status in (429, 503) else []
        return [P.immediate(status, message, code, retry)]

    def _response_headers(self, ex: Exchange, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        rt = self.rt
        ex.phase = "response body"
        try:
            ex.status = int(P.header_map(msg.response_headers).get(":status", "0"))
        except ValueError:
            ex.status = 0
        served = P.metadata_value(msg, P.LB_NAMESPACE, P.SERVED)
        name = self._by_address().get(served[0]) if served else None
        if ex.req is not None and ex.target is not None and name is not None and name != ex.target:
            # Envoy retried on a fallback: the chosen replica failed it; account the request there
            log.info("request %s served by fallback %s instead of %s", ex.req.id, name, ex.target)
            rt.attempt_done(ex.target, Outcome.FAILED)
            rt.router.commit(ex.req, name)
            ex.target = name
        extra = [("x-kvroute-replica", ex.target)] if ex.target and rt.config.replica_header else []
        if msg.response_headers.end_of_stream:
            self._finish(ex)
        return P.response_headers_ack(extra)

    def _response_body(self, ex: Exchange, body: ep.HttpBody) -> ep.ProcessingResponse:
        if ex.req is not None and not ex.first and body.body:
            ex.first = True
            ttft = time.monotonic() - ex.t0
            self.rt.first_token(ex.req.id, ttft)
            self.rt.metrics.ttft.observe(ttft)
        if len(ex.tail) < USAGE_TAIL:
            ex.tail += body.body[:USAGE_TAIL - len(ex.tail)]
        if body.end_of_stream:
            self._finish(ex)
        return P.response_chunk(body.body, body.end_of_stream)

    def _finish(self, ex: Exchange) -> None:
        """Release the request's accounting once: served or not, the breaker's outcome, latency."""
        if ex.finished:
            return
        ex.finished = True
        rt = self.rt
        if ex.req is None or ex.target is None:
            return
        status = ex.status
        complete = status is not None and ex.phase == "response body" and (ex.first or status != 200)
        if status is None or not complete:
            outcome = Outcome.NEUTRAL  # the exchange ended before the response did
        elif status in RETRY_STATUSES and status >= 500:
            outcome = Outcome.FAILED
        else:
            outcome = Outcome.OK if status < 500 else Outcome.NEUTRAL
        served = status is not None and 0 < status < 400
        e2e = time.monotonic() - ex.t0
        tokens = reported_completion_tokens(bytes(ex.tail)) if served and ex.tail[:1] == b"{" else None
        rt.release(ex.req.id, served, e2e if outcome is Outcome.OK else None, tokens or 0)
        rt.attempt_done(ex.target, outcome)
        rt.metrics.count_request(ex.route, status or 499, rt.policy_name)
        if outcome is Outcome.OK:
            rt.metrics.e2e.observe(e2e)
        ex.phase = "done"


class Health:
    """gRPC health (grpc.health.v1): ``liveness`` while the process runs; ``readiness`` and the
    ext_proc service name while a replica can take requests, discovery has synced and the
    picker is not draining."""

    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.servicer = health.aio.HealthServicer()
        self._task: asyncio.Task | None = None

    def ready(self) -> bool:
        """Whether the picker can route now."""
        rt = self.gw.runtime
        if not rt.ready or rt.draining or (rt.discovery is not None and not rt.discovery.synced):
            return False
        return any(u.endpoint.healthy and u.breaker.state is not CircuitState.OPEN for u in rt.upstreams.values())

    async def update(self) -> None:
        """Publish the current state to every health service."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        await self.servicer.set("liveness", serving)
        state = serving if self.ready() else not_serving
        for name in ("", "readiness", P.EXT_PROC_SERVICE):
            await self.servicer.set(name, state)

    async def run(self, interval_s: float) -> None:
        """Keep the statuses current until cancelled."""
        while True:
            await self.update()
            await asyncio.sleep(interval_s)

    def start(self, interval_s: float) -> None:
        """Run :meth:`run` in the background."""
        self._task = asyncio.create_task(self.run(interval_s))

    async def stop(self) -> None:
        """Stop updating; every service answers NOT_SERVING from now on."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.servicer.enter_graceful_shutdown()


class EndpointPicker:
    """A running picker: the gateway (its HTTP port serves /metrics, /livez, /readyz, the admin API),
    the ext_proc gRPC server and gRPC health (on the ext_proc port, and on ``health_port`` if set)."""

    def __init__(self, config: GatewayConfig, config_path: str | None = None, grpc_host: str | None = None,
                 grpc_port: int = 9002, health_port: int | None = 9003, fallbacks: int = 2):
        self.gateway = Gateway(config, config_path)
        self.picker = Picker(self.gateway, fallbacks)
        self.health = Health(self.gateway)
        self.grpc_host = grpc_host or config.host
        self.grpc_port, self.health_port = grpc_port, health_port
        self._servers: list[grpc.aio.Server] = []

    async def start(self) -> tuple[int, int | None]:
        """Start the gateway (probes, discovery) and the gRPC servers; returns the bound (ext_proc, health) ports."""
        await self.gateway.start()
        try:
            main = grpc.aio.server()
            ep_grpc.add_ExternalProcessorServicer_to_server(self.picker, main)
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, main)
            self.grpc_port = self._bind(main, self.grpc_port)
            self._servers.append(main)
            if self.health_port is not None:
                side = grpc.aio.server()
                health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, side)
                self.health_port = self._bind(side, self.health_port)
                self._servers.append(side)
            await self.health.update()
            for s in self._servers:
                await s.start()
        except Exception:
            await self.gateway.stop()
            raise
        self.health.start(min(self.gateway.config.probe.interval_s * 5, 1.0))
        return self.grpc_port, self.health_port

    def _bind(self, server: grpc.aio.Server, port: int) -> int:
        host = f"[{self.grpc_host}]" if ":" in self.grpc_host else self.grpc_host
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {self.grpc_host}:{port}")
        return bound

    async def drain(self) -> None:
        """Not ready first (health NOT_SERVING), let streams in flight finish (``drain_timeout_s``), stop."""
        self.gateway.runtime.ready = False
        await self.health.update()
        if self.gateway.config.drain_delay_s:
            await asyncio.sleep(self.gateway.config.drain_delay_s)
        await self.stop(grace=self.gateway.config.drain_timeout_s)

    async def stop(self, grace: float | None = None) -> None:
        """Stop the gRPC servers (streams in flight get ``grace`` seconds), then the gateway."""
        await self.health.stop()
        await asyncio.gather(*(s.stop(grace) for s in self._servers))
        await self.gateway.stop()


async def serve_epp(config: GatewayConfig, config_path: str | None, grpc_port: int, health_port: int | None,
                    fallbacks: int, on_ready=None) -> None:
    """Run the picker until SIGTERM/SIGINT (graceful drain); SIGHUP reloads the config file."""
    from kvroute.shutdown import until_stopped

    epp = EndpointPicker(config, config_path, grpc_port=grpc_port, health_port=health_port, fallbacks=fallbacks)
    await epp.start()

    def reload() -> None:
        try:
            log.info("config reloaded: %s", ", ".join(epp.gateway.reload()) or "no changes")
        except Exception as exc:  # keep serving on the old config
            log.error("config reload rejected: %s", exc)

    if on_ready is not None:
        on_ready(epp)
    await until_stopped(on_hangup=reload)
    await epp.drain()
