"""Proxying: a parsed request routed, forwarded to its replica and answered, with retries.

A request parsed and keyed once (``gateway/openai.py``) is admitted by the runtime (route now or
wait in the LB queue), then proxied. Streams pass through chunk by chunk as the upstream produces
them, but the response head is held until the first body byte, so a replica that fails before
producing anything is retried like one that never answered (``gateway/retry.py``: which
failures, what backoff). For streams the first-byte timeout applies per attempt and, as
``first_byte_total_s``, to all attempts of a request together; a non-streamed response arrives
only when generation ends, so it has its own limits (``non_stream_s``, ``non_stream_total_s``: by
default a timed-out one is not generated again elsewhere). When no attempt succeeds the client
gets the last failure as 502 (504 for timeouts, 429 passed on); once bytes are out, a streamed
chat or completion is continued on another replica (``gateway/continuation.py``: after an
upstream failure, or when it outgrows the replica's ``context_limit``), and a stream that cannot
be continued ends with an SSE error event and ``[DONE]``. Every exit path undoes the router's
accounting exactly once and counts the request once. The entry per request, and the callback
path that answers a non-streamed request without these coroutines, is ``gateway/front.py``; the
application (routes, health, reload) is ``gateway/server.py``.
"""

from __future__ import annotations  # the closures made per request evaluate no annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

from kvroute.gateway.continuation import Break, Splice, error_event
from kvroute.gateway.holdqueue import PolicyError, QueueFull, QueueTimeout
from kvroute.gateway.hops import response_fields
from kvroute.gateway.http import Request as HTTPRequest
from kvroute.gateway.http import Responder
from kvroute.gateway.legs import LegResponder
from kvroute.gateway.openai import Kind, RequestParsing, prompt_key
from kvroute.gateway.outlier import Attempt
from kvroute.gateway.pd import forward_split
from kvroute.gateway.replica import Outcome
from kvroute.gateway.retry import RETRY_STATUSES, Failure, RetryReason, backoff_s, failure_of
from kvroute.gateway.runtime import Runtime
from kvroute.gateway.tokens import reported_completion_tokens, reported_prompt_tokens, token_events
from kvroute.gateway.tracing import Tracer, access, access_line
from kvroute.gateway.upstream import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
)
from kvroute.model import Decision, DecisionKind, Request

log = logging.getLogger("kvroute.gateway")
# Final: a compiled build reads these from C statics, where a module global or a module's attribute is
# a dict lookup per use (issue 25, fifth round: ~80 of them per request; docs/hot-path.md)
_OK: Final = Outcome.OK
_FAILED: Final = Outcome.FAILED
_NEUTRAL: Final = Outcome.NEUTRAL
monotonic: Final = time.monotonic
HELD: Final = object()  # the callback path's first decision: wait in the LB queue
STREAM_TAIL: Final = 4096  # bytes of a stream kept to find its [DONE] and its final usage chunk


