"""The gateway's request handling: OpenAI endpoints in, the routed replica's response out.

A completion request is parsed and validated, keyed and hashed once, admitted by the runtime
(route now or wait in the LB queue), then proxied. Streams pass through chunk by chunk as the
upstream produces them, but the response head is held until the first body byte, so a replica
that fails before producing anything is retried like one that never answered.

Retries: an attempt that fails before any byte reached the client is retried on another replica
when the failure is on the allow-list (connect errors, timeouts, broken HTTP, and the statuses
408, 429, 500, 502, 503, 504), with exponential backoff and jitter between attempts and never
after the last. For streams the first-byte timeout applies per attempt and, as ``first_byte_total_s``,
to all attempts of a request together; a non-streamed response arrives only when generation ends,
so it has its own limits (``non_stream_s``, ``non_stream_total_s``: by default a timed-out one is not
generated again elsewhere). When no attempt succeeds the client gets the last failure as 502 (504
for timeouts, 429 passed on); once bytes are out, a streamed chat or completion is continued on
another replica (``gateway/continuation.py``: after an upstream failure, or when it outgrows the
replica's ``context_limit``), and a stream that cannot be continued ends with an SSE error event
and ``[DONE]``. Every exit path undoes the router's accounting exactly once and counts
the request once.
HTTP itself is ``gateway/http.py``; upstreams are ``gateway/upstream.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import sys
import time
import uuid
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from kvroute.errors import ClientError
from kvroute.gateway.admin import handle_admin
from kvroute.gateway.auth import KeyState, bearer
from kvroute.gateway.breaker import CircuitState
from kvroute.gateway.config import GatewayConfig, load_config
from kvroute.gateway.continuation import Break, LegResponder, Splice, error_event
from kvroute.gateway.http import HTTPServer, Responder
from kvroute.gateway.http import Request as HTTPRequest
from kvroute.gateway.outlier import Attempt
from kvroute.gateway.pd import forward_split
from kvroute.gateway.peers import PEER_HEADERS, STATUS_PATH
from kvroute.gateway.residency import REGION_HEADER, RESIDENCY_HEADER, ResidencyConflict
from kvroute.gateway.runtime import Outcome, PolicyError, QueueFull, QueueTimeout, Runtime
from kvroute.gateway.tokens import reported_completion_tokens, reported_prompt_tokens, token_events
from kvroute.gateway.tracing import Tracer
from kvroute.gateway.upstream import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvroute.model import DecisionKind, Request
from kvroute.prefix import BlockHasher, PromptError, chat_key, completion_key
from kvroute.shutdown import until_stopped

log = logging.getLogger("kvroute.gateway")
access = logging.getLogger("kvroute.access")
# never forwarded in either direction (RFC 9110 §7.6.1), plus what the gateway sets itself and its own
# routing headers (an engine has no use for them; a forward to a peer carries them again: Peering.outbound)
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect",
                         "accept-encoding", "upgrade", "te", "trailer", "proxy-authorization",
                         "proxy-authenticate", "proxy-connection", "server", "date",
                         RESIDENCY_HEADER, REGION_HEADER}) | PEER_HEADERS
RESTART_ONLY = ("host", "port", "pd")  # the listening socket and the P/D router; everything else reloads
ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/embeddings": "POST",
          "/v1/responses": "POST", "/tokenize": "POST", "/detokenize": "POST", "/v1/models": "GET",
          "/health": "GET", "/livez": "GET", "/readyz": "GET", "/metrics": "GET"}


@dataclass(frozen=True)
class Kind:
    """A proxied endpoint: its metrics label, the body fields that carry the prompt (the first
    present one is keyed), and what ends a complete stream (None: the engine's own framing)."""

    label: str
    prompt_fields: tuple[str, ...]
    stream_end: bytes | None = b"[DONE]"


PROXIED = {
    "/v1/chat/completions": Kind("chat", ("messages",)),
    "/v1/completions": Kind("completions", ("prompt",)),
    "/v1/embeddings": Kind("embeddings", ("input",)),
    "/v1/responses": Kind("responses", ("input",), None),  # its stream ends with an event, no [DONE]
    "/tokenize": Kind("tokenize", ("prompt", "messages", "content")),  # vLLM, SGLang / llama.cpp names
    "/detokenize": Kind("detokenize", ("tokens",)),
}
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_INT32 = 2**31 - 1
STREAM_TAIL = 4096  # bytes of a stream kept to find its [DONE] and its final usage chunk
MAX_N = 128  # OpenAI's limit on choices per request


class RetryReason(StrEnum):
    """Why an attempt is retried elsewhere (the ``reason`` label of ``kvroute_retries``)."""

    CONNECT = "connect"
    TIMEOUT = "timeout"
    PROTOCOL = "protocol"
    STATUS = "status"
    REPLICA_REMOVED = "replica_removed"


@dataclass
class Failure:
    """An attempt that sent nothing to the client: why, and what the client gets if it is the last."""

    reason: RetryReason
    message: str
    status: int = 502
    code: str = "upstream_error"
    replica: str | None = None  # the replica that failed, when not the attempt's target (a prefill leg)


class BadInput(ClientError):
    """The request body is unusable; the message names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, 400, param)


def _failure_of(exc: UpstreamError, target: str) -> Failure:
    if isinstance(exc, UpstreamTimeout):
        return Failure(RetryReason.TIMEOUT, f"upstream {target} timed out: {exc}", 504, "upstream_timeout")
    if isinstance(exc, UpstreamConnectError):
        return Failure(RetryReason.CONNECT, f"upstream {target} unreachable: {exc}")
    return Failure(RetryReason.PROTOCOL, f"upstream {target} failed: {exc}")


def _forwarded(headers: dict[str, str]) -> list[tuple[str, str]]:
    """End-to-end headers only: hop-by-hop ones and those the client's Connection names are dropped."""
    drop = HOP_HEADERS
    if "connection" in headers:
        drop = drop | {t.strip().lower() for t in headers["connection"].split(",")}
    return [(k, v) for k, v in headers.items() if k not in drop]


def _prompt_key(field: str, value: Any) -> str | list[int]:
    """The canonical key of a prompt-carrying field (see ``prefix/keys.py``)."""
    if field == "messages" or (field == "input" and isinstance(value, list) and value
                               and all(isinstance(m, dict) and "role" in m for m in value)):
        return chat_key(value)  # chat messages, or a Responses input made of messages
    if field == "input" and isinstance(value, list) and any(isinstance(m, dict) for m in value):
        return json.dumps(value, sort_keys=True)  # other Responses input items: keyed as written
    return completion_key(value)  # text, texts (the first decides), or token ids


class Proxy:
    """Per-request routing and forwarding; one instance per application."""

    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.rng = random.Random()
        self.id_prefix = f"{uuid.uuid4().hex[:8]}-"  # request ids: unique per process, cheap per request
        self.ids = itertools.count(1)
        self.estimates: dict[str, int] = {}  # request id → its unscaled token estimate, while it runs
        self.tracer = Tracer(runtime.config.tracing.enabled)
        self.reconfigure(runtime.config)

    def reconfigure(self, config: GatewayConfig) -> list[str]:
        """(Re)build what parsing depends on: the prompt hasher and the session headers."""
        changes = []
        old = getattr(self, "config", None)
        if old is None or (config.block_tokens, config.tokenizer_path) != (old.block_tokens, old.tokenizer_path):
            path, self.engine_tokens = config.tokenizer_path, None
            if path is not None and Path(path).is_dir():  # the engine's own ids (chat template included)
                from kvroute.kvevents.tokenize import EngineTokenizer

                self.engine_tokens = EngineTokenizer(path)
                path = str(Path(path) / "tokenizer.json")
            self.hasher = BlockHasher(config.block_tokens, path)
            changes.append("prompt hashing")
        if old is None or config.session_headers != old.session_headers:
            self.session_headers = [h.lower() for h in config.session_headers]
            changes.append("session headers")
        self.config = config
        return changes if old is not None else []

    # -- request parsing --------------------------------------------------------------------
    def parse(self, raw: bytes, kind: Kind, headers: dict[str, str]) -> tuple[dict, Request]:
        """Validate the body (the fields routing reads; the rest passes through) and key it."""
        try:
            body = json.loads(raw)
        except UnicodeDecodeError:
            raise BadInput("request body is not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                           f"column {exc.colno}") from None
        except RecursionError:
            raise BadInput("request body is nested too deeply") from None
        except ValueError as exc:  # e.g. an integer longer than Python's 4,300-digit limit
            raise BadInput(f"request body has an unreadable value: {str(exc)[:120]}") from None
        if not isinstance(body, dict):
            raise BadInput("request body must be a JSON object")
        field = next((f for f in kind.prompt_fields if f in body), None)
        if field is None:
            names = " or ".join(f"'{f}'" for f in kind.prompt_fields)
            raise BadInput(f"missing required field {names}", kind.prompt_fields[0])
        for name, typ in (("model", str), ("stream", bool), ("user", str)):
            if body.get(name) is not None and not isinstance(body[name], typ):
                raise BadInput(f"field '{name}' must be a {typ.__name__}, got {type(body[name]).__name__}", name)
        for name, top in (("max_tokens", MAX_INT32), ("max_completion_tokens", MAX_INT32), ("n", MAX_N)):
            v = body.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= top):
                raise BadInput(f"field '{name}' must be an integer from 1 to {top}", name)
        try:
            key = _prompt_key(field, body[field])
        except PromptError as exc:
            raise BadInput(str(exc), field) from None
        except RecursionError:
            raise BadInput(f"field '{field}' is nested too deeply", field) from None
        if self.engine_tokens is not None:  # the ids the engine will cache, as its KV events report them
            ids = self.engine_tokens.prompt_ids(field, body)
            if ids:
                key = ids
        hashes, tokens = self.hasher(key)
        block_tokens = self.hasher.block_tokens
        estimated = 0  # the bytes/4 estimate, when that is what counted the prompt
        if isinstance(key, str) and not self.config.tokenizer_path:
            ratio = self.rt.tokens  # corrected online from the engines' usage (gateway/tokens.py)
            estimated, tokens, block_tokens = tokens, ratio.tokens(tokens), ratio.block_tokens(block_tokens)
        routing_key = next((headers[h] for h in self.session_headers if h in headers), None)
        if routing_key is None and isinstance(body.get("user"), str):
            routing_key = body["user"]
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        req = Request(id=f"{self.id_prefix}{next(self.ids)}", arrival_s=time.monotonic(),
                      routing_key=routing_key, block_hashes=hashes, block_tokens=block_tokens,
                      prompt_tokens=tokens, max_output_tokens=max_out,
                      region=headers.get(REGION_HEADER), residency=headers.get(RESIDENCY_HEADER))
        if estimated:
            self.estimates[req.id] = estimated
        return body, req

    # -- the handler ----------------------------------------------------------------------------
    async def handle(self, request: HTTPRequest, resp: Responder, kind: Kind, key: KeyState | None = None) -> None:
        """Answer one proxied request; counted and logged once, whatever happens."""
        rt = self.rt
        route = kind.label
        t0 = time.monotonic()
        body: dict = {}
        req: Request | None = None
        served: dict[str, Any] = {"excluded": []}  # where it went, for the access line
        span = self.tracer.start(route)
        try:
            try:
                body, req = self.parse(request.body, kind, request.headers)
            except BadInput as exc:
                resp.send_error(400, str(exc), param=exc.param)
                return
            if rt.draining:
                resp.send_error(503, "gateway is draining", "server_error", headers=[("Retry-After", "1")])
                return
            if key is not None:
                wait = key.admit(req.prompt_tokens + req.max_output_tokens, time.monotonic())
                if wait:
                    resp.send_error(429, f"rate limit of key {key.name!r} reached; retry in {wait} s",
                                    "rate_limit_error", code="rate_limit_exceeded",
                                    headers=[("Retry-After", str(wait))])
                    return
            model = body.get("model")
            exclude = rt.excluded_for(model)
            if exclude is None:
                known = ", ".join(sorted(str(c.get("id")) for c in rt.model_cards())) or "none"
                resp.send_error(404, f"The model '{model}' does not exist; available: {known}",
                                param="model", code="model_not_found")
                return
            if exclude:  # drained replicas, and those not serving the model: the policy never sees them
                req.exclude = exclude
            if rt.config.access_log:  # the client's own id when it sent one (forwarded upstream as is)
                resp.extra_headers.append(("x-request-id", request.headers.get("x-request-id") or req.id))
            try:
                rt.peering.accept(req, request.headers, key)  # hops, residency pin (gateway/peers.py)
            except ResidencyConflict as exc:
                resp.send_error(403, str(exc), "permission_error", code="residency_conflict")
                return
            headers = _forwarded(request.headers)
            if rt.keys.enabled and not rt.config.auth.forward_authorization:
                headers = [(k, v) for k, v in headers if k != "authorization"]  # the client's key is ours
            splice = Splice.open(kind.label, body, req.prompt_tokens) if rt.config.retry.max_continuations else None
            brk = await self._route_and_forward(request, resp, kind, bool(body.get("stream")), req, headers, served,
                                                t0, splice)
            if brk is not None and splice is not None:
                await self._continue(request, resp, kind, headers, req, served, splice, brk)
        finally:
            if req is not None:
                self.estimates.pop(req.id, None)
            rt.metrics.count_request(route, resp.status or 499, rt.policy_name)  # 499: the client left
            if served.get("replica") is not None and resp.started:  # proxied, even if the client left
                rt.metrics.e2e.observe(time.monotonic() - t0)
            if rt.config.access_log and req is not None and access.isEnabledFor(logging.INFO):
                self._access(resp, route, body, req, served, t0, request.headers.get("x-request-id"))
            if span is not None:
                self.tracer.end(span, {
                    "request_id": req.id if req else None, "model": body.get("model"), "policy": rt.policy_name,
                    "branch": served.get("branch"), "replica": served.get("replica"),
                    "failed_on": ",".join(served["excluded"]) or None, "status": resp.status or 499,
                    "aborted": resp.started and not resp.finished, "stream": bool(body.get("stream"))})

    def _access(self, resp: Responder, route: str, body: dict, req: Request, served: dict, t0: float,
                client_rid: str | None) -> None:
        """One JSON line per request: what happened, never the prompt unless asked."""
        fields = {"rid": req.id, "client_rid": client_rid, "route": route,
                  "status": resp.status or 499,  # 499: the client left
                  "replica": served.get("replica"), "branch": served.get("branch"),
                  "prompt_tokens": req.prompt_tokens, "stream": bool(body.get("stream")),
                  "ms": round((time.monotonic() - t0) * 1000, 2)}
        if served["excluded"]:
            fields["failed_on"] = served["excluded"]
        if served.get("legs"):
            fields["legs"] = served["legs"]  # continued on other replicas; "replica" is the last
        if resp.started and not resp.finished:
            fields["aborted"] = True  # the client left mid-response
        if self.rt.config.log_prompts:
            prompt = body.get("messages")
            fields["prompt"] = (chat_key(prompt) if isinstance(prompt, list) else
                                str(next((body[f] for f in ("prompt", "input", "content", "tokens") if f in body),
                                         "")))[:512]
        access.info("request", extra={"fields": fields})

    async def _route_and_forward(self, request: HTTPRequest, resp: Responder | LegResponder, kind: Kind,
                                 stream: bool, req: Request, headers: list[tuple[str, str]], served: dict[str, Any],
                                 t0: float, splice: Splice | None = None) -> Break | None:
        """Route and proxy with retries; a stream that broke or outgrew its replica after bytes
        were out comes back as a Break, for the caller to continue."""
        rt = self.rt
        rc = rt.config.retry
        excluded = served["excluded"]  # replicas that failed this request
        unfit = req.exclude  # replicas that do not serve its model
        to = rt.config.timeouts
        deadline = time.monotonic() + (to.first_byte_total_s if stream else to.non_stream_total_s)  # all attempts
        failure: Failure | None = None
        for attempt in range(1, rc.max_attempts + 1):
            try:
                decision = await rt.admit(req)
            except QueueFull as exc:
                rt.metrics.rejected.labels("full").inc()
                resp.send_error(429, str(exc), "rate_limit_error", code="queue_full", headers=[("Retry-After", "1")])
                return None
            except QueueTimeout as exc:
                rt.metrics.rejected.labels("timeout").inc()
                resp.send_error(503, str(exc), "server_error", code="queue_timeout", headers=[("Retry-After", "2")])
                return None
            except PolicyError as exc:
                resp.send_error(503, f"{exc}; see the gateway log", "server_error", code="policy_error")
                return None
            if decision.kind is DecisionKind.NONE:
                if failure is not None:
                    break  # every replica that could take it has failed: the last failure answers
                resp.send_error(503, f"no replica can serve this request: {decision.reason}", "server_error",
                                code=decision.branch)
                return None
            target = decision.target
            assert target is not None  # a dispatch names its target
            served["replica"], served["branch"] = target, decision.branch
            rt.dispatched(req, decision)
            sent = rt.peering.outbound(headers, req, request.headers) if target in rt.peering.links else headers
            if decision.prefill is not None:  # a prefill/decode pair (gateway/pd.py)
                result = await forward_split(self, request, resp, kind, sent, req, decision, stream, t0, deadline,
                                             splice)
            else:
                result = await self._forward(request, resp, kind, sent, req, target, stream, t0, deadline, splice)
            if not isinstance(result, Failure):
                return result  # the client has its answer, or the stream is to go on elsewhere
            failure = result
            excluded.append(result.replica or target)
            req.exclude = (*unfit, *excluded)
            left = deadline - time.monotonic()
            if attempt == rc.max_attempts or left <= 0:
                break
            rt.metrics.retries.labels(failure.reason).inc()
            delay = min(rc.backoff_max_s, rc.backoff_s * 2 ** (attempt - 1)) * (0.5 + self.rng.random())
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

    def _resp_headers(self, upstream: UpstreamResponse, target: str, req: Request) -> list[tuple[str, str]]:
        skip = HOP_HEADERS | {"x-request-id"} if self.rt.config.access_log else HOP_HEADERS  # set by us
        out = [(k, v) for k, v in upstream.headers if k.lower() not in skip]
        if self.rt.config.replica_header and target in self.rt.upstreams:  # a peer's answer names its own
            out.append(("x-kvroute-replica", target))
            ticket = self.rt.router.tickets.get(req.id)
            if ticket is not None:  # the prompt tokens the index predicted cached there (engines report theirs)
                hit = min(req.prompt_tokens, ticket.matched_blocks * req.block_tokens)
                out.append(("x-kvroute-prefix-hit", str(hit)))
        return out

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
        to = rt.config.timeouts
        upstream = None
        outcome = Outcome.NEUTRAL
        served = False  # the engine took the request (so it holds the prompt's prefix now)
        output_tokens = 0  # what this attempt generated (the policy's on_finished hears it)
        # a stream's progress is watched: an engine whose streams all go silent is ejected (gateway/outlier.py)
        watch = rt.stalls.detector.begin(target, req.prompt_tokens, time.monotonic()) \
            if stream and rt.config.stall.enabled and target in rt.upstreams else None
        try:
            try:
                attempt_deadline = min(deadline, time.monotonic() + (to.first_byte_s if stream else to.non_stream_s))
                sent = request.body
                if splice is not None:  # vLLM's running usage counts a continuable stream's tokens exactly
                    splice.usage_added = False
                    if target in rt.upstreams and rt.upstreams[target].engine == "vllm":
                        sent = splice.exact_body(sent)
                upstream = await up.pool.post(request.path, sent, headers, connect_s=to.connect_s,
                                              first_byte_s=max(attempt_deadline - time.monotonic(), 0.001),
                                              idle_s=to.idle_s, on_send=watch.attach if watch else None)
                status = upstream.status
                budget = max(attempt_deadline - time.monotonic(), 0.001)  # the first body byte counts too
                if status in RETRY_STATUSES:
                    await upstream.read(budget)  # read to the end so the connection can be reused
                    if status >= 500:
                        outcome = Outcome.FAILED
                    return Failure(RetryReason.STATUS, f"upstream {target} answered {status}",
                                   429 if status == 429 else 502, "upstream_overloaded" if status == 429
                                   else "upstream_error")
                first: bytes | None = None
                payload = b""
                if stream and status == 200:
                    first = await upstream.next_chunk(budget)  # hold the head until a byte of body
                    if first is None:
                        raise UpstreamProtocolError("upstream ended the stream before sending anything")
                else:
                    payload = await upstream.read(budget)
                served = status < 400  # a body, or a stream's first bytes, came back
            except UpstreamError as exc:  # nothing has reached the client yet: retryable
                outcome = Outcome.FAILED
                log.warning("upstream %s failed before responding: %s", target, exc)
                return _failure_of(exc, target)
            if first is not None:
                outcome, brk, output_tokens = await self._stream(resp, upstream, first, req, target, t0,
                                                                 kind.stream_end, splice, watch)
                return brk
            ttft = time.monotonic() - t0
            rt.first_token(req.id, ttft)
            rt.metrics.ttft.observe(ttft)
            outcome = Outcome.OK if upstream.status < 500 else Outcome.NEUTRAL
            if upstream.status == 200:
                self._count_tokens(target, req.id, payload)
                output_tokens = reported_completion_tokens(payload) or 0
            resp.send(upstream.status, payload, self._resp_headers(upstream, target, req), content_type=None)
            return None
        finally:
            if watch is not None:
                watch.watch.end(watch)
            rt.release(req.id, served, time.monotonic() - t0 if outcome is Outcome.OK else None, output_tokens)
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
        ttft = time.monotonic() - t0
        rt.first_token(req.id, ttft)
        if not resp.started:  # a continuation leg writes on into the client's stream
            rt.metrics.ttft.observe(ttft)
            resp.start(upstream.status, self._resp_headers(upstream, target, req))
        if splice is not None:  # a limit the sequence already reached (a fallback to an earlier
            limit = rt.router.policy.context_limit(target)  # stage) would re-route it every token
            splice.limit = limit if limit is not None and limit > splice.length() else None
        chunk: bytes | None = first
        tail = b""  # the stream's last bytes: is it at an event boundary, did [DONE] arrive?
        pieces = 0  # token events seen (no splice: counted here)

        def generated() -> int:
            reported = reported_completion_tokens(tail)
            if reported is not None:
                return reported
            return splice.tokens - splice.leg_start if splice is not None else pieces

        try:
            while chunk is not None:
                if splice is None:
                    await resp.write(chunk)
                    new = token_events(chunk)
                    pieces += new
                else:
                    new = -splice.count
                    await resp.write(splice.feed(chunk))
                    new += splice.count
                if new and watch is not None:
                    watch.progressed(time.monotonic())
                tail = (tail + chunk)[-STREAM_TAIL:]
                if splice is not None:
                    if splice.error is not None:
                        raise UpstreamError(f"error event: {splice.error}")
                    if splice.outgrown:
                        return Outcome.NEUTRAL, Break("migrate", f"the sequence reached {splice.limit} tokens, the "
                                                 f"context limit of {target}"), generated()
                chunk = await upstream.next_chunk()
            if splice is not None and splice.partial.strip():  # a last event without its blank line
                await resp.write(splice.feed(b"\n\n"))
            if end_marker is not None and end_marker not in tail[-32:]:
                raise UpstreamError(f"upstream ended the stream without {end_marker.decode()}")
            outcome = Outcome.OK
            self._count_tokens(target, req.id, tail)
        except UpstreamError as exc:
            outcome = Outcome.FAILED
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
            hashes, _ = self.hasher(_prompt_key(field, body[field]))
            leg_req = replace(req, id=f"{req.id}.{splice.legs}", arrival_s=time.monotonic(), block_hashes=hashes,
                              prompt_tokens=splice.length(),
                              max_output_tokens=max(1, req.max_output_tokens - splice.tokens),
                              exclude=tuple(dict.fromkeys((*req.exclude, *served["excluded"]))))
            served["legs"] = splice.legs
            # the leg's own clock: policies that learn from TTFT and E2E see this leg's, not the request's
            brk = await self._route_and_forward(leg, leg_resp, kind, True, leg_req, headers, served, time.monotonic(),
                                                splice)
            if leg_resp.refusal is not None:
                rt.metrics.continuations.labels(reason, "failed").inc()
                message, code = leg_resp.refusal
                await resp.write(error_event(f"{cause}; the stream could not be continued: {message} "
                                             f"({code})", "upstream_stream_error"))
                break
            rt.metrics.continuations.labels(reason, "continued").inc()
        await resp.end()


class Gateway:
    """A running gateway: start, reload, drain, stop — usable in-process (tests, demo) or by `serve`."""

    def __init__(self, config: GatewayConfig, config_path: str | None = None):
        self.config = config
        self.config_path = config_path
        self.runtime = Runtime(config)
        self.proxy = Proxy(self.runtime)
        self.http = HTTPServer(self.dispatch, config.http_limits())
        self.runtime.metrics.watch_http(self.http)
        self.port = config.port

    async def dispatch(self, request: HTTPRequest, resp: Responder) -> None:
        """Serve one request by path. HEAD is served wherever GET is, as a GET whose body the
        responder leaves out (``gateway/http.py``)."""
        method = ROUTES.get(request.path)
        if request.method == "HEAD" and (method == "GET" or method is None):
            request.method = "GET"  # resp.head_only drops the body; admin and peer paths read GET
        if request.path.startswith("/admin/"):
            handle_admin(self.runtime, request, resp)
        elif request.path == STATUS_PATH:
            self.runtime.peering.serve_status(request, resp)
        elif method is None:
            resp.send_error(404, f"unknown path {request.path}", code="not_found")
        elif request.method != method:
            allowed = "GET, HEAD" if method == "GET" else method
            resp.send_error(405, f"method {request.method} not allowed on {request.path}; allowed: {allowed}",
                            headers=[("Allow", allowed)])
        elif request.path in PROXIED:
            key = self._authenticate(request, resp)
            if key is not False:
                await self.proxy.handle(request, resp, PROXIED[request.path], key)
        elif request.path in ("/health", "/readyz"):
            self._health(resp)
        elif request.path == "/livez":  # the process answers: nothing more is promised
            resp.send(200, b'{"status": "alive"}')
        elif request.path == "/metrics":
            resp.send(200, self.runtime.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")
        elif self._authenticate(request, resp) is not False:
            self._models(resp)

    def _health(self, resp: Responder) -> None:
        rt = self.runtime
        healthy = sum(1 for u in rt.upstreams.values()
                      if u.endpoint.healthy and u.breaker.state is not CircuitState.OPEN)
        ok = healthy and rt.ready and not rt.draining
        body = {"status": "ok" if ok else "unavailable", "replicas": len(rt.upstreams), "healthy": healthy,
                "queue": len(rt.queue), "policy": rt.policy_name}
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


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record is emitted, not as it was when logging was
    configured: a stream swapped out since (a test's captured stderr, closed after the test) would
    turn every later log line into a "--- Logging error ---" report."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


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

    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvroute")
    root.handlers[:] = [handler]
    root.setLevel(level)
