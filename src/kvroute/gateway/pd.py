"""The gateway's two prefill/decode wire protocols (docs/pd.md has the field-by-field sources).

A request the PDRouter split (``Decision.prefill`` set) is served by two engines:

* **vLLM** (NixlConnector; vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``):
  first the prefill engine gets the body with ``kv_transfer_params = {do_remote_decode: true,
  do_remote_prefill: false, remote_*: null}``, ``stream: false``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1`` when present), without ``stream_options``, ``min_tokens``,
  ``min_completion_tokens``; its JSON answer carries ``kv_transfer_params`` (``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``, ...), which the decode request — the
  client's body as it came — carries on, opaque. Both legs share one ``X-Request-Id``.
* **SGLang** (``python/sglang/srt/disaggregation/mini_lb.py``): the body gets ``bootstrap_host``
  (the prefill engine's host, IPv6 in brackets), ``bootstrap_port`` (its KV bootstrap server)
  and ``bootstrap_room`` (random in [0, 2^63 − 1]); the *same* body goes to both engines at
  once and the client gets the decode engine's answer. The prefill engine's answer is drained;
  its leg is not cancelled when the decode leg ends (llm-d's sidecar runs it detached).

The decode leg is an ordinary attempt (``Proxy._forward``): streaming, timeouts, retries,
continuation and accounting as for any request. A prefill leg that fails before the decode
leg produced a byte fails the attempt — a :class:`~kvroute.gateway.server.Failure` naming the
prefill engine, retried elsewhere like any failed attempt (a prefill pool with nothing left
makes the next attempt aggregated on a decode engine). A request of another kind (embeddings,
tokenize, responses) is not split: its prefill leg is undone and the decode engine serves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from ipaddress import IPv6Address
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from kvroute.errors import ServiceError
from kvroute.gateway.http import Request as HTTPRequest
from kvroute.gateway.openai import Kind
from kvroute.gateway.replica import Outcome
from kvroute.gateway.retry import Failure, RetryReason
from kvroute.gateway.runtime import Runtime
from kvroute.gateway.upstream import UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from kvroute.gateway.continuation import Break, Splice
    from kvroute.gateway.http import Responder
    from kvroute.gateway.legs import LegResponder
    from kvroute.model import Decision, Request

log = logging.getLogger("kvroute.gateway")
PREFILL_HEADER = "x-kvroute-prefill"
SPLITTABLE = ("chat", "completions")  # what a prefill leg can compute (the OpenAI generation endpoints)
NULL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


class Proxy(Protocol):
    """What a split attempt needs of the proxy that runs it (``gateway/proxy.py``): the runtime, the
    proxy's RNG, and one ordinary attempt for the decode leg."""

    rt: Runtime
    rng: random.Random

    async def _forward(self, request: HTTPRequest, resp: Responder | LegResponder, kind: Kind,
                       headers: list[tuple[str, str]], req: Request, target: str, stream: bool, t0: float,
                       deadline: float, splice: Splice | None = None) -> Failure | Break | None:
        """Proxy one attempt (None: answered; a Failure: nothing sent; a Break: continue elsewhere)."""


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body in vLLM's protocol (module docstring)."""
    out = {k: v for k, v in body.items()
           if k not in ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")}
    out["kv_transfer_params"] = dict(NULL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def sglang_body(body: dict[str, Any], prefill_url: str, bootstrap_port: int | None,
                rng: random.Random) -> dict[str, Any]:
    """The body both legs get in SGLang's protocol: the client's plus the bootstrap triple."""
    host = urlsplit(prefill_url).hostname or "127.0.0.1"
    try:
        host = f"[{IPv6Address(host)}]"  # SGLang's maybe_wrap_ipv6_address
    except ValueError:
        pass
    return {**body, "bootstrap_host": host, "bootstrap_port": bootstrap_port,
            "bootstrap_room": rng.randint(0, 2**63 - 1)}


def _with_request_id(headers: list[tuple[str, str]], rid: str) -> list[tuple[str, str]]:
    return [*((k, v) for k, v in headers if k != "x-request-id"), ("x-request-id", rid)]


def _leg(request: HTTPRequest, body: dict[str, Any]) -> HTTPRequest:
    leg = HTTPRequest(request.method, request.path, request.headers, request.keep_alive)
    leg.body = json.dumps(body).encode()
    return leg


def _mark(resp: Any, prefill: str | None) -> None:
    """Name the prefill engine in ``x-kvroute-prefill`` (beside ``x-kvroute-replica``), or drop
    the name again when the attempt failed."""
    extra = getattr(resp, "extra_headers", None)
    if extra is None:
        return  # a continuation leg: the client's head is out already
    extra[:] = [h for h in extra if h[0] != PREFILL_HEADER]
    if prefill is not None:
        extra.append((PREFILL_HEADER, prefill))


class PrefillFailed(ServiceError):
    """The prefill leg failed; the message names the engine and why."""

    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


async def _prefill(proxy: Proxy, target: str, path: str, body: dict[str, Any], headers: list[tuple[str, str]],
                   deadline: float) -> dict[str, Any] | None:
    """POST the prefill leg and read its answer to the end (JSON when it is one, else None);
    any failure is a PrefillFailed naming the engine."""
    rt = proxy.rt
    up = rt.upstreams.get(target)
    if up is None:
        raise PrefillFailed(f"prefill engine {target} was removed")
    to = rt.config.timeouts
    upstream = None
    try:
        budget = max(deadline - time.monotonic(), 0.001)
        upstream = await up.pool.post(path, json.dumps(body).encode(), headers, connect_s=to.connect_s,
                                      first_byte_s=budget, idle_s=to.idle_s)
        payload = await upstream.read(max(deadline - time.monotonic(), 0.001))
        if upstream.status != 200:
            raise PrefillFailed(f"prefill engine {target} answered {upstream.status}: {payload[:200]!r}")
    except UpstreamError as exc:
        raise PrefillFailed(f"prefill engine {target} failed: {exc}", isinstance(exc, UpstreamTimeout)) from None
    finally:
        if upstream is not None:
            upstream.release()
    try:
        parsed = json.loads(payload)
    except ValueError:
        return None  # a stream (SGLang's prefill leg of a streamed request): drained, nothing to read
    return parsed if isinstance(parsed, dict) else None


def _prefill_failure(target: str, exc: PrefillFailed) -> Failure:
    if exc.timeout:
        return Failure(RetryReason.TIMEOUT, str(exc), 504, "upstream_timeout", replica=target)
    return Failure(RetryReason.STATUS if "answered" in str(exc) else RetryReason.CONNECT, str(exc), 502,
                   "prefill_failed", replica=target)


async def forward_split(proxy: Proxy, request: HTTPRequest, resp: Responder | LegResponder, kind: Kind,
                        headers: list[tuple[str, str]], req: Request, decision: Decision, stream: bool, t0: float,
                        deadline: float, splice: Splice | None) -> Failure | Break | None:
    """Serve one split attempt in the configured protocol; returns what ``Proxy._forward``
    returns (None: answered; a Failure: nothing sent, retry; a Break: continue the stream)."""
    rt = proxy.rt
    pd = rt.config.pd
    assert pd is not None and decision.prefill is not None and decision.target is not None
    p_target, d_target = decision.prefill, decision.target
    router: Any = rt.router  # a PDRouter (config.build_router)
    if kind.label not in SPLITTABLE:  # nothing to prefill apart: the decode engine serves it whole
        router.prefill.on_failed(req.id)
        rt.attempt_done(p_target, Outcome.NEUTRAL)
        return await proxy._forward(request, resp, kind, headers, req, d_target, stream, t0, deadline, splice)
    body = json.loads(request.body)
    _mark(resp, p_target if rt.config.replica_header else None)
    rid = request.headers.get("x-request-id") or f"{req.id}-{uuid.uuid4().hex[:12]}"
    headers = _with_request_id(headers, rid)
    to = rt.config.timeouts
    p_deadline = min(deadline, time.monotonic() + to.non_stream_s)
    if pd.protocol == "vllm":
        try:
            answer = await _prefill(proxy, p_target, request.path, vllm_prefill_body(body), headers, p_deadline)
        except PrefillFailed as exc:
            log.warning("%s: %s", req.id, exc)
            rt.release(req.id, served=False)
            rt.attempt_done(p_target, Outcome.FAILED)
            rt.attempt_done(d_target, Outcome.NEUTRAL)
            _mark(resp, None)
            return _prefill_failure(p_target, exc)
        router.on_prefill_done(req.id, time.monotonic() - t0)
        rt.attempt_done(p_target, Outcome.OK)
        params = (answer or {}).get("kv_transfer_params")
        if params:
            body["kv_transfer_params"] = params
        else:  # no connector on the prefill engine: the decode engine prefills itself (toy proxy alike)
            log.warning("%s: prefill engine %s returned no kv_transfer_params; the decode engine %s computes "
                        "the prompt itself", req.id, p_target, d_target)
        return await proxy._forward(_leg(request, body), resp, kind, headers, req, d_target, stream, t0, deadline,
                                    splice)
    up_p = rt.upstreams[p_target]
    both = sglang_body(body, up_p.config.url, up_p.config.bootstrap_port, proxy.rng)
    prefill = asyncio.create_task(_prefill(proxy, p_target, request.path, both, headers, p_deadline))
    decode = asyncio.create_task(proxy._forward(_leg(request, both), resp, kind, headers, req, d_target, stream,
                                                t0, deadline, splice))

    def prefill_over(task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            router.on_prefill_done(req.id, time.monotonic() - t0)
            rt.attempt_done(p_target, Outcome.OK)
        else:
            log.warning("%s: %s", req.id, exc)
            router.prefill.on_failed(req.id)
            rt.attempt_done(p_target, Outcome.FAILED)

    prefill.add_done_callback(prefill_over)
    try:
        await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        failed = prefill.exception() if prefill.done() and not prefill.cancelled() else None
        if failed is not None and not decode.done() and not resp.started:
            # the decode engine waits for KV that will never come: stop it, fail the attempt
            decode.cancel()
            await asyncio.gather(decode, return_exceptions=True)
            assert isinstance(failed, PrefillFailed)
            _mark(resp, None)
            return _prefill_failure(p_target, failed)
        return await decode
    except asyncio.CancelledError:  # the client left: the decode leg goes (its connection closes);
        decode.cancel()  # the prefill leg finishes on its own, bounded by its deadline
        raise
