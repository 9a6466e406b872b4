"""The proxy's entry per request, and its callback path for non-streamed answers (issue 25).

``Front.begin`` is what ``Gateway.dispatch`` calls for a proxied path. It parses and checks the
request, as the connection's read callback delivers it, and then:

* answers at once what needs no upstream (a bad body, a rate limit, an unknown model, ...);
* for a non-streamed request whose decision is made at once and whose replica has a kept-alive
  connection idle, sends it upstream right there and returns a :class:`QuickExchange`: the
  answer is sent from the upstream connection's read callback once it is all in
  (``UpstreamPool.quick``). No task wakes, no future is made and no coroutine runs for it —
  the per-request machinery that was left of the gateway's CPU (docs/hot-path.md, twelfth round);
* hands everything else (streams, the LB queue, a prefill/decode pair, a peer gateway, a new
  connection, and any retry) to the proxy's coroutines (``gateway/proxy.py``), awaited by the
  connection's worker task, with what it already did.

Every guarantee is the coroutines': an attempt that failed or answered a retryable status is
retried by them (``pre``), a kept-alive connection found dead is sent again, a client that goes
away is a 499 and closes the upstream connection, and each request is accounted for once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

from kvroute.errors import ClientError
from kvroute.gateway.auth import KeyState
from kvroute.gateway.continuation import Splice
from kvroute.gateway.holdqueue import PolicyError, QueueFull, QueueTimeout
from kvroute.gateway.hops import forwarded
from kvroute.gateway.http import Request as HTTPRequest
from kvroute.gateway.http import Responder
from kvroute.gateway.httpmsg import Pending
from kvroute.gateway.openai import Kind
from kvroute.gateway.proxy import HELD, Proxy
from kvroute.gateway.replica import Outcome, Upstream
from kvroute.gateway.residency import ResidencyConflict
from kvroute.gateway.retry import RETRY_STATUSES, Failure, RetryReason, failure_of
from kvroute.gateway.tokens import reported_completion_tokens
from kvroute.gateway.upstream import UpstreamError, UpstreamResponse, _Conn, _StaleConnection
from kvroute.model import DecisionKind, Request

log = logging.getLogger("kvroute.gateway")
_OK: Final = Outcome.OK
_FAILED: Final = Outcome.FAILED
_NEUTRAL: Final = Outcome.NEUTRAL
monotonic: Final = time.monotonic
Later = Coroutine[Any, Any, None]


class Front(Proxy):
    """The proxy (``gateway/proxy.py``) with its entry per request, :meth:`begin`."""

    def begin(self, request: HTTPRequest, resp: Responder, kind: Kind,
              key: KeyState | None = None) -> Later | Pending | None:
        """Answer one proxied request: at once (None), by callbacks (a Pending), or by the returned
        coroutine; counted and logged once, whatever happens."""
        rt = self.rt
        route = kind.label
        t0 = monotonic()
        served: dict[str, Any] = {"excluded": []}  # where it went, for the access line
        span = self.tracer.start(route)
        # parsed before the try whose finally reads req: a compiled build types req by the try body's end
        try:
            body, req = self.parse(request.body, kind, request.headers)
        except ClientError as exc:
            resp.send_error(exc.status, str(exc), param=exc.param)
            self._done(route, resp, {}, None, served, t0, request, span)
            return None
        except BaseException:  # counted as before, then the server answers 500
            self._done(route, resp, {}, None, served, t0, request, span)
            raise
        later: Later | Pending | None = None
        try:
            if rt.draining:
                resp.send_error(503, "gateway is draining", "server_error", headers=[("Retry-After", "1")])
                return None
            if key is not None:
                wait = key.admit(req.prompt_tokens + req.max_output_tokens, monotonic())
                if wait:
                    resp.send_error(429, f"rate limit of key {key.name!r} reached; retry in {wait} s",
                                    "rate_limit_error", code="rate_limit_exceeded",
                                    headers=[("Retry-After", str(wait))])
                    return None
            model = body.get("model")
            exclude = rt.excluded_for(model)
            if exclude is None:
                known = ", ".join(sorted(str(c.get("id")) for c in rt.model_cards())) or "none"
                resp.send_error(404, f"The model '{model}' does not exist; available: {known}",
                                param="model", code="model_not_found")
                return None
            if exclude:  # drained replicas, and those not serving the model: the policy never sees them
                req.exclude = exclude
            if rt.hot.access_log:  # the client's own id when it sent one (forwarded upstream as is)
                rid = request.headers.get("x-request-id") or req.id
                resp.id_line = b"x-request-id: " + rid.encode("latin-1") + b"\r\n"
            try:
                rt.peering.accept(req, request.headers, key)  # hops, residency pin (gateway/peers.py)
            except ResidencyConflict as conflict:
                resp.send_error(403, str(conflict), "permission_error", code="residency_conflict")
                return None
            headers = forwarded(request.headers)
            if rt.keys.enabled and not rt.hot.forward_authorization:
                headers = [(k, v) for k, v in headers if k != "authorization"]  # the client's key is ours
            stream = bool(body.get("stream"))
            splice = Splice.open(kind.label, body, req.prompt_tokens) if rt.hot.continuable else None
            if stream or splice is not None:
                later = self._rest(request, resp, kind, body, req, headers, served, t0, span, stream, splice)
            else:
                later = self._quick(request, resp, kind, body, req, headers, served, t0, span)
            return later
        finally:
            if later is None:  # answered here (or raised): accounted for here
                self._done(route, resp, body, req, served, t0, request, span)

    def _quick(self, request: HTTPRequest, resp: Responder, kind: Kind, body: dict, req: Request,
               headers: list[tuple[str, str]], served: dict[str, Any], t0: float, span: Any) -> Later | Pending | None:
        """A non-streamed request's first attempt: sent at once on a kept-alive connection when it can
        be (a QuickExchange), else the coroutines take it from where this got to."""
        rt = self.rt
        hot = rt.hot
        deadline = monotonic() + hot.non_stream_total_s  # all attempts
        try:
            decision = rt.route_now(req)
        except (QueueFull, QueueTimeout, PolicyError) as exc:
            self._held_back(resp, exc)
            return None
        if decision is None:  # the policy holds it, or others wait before it: the LB queue
            return self._rest(request, resp, kind, body, req, headers, served, t0, span, False, None, HELD, deadline)
        if decision.kind is DecisionKind.NONE:
            resp.send_error(503, f"no replica can serve this request: {decision.reason}", "server_error",
                            code=decision.branch)
            return None
        target = decision.target
        up = rt.upstreams.get(target) if target is not None else None
        if up is None or target is None or decision.prefill is not None or target in rt.peering.links:
            return self._rest(request, resp, kind, body, req, headers, served, t0, span, False, None, decision,
                              deadline)
        if not up.pool.has_idle():  # no kept-alive connection idle: the coroutine connects
            return self._rest(request, resp, kind, body, req, headers, served, t0, span, False, None, decision,
                              deadline)
        served["replica"], served["branch"] = target, decision.branch
        rt.dispatched(req, decision)
        if rt.upstreams.get(target) is not up:  # a reload the dispatch set off removed it (as _forward checks)
            rt.release(req.id, served=False)
            removed = Failure(RetryReason.REPLICA_REMOVED, f"replica {target} was removed", 503, "replica_removed")
            return self._rest(request, resp, kind, body, req, headers, served, t0, span, False, None, removed,
                              deadline)
        ex = QuickExchange(self, request, resp, kind, body, req, headers, served, t0, span, target, up, deadline)
        now = monotonic()
        first_byte_s = max(min(deadline, now + hot.non_stream_s) - now, 0.001)
        conn = up.pool.quick(request.path, request.body, headers, ex.finish, first_byte_s=first_byte_s,
                             idle_s=hot.idle_s)
        if conn is None:  # the idle connection went in the dispatch: undone, the coroutines redo it
            rt.release(req.id, served=False)
            return self._rest(request, resp, kind, body, req, headers, served, t0, span, False, None, decision,
                              deadline)
        ex.conn = conn
        ex.abort = abort = conn.abort  # aborted if its probes find nothing listening (Runtime._read_probe)
        up.exchanges.add(abort)
        return ex

    async def _rest(self, request: HTTPRequest, resp: Responder, kind: Kind, body: dict, req: Request,
                    headers: list[tuple[str, str]], served: dict[str, Any], t0: float, span: Any, stream: bool,
                    splice: Splice | None, pre: object = None, deadline: float = 0.0) -> None:
        """The rest of a request, by the coroutines: route, forward and retry; continue a broken stream."""
        try:
            brk = await self._route_and_forward(request, resp, kind, stream, req, headers, served, t0, splice,
                                                pre, deadline)
            if brk is not None and splice is not None:
                await self._continue(request, resp, kind, headers, req, served, splice, brk)
        finally:
            self._done(kind.label, resp, body, req, served, t0, request, span)

    async def _resend(self, ex: QuickExchange) -> None:
        """A quick exchange's kept-alive connection had died before answering: the same attempt
        on another connection (the pool's business, not the replica's failure), then retries."""
        try:
            result = await self._forward(ex.request, ex.resp, ex.kind, ex.headers, ex.req, ex.target, False, ex.t0,
                                         ex.deadline)
            if isinstance(result, Failure):
                await self._route_and_forward(ex.request, ex.resp, ex.kind, False, ex.req, ex.headers, ex.served,
                                              ex.t0, None, result, ex.deadline)
        finally:
            self._done(ex.kind.label, ex.resp, ex.body, ex.req, ex.served, ex.t0, ex.request, ex.span)


async def _raise(exc: Exception) -> None:
    """An error raised in a callback, raised again in the connection's worker (answered 500 there)."""
    raise exc