class Proxy(RequestParsing):
    """Per-request parsing (:class:`~kvroute.gateway.openai.RequestParsing`), routing and
    forwarding; one instance per application."""

    def __init__(self, runtime: Runtime):
        super().__init__()
        self.rt = runtime
        self.tokens = runtime.tokens
        self.rng = random.Random()
        self.tracer = Tracer(runtime.config.tracing.enabled)
        self._replica_lines: dict[str, bytes] = {}  # replica id → its x-kvroute-replica header line
        self.reconfigure(runtime.config)

    def _done(self, route: str, resp: Responder, body: dict, req: Request | None, served: dict[str, Any], t0: float,
              request: HTTPRequest, span: Any) -> None:
        """A request's accounting, whatever happened to it: counted, logged, its trace span ended
        (``req`` is None for a body that could not be parsed)."""
        rt = self.rt
        if req is not None:
            self.estimates.pop(req.id, None)
        rt.metrics.count_request(route, resp.status or 499, rt.policy_name)  # 499: the client left
        if served.get("replica") is not None and resp.started:  # proxied, even if the client left
            rt.metrics.e2e.observe(monotonic() - t0)
        if rt.hot.access_log and req is not None and access.isEnabledFor(logging.INFO):
            access_line(resp, route, body, req, served, t0, request.headers.get("x-request-id"), rt.hot.log_prompts)
        if span is not None:
            self.tracer.end(span, {
                "request_id": req.id if req else None, "model": body.get("model"), "policy": rt.policy_name,
                "branch": served.get("branch"), "replica": served.get("replica"),
                "failed_on": ",".join(served["excluded"]) or None, "status": resp.status or 499,
                "aborted": resp.started and not resp.finished, "stream": bool(body.get("stream"))})

    def _held_back(self, resp: Responder | LegResponder, exc: Exception) -> None:
        """Answer a request that the LB queue (full, timed out) or a failed policy refused."""
        if isinstance(exc, QueueFull):
            self.rt.metrics.rejected.labels("full").inc()
            resp.send_error(429, str(exc), "rate_limit_error", code="queue_full", headers=[("Retry-After", "1")])
        elif isinstance(exc, QueueTimeout):
            self.rt.metrics.rejected.labels("timeout").inc()
            resp.send_error(503, str(exc), "server_error", code="queue_timeout", headers=[("Retry-After", "2")])
        else:
            resp.send_error(503, f"{exc}; see the gateway log", "server_error", code="policy_error")

    async def _route_and_forward(self, request: HTTPRequest, resp: Responder | LegResponder, kind: Kind,
                                 stream: bool, req: Request, headers: list[tuple[str, str]], served: dict[str, Any],
                                 t0: float, splice: Splice | None = None, pre: object = None,
                                 deadline: float = 0.0) -> Break | None:
        """Route and proxy with retries; a stream that broke or outgrew its replica after bytes
        were out comes back as a Break, for the caller to continue. ``pre``: what the callback
        path (``gateway/front.py``) already did of the first attempt — its decision, HELD (it
        must wait in the LB queue), or its failure — and ``deadline`` the one it set."""
        rt = self.rt
        hot = rt.hot
        excluded = served["excluded"]  # replicas that failed this request
        unfit = req.exclude  # replicas that do not serve its model
        if not deadline:  # all attempts
            deadline = monotonic() + (hot.first_byte_total_s if stream else hot.non_stream_total_s)
        failure: Failure | None = None
        for attempt in range(1, hot.max_attempts + 1):
            if attempt == 1 and isinstance(pre, Failure):
                failure = pre
                target: str = served["replica"]
            else:
                decision = pre if attempt == 1 and isinstance(pre, Decision) else None
                try:
                    if decision is None and not (attempt == 1 and pre is HELD):
                        decision = rt.route_now(req)
                    if decision is None:  # the policy holds it, or others wait before it: the LB queue
                        decision = await rt.hold.wait(req)
                except (QueueFull, QueueTimeout, PolicyError) as exc:
                    self._held_back(resp, exc)
                    return None
                if decision.kind is DecisionKind.NONE:
                    if failure is not None:
                        break  # every replica that could take it has failed: the last failure answers
                    resp.send_error(503, f"no replica can serve this request: {decision.reason}", "server_error",
                                    code=decision.branch)
                    return None
                chosen = decision.target
                assert chosen is not None  # a dispatch names its target
                target = chosen
                served["replica"], served["branch"] = target, decision.branch
                rt.dispatched(req, decision)
                sent = rt.peering.outbound(headers, req, request.headers) if target in rt.peering.links else headers
                if decision.prefill is not None:  # a prefill/decode pair (gateway/pd.py)
                    result = await forward_split(self, request, resp, kind, sent, req, decision, stream, t0,
                                                 deadline, splice)
                else:
                    result = await self._forward(request, resp, kind, sent, req, target, stream, t0, deadline,
                                                 splice)
                if not isinstance(result, Failure):
                    return result  # the client has its answer, or the stream is to go on elsewhere
                failure = result
            excluded.append(failure.replica or target)
            req.exclude = (*unfit, *excluded)
            left = deadline - monotonic()
            if attempt == hot.max_attempts or left <= 0:
                break
            rt.metrics.retries.labels(failure.reason).inc()
            delay = backoff_s(attempt, hot.backoff_s, hot.backoff_max_s, self.rng.random())
            await asyncio.sleep(min(delay, left))
        assert failure is not None
        retry_after = [("Retry-After", "1")] if failure.status in (429, 503) else []
        resp.send_error(failure.status, failure.message, "server_error", code=failure.code, headers=retry_after)
        return None

    def _count_tokens(self, target: str, rid: str, body: bytes) -> None:
        """Teach the token ratio the engine's own prompt count (``usage.prompt_tokens``); a peer
        gateway's answer is not one replica's count, so a forward teaches nothing."""
        estimated = self.estimates.get(rid)
        if estimated and target not in self.rt.peering.links:
            reported = reported_prompt_tokens(body)
            if reported is not None:
                self.rt.tokens.observe(target, estimated, reported)

    def _resp_fields(self, upstream: UpstreamResponse, target: str, req: Request) -> bytes:
        """The upstream's end-to-end response headers as they came (bytes, not decoded), and the
        replica headers, formatted for the client's response head."""
        hot = self.rt.hot
        out = response_fields(upstream.headers, hot.access_log)
        if hot.replica_header and target in self.rt.upstreams:  # a peer's answer names its own
            line = self._replica_lines.get(target)
            if line is None:  # the replica's header line, made once per replica (discovery may bring new
                line = b"x-kvroute-replica: " + target.encode("latin-1") + b"\r\n"  # ones: bounded)
                if len(self._replica_lines) < 1024:
                    self._replica_lines[target] = line
            out.append(line)
            ticket = self.rt.router.tickets.get(req.id)
            if ticket is not None:  # the prompt tokens the index predicted cached there (engines report theirs)
                hit = min(req.prompt_tokens, ticket.matched_blocks * req.block_tokens)
                out += (b"x-kvroute-prefix-hit: ", str(hit).encode(), b"\r\n")
        return b"".join(out)

    async def _forward(self, request: HTTPRequest, resp: Responder | LegResponder, kind: Kind,
                       headers: list[tuple[str, str]], req: Request, target: str, stream: bool, t0: float,
                       deadline: float, splice: Splice | None = None) -> Failure | Break | None:
        """Proxy one attempt. Returns None once the client has a response, the failure if
        nothing was sent, or a Break when a stream is to go on elsewhere."""
        rt = self.rt
        up = rt.upstreams.get(target) or rt.peering.links.get(target)
        if up is None:  # removed by a reload between decision and now
            rt.release(req.id, served=False)
            return Failure(RetryReason.REPLICA_REMOVED, f"replica {target} was removed", 503, "replica_removed")
        hot = rt.hot
        upstream = None
        outcome = _NEUTRAL
        served = False  # the engine took the request (so it holds the prompt's prefix now)
        output_tokens = 0  # what this attempt generated (the policy's on_finished hears it)
        # a stream's progress is watched: an engine whose streams all go silent is ejected (gateway/outlier.py)
        watch = rt.stalls.detector.begin(target, req.prompt_tokens, monotonic()) \
            if stream and hot.stall_watch and target in rt.upstreams else None
        replica = rt.upstreams.get(target)  # None for a peer gateway
        abort: Callable[[UpstreamError], None] | None = None

        def on_send(fn: Callable[[UpstreamError], None]) -> None:
            nonlocal abort
            abort = fn
            if watch is not None:
                watch.attach(fn)
            if replica is not None:  # aborted if its probes find nothing listening (Runtime._read_probe)
                replica.exchanges.add(fn)
        try:
            try:
                now = monotonic()
                attempt_deadline = min(deadline, now + (hot.first_byte_s if stream else hot.non_stream_s))
                sent = request.body
                if splice is not None:  # vLLM's running usage counts a continuable stream's tokens exactly
                    splice.usage_added = False
                    if target in rt.upstreams and rt.upstreams[target].engine == "vllm":
                        sent = splice.exact_body(sent)
                upstream = await up.pool.post(request.path, sent, headers, connect_s=hot.connect_s,
                                              first_byte_s=max(attempt_deadline - now, 0.001),
                                              idle_s=hot.idle_s, on_send=on_send)
                status = upstream.status
                budget = max(attempt_deadline - monotonic(), 0.001)  # the first body byte counts too
                if status in RETRY_STATUSES:
                    await upstream.read(budget)  # read to the end so the connection can be reused
                    if status >= 500:
                        outcome = _FAILED
                    return Failure(RetryReason.STATUS, f"upstream {target} answered {status}",
                                   429 if status == 429 else 502, "upstream_overloaded" if status == 429
                                   else "upstream_error")
                first: bytes | None = None
                payload = b""
                if stream and status == 200:
                    first = await upstream.next_chunk(budget)  # hold the head until a byte of body
                    if first is None:
                        raise UpstreamProtocolError("upstream ended the stream before sending anything")
                else:  # a small answer arrives with its head: taken without a coroutine
                    taken = upstream.take()
                    payload = taken if taken is not None else await upstream.read(budget)
                served = status < 400  # a body, or a stream's first bytes, came back
            except UpstreamError as exc:  # nothing has reached the client yet: retryable
                outcome = _FAILED
                log.warning("upstream %s failed before responding: %s", target, exc)
                return failure_of(exc, target)
            if first is not None:
                outcome, brk, output_tokens = await self._stream(resp, upstream, first, req, target, t0,
                                                                 kind.stream_end, splice, watch)
                return brk
            ttft = monotonic() - t0
            rt.first_token(req.id, ttft)
            rt.metrics.ttft.observe(ttft)
            outcome = _OK if upstream.status < 500 else _NEUTRAL
            if upstream.status == 200:
                self._count_tokens(target, req.id, payload)
                output_tokens = reported_completion_tokens(payload) or 0
            resp.send(upstream.status, payload, content_type=None, fields=self._resp_fields(upstream, target, req))
            return None
        finally:
            if watch is not None:
                watch.watch.end(watch)
            if replica is not None and abort is not None:
                replica.exchanges.discard(abort)
            rt.release(req.id, served, monotonic() - t0 if outcome is _OK else None, output_tokens)
            rt.attempt_done(target, outcome)
            if upstream is not None:
                upstream.release()  # kept alive when fully read; closed (cancelling upstream) otherwise

    async def _stream(self, resp: Responder | LegResponder, upstream: UpstreamResponse, first: bytes, req: Request,
                      target: str, t0: float, end_marker: bytes | None,
                      splice: Splice | None = None, watch: Attempt | None = None) -> tuple[Outcome, Break | None, int]:
        """Pass an SSE stream through. With a splice (a continuable request): whole events only,
        and a failure after bytes are out, or a sequence outgrowing the replica's context limit,
        returns a Break for the caller to continue elsewhere; without, a failure ends the stream
        with an error event. Also returns the tokens this leg generated: the engine's
        ``usage.completion_tokens`` when it reports it, else the token events forwarded. A chunk
        that brings tokens is progress for the stall ``watch``."""
        rt = self.rt
        ttft = monotonic() - t0
        rt.first_token(req.id, ttft)
        if not resp.started:  # a continuation leg writes on into the client's stream
            rt.metrics.ttft.observe(ttft)
            resp.start(upstream.status, fields=self._resp_fields(upstream, target, req))
        if splice is not None:  # a limit the sequence already reached (a fallback to an earlier
            limit = rt.router.policy.context_limit(target)  # stage) would re-route it every token
            splice.limit = limit if limit is not None and limit > splice.length() else None
        tail = b""  # the stream's last bytes: is it at an event boundary, did [DONE] arrive?
        pieces = 0  # token events seen (no splice: counted here)

        def generated() -> int:
            reported = reported_completion_tokens(tail)
            if reported is not None:
                return reported
            return splice.tokens - splice.leg_start if splice is not None else pieces

        def step(chunk: bytes) -> bool:
            """One piece of the stream to the client, from the loop below or straight from the
            upstream's read callback (``next_chunk``'s relay); False when the loop must act: an
            error event, the context limit reached, or a client not reading."""
            nonlocal tail, pieces
            if splice is None:
                full = resp.push(chunk)
                new = token_events(chunk)
                pieces += new
            else:
                new = -splice.count
                full = resp.push(splice.feed(chunk))
                new += splice.count
            if new and watch is not None:
                watch.progressed(monotonic())
            tail = (tail + chunk)[-STREAM_TAIL:]
            return not full and (splice is None or (splice.error is None and not splice.outgrown))

        try:
            chunk: bytes | None = first
            while chunk is not None:
                if not step(chunk):
                    if splice is not None:
                        if splice.error is not None:
                            raise UpstreamError(f"error event: {splice.error}")
                        if splice.outgrown:
                            return _NEUTRAL, Break("migrate", f"the sequence reached {splice.limit} tokens, "
                                                     f"the context limit of {target}"), generated()
                    await resp.drain()
                chunk = await upstream.next_chunk(relay=step)
            if splice is not None and splice.partial.strip():  # a last event without its blank line
                await resp.write(splice.feed(b"\n\n"))
            if end_marker is not None and end_marker not in tail[-32:]:
                raise UpstreamError(f"upstream ended the stream without {end_marker.decode()}")
            outcome = _OK
            self._count_tokens(target, req.id, tail)
        except UpstreamError as exc:
            outcome = _FAILED
            log.warning("upstream %s failed mid-stream: %s", target, exc)
            if splice is not None and splice.continuable and not splice.done:
                return outcome, Break("recover", f"upstream {target} failed mid-stream: {exc}"), generated()
            # never glue the error onto a partial event
            sep = b"" if tail.endswith((b"\n\n", b"\r\n\r\n")) or not tail else b"\n\n"
            await resp.write(sep + error_event(f"upstream {target} failed mid-stream: {exc}", "upstream_stream_error"))
        await resp.end()
        return outcome, None, generated()

    async def _continue(self, request: HTTPRequest, resp: Responder, kind: Kind, headers: list[tuple[str, str]],
                        req: Request, served: dict[str, Any], splice: Splice, brk: Break | None) -> None:
        """Carry a stream on, leg by leg, after it broke or outgrew its replica
        (``gateway/continuation.py``): each leg is routed like a request whose prompt is the
        original plus the text generated so far, and retried like one; a replica that failed is
        not used again. At most ``retry.max_continuations`` legs; then an SSE error ends it."""
        rt = self.rt
        leg_resp = LegResponder(resp)
        while brk is not None:
            reason, cause = brk.reason, brk.message
            body = splice.next_body()
            if body is None:  # every token the client asked for is out: only the ending was lost
                rt.metrics.continuations.labels(reason, "completed").inc()
                await resp.write(splice.length_ending())
                break
            if splice.legs > rt.config.retry.max_continuations or not splice.continuable:
                rt.metrics.continuations.labels(reason, "refused").inc()
                why = (f"{rt.config.retry.max_continuations} continuation(s) already made"
                       if splice.continuable else "this stream cannot be continued")
                await resp.write(error_event(f"{brk.message}; {why}", "upstream_stream_error"))
                break
            log.info("continuing %s (%s) after %d token(s): %s", req.id, reason, splice.tokens, brk.message)
            if reason == "recover" and served.get("replica"):
                served["excluded"].append(served["replica"])
            splice.begin_leg()
            leg = HTTPRequest(request.method, request.path, request.headers, request.keep_alive)
            leg.body = json.dumps(body).encode()
            field = "messages" if splice.chat else "prompt"
            hashes, _ = self.hasher.of(prompt_key(field, body[field]))
            leg_req = replace(req, id=f"{req.id}.{splice.legs}", arrival_s=monotonic(), block_hashes=hashes,
                              prompt_tokens=splice.length(),
                              max_output_tokens=max(1, req.max_output_tokens - splice.tokens),
                              exclude=tuple(dict.fromkeys((*req.exclude, *served["excluded"]))))
            served["legs"] = splice.legs
            # counted as the leg passes its first bytes on: before the client can see its [DONE]
            leg_resp.next_leg(rt.metrics.continuations.labels(reason, "continued").inc)
            # the leg's own clock: policies that learn from TTFT and E2E see this leg's, not the request's
            brk = await self._route_and_forward(leg, leg_resp, kind, True, leg_req, headers, served, monotonic(),
                                                splice)
            if leg_resp.refusal is not None:
                rt.metrics.continuations.labels(reason, "failed").inc()
                message, code = leg_resp.refusal
                await resp.write(error_event(f"{cause}; the stream could not be continued: {message} "
                                             f"({code})", "upstream_stream_error"))
                break
            leg_resp.begun()  # (a leg that passed nothing on, its client gone, is counted as before)
        await resp.end()