class QuickExchange(Pending):
    """One non-streamed request sent on a kept-alive connection and answered from its read
    callback (:meth:`finish`), with the same accounting as ``Proxy._forward``."""

    def __init__(self, proxy: Front, request: HTTPRequest, resp: Responder, kind: Kind, body: dict, req: Request,
                 headers: list[tuple[str, str]], served: dict[str, Any], t0: float, span: Any, target: str,
                 up: Upstream, deadline: float):
        super().__init__()
        self.proxy, self.request, self.resp, self.kind, self.body, self.req = proxy, request, resp, kind, body, req
        self.headers, self.served, self.t0, self.span, self.target = headers, served, t0, span, target
        self.up, self.deadline = up, deadline
        self.conn: _Conn | None = None
        self.abort: Callable[[UpstreamError], None] | None = None

    def finish(self, err: UpstreamError | None) -> None:
        """The upstream's answer is all in (``err`` None), or the attempt failed: the client is
        answered here, or the connection gets the coroutine that goes on."""
        try:
            work = self._answer(err)
        except Exception as exc:
            work = _raise(exc)
        resume = self.resume
        if resume is not None:
            resume(work)
        elif work is not None:
            work.close()

    def _answer(self, err: UpstreamError | None) -> Later | None:
        proxy, req, target = self.proxy, self.req, self.target
        rt = proxy.rt
        if self.abort is not None:
            self.up.exchanges.discard(self.abort)
            self.abort = None
        if err is not None:
            if isinstance(err, _StaleConnection):
                self.up.pool.stale_retries += 1
                return proxy._resend(self)
            log.warning("upstream %s failed before responding: %s", target, err)
            rt.release(req.id, False, None, 0)
            rt.attempt_done(target, _FAILED)
            return proxy._rest(self.request, self.resp, self.kind, self.body, req, self.headers, self.served,
                               self.t0, self.span, False, None, failure_of(err, target), self.deadline)
        conn = self.conn
        assert conn is not None
        upstream = UpstreamResponse(conn, conn.status, conn._headers, rt.hot.idle_s)
        status = upstream.status
        payload = upstream.take() or b""  # all of it is in
        if status in RETRY_STATUSES:
            upstream.release()
            rt.release(req.id, False, None, 0)
            rt.attempt_done(target, _FAILED if status >= 500 else _NEUTRAL)
            failure = Failure(RetryReason.STATUS, f"upstream {target} answered {status}",
                              429 if status == 429 else 502,
                              "upstream_overloaded" if status == 429 else "upstream_error")
            return proxy._rest(self.request, self.resp, self.kind, self.body, req, self.headers, self.served,
                               self.t0, self.span, False, None, failure, self.deadline)
        t0 = self.t0
        outcome = _OK if status < 500 else _NEUTRAL
        output_tokens = 0
        try:
            ttft = monotonic() - t0
            rt.first_token(req.id, ttft)
            rt.metrics.ttft.observe(ttft)
            if status == 200:
                proxy._count_tokens(target, req.id, payload)
                output_tokens = reported_completion_tokens(payload) or 0
            self.resp.send(status, payload, content_type=None, fields=proxy._resp_fields(upstream, target, req))
        finally:
            rt.release(req.id, status < 400, monotonic() - t0 if outcome is _OK else None, output_tokens)
            rt.attempt_done(target, outcome)
            upstream.release()  # kept alive: read to its end
            proxy._done(self.kind.label, self.resp, self.body, req, self.served, t0, self.request, self.span)
        return None

    def cancel(self) -> None:
        """The client went away first: the upstream connection is closed (the engine stops), and
        the attempt and the request are accounted for as a cancelled coroutine would be (a 499)."""
        if self.abort is not None:
            self.up.exchanges.discard(self.abort)
            self.abort = None
        conn = self.conn
        if conn is not None:
            conn.drop()
        rt = self.proxy.rt
        rt.release(self.req.id, False, None, 0)
        rt.attempt_done(self.target, _NEUTRAL)
        self.proxy._done(self.kind.label, self.resp, self.body, self.req, self.served, self.t0, self.request,
                         self.span)
