"""The endpoint-picker protocol's names and message shapes (pure: builds protobuf messages).

Sources: the Gateway API inference extension's endpoint picker protocol (proposal 004: destination
in the ``x-gateway-destination-endpoint`` header and ``envoy.lb`` dynamic metadata, the subset hint,
the served endpoint, 503/429 as immediate responses, health services) and llm-d-router's handlers
(the header response sent after the whole body, then the body in ≤ 62,000-byte streamed chunks);
see shared/design/fleet-facts.md §2.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE)  # the last reports readiness
BODY_CHUNK = 62_000  # bytes per streamed body chunk (llm-d-router pkg/common/envoy/chunking.go)


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Request or response headers as a lower-cased dict (Envoy sends ``raw_value`` bytes or ``value``)."""
    out = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def metadata_value(req: ep.ProcessingRequest, namespace: str, key: str) -> list[str]:
    """A string or list of strings at ``metadata_context.filter_metadata[namespace][key]``."""
    fm = req.metadata_context.filter_metadata
    if namespace not in fm or key not in fm[namespace].fields:
        return []
    v = fm[namespace].fields[key]
    if v.HasField("list_value"):
        return [x.string_value for x in v.list_value.values if x.string_value]
    return [s.strip() for s in v.string_value.split(",") if s.strip()]


def _mutation(pairs: Sequence[tuple[str, str]]) -> ep.HeaderMutation:
    """Headers to set (raw bytes values, as Envoy sends them)."""
    return ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode())) for k, v in pairs])


def destination_response(endpoints: list[str], content_length: int | None,
                         extra: Sequence[tuple[str, str]] = ()) -> ep.ProcessingResponse:
    """The request-headers answer: the endpoints (chosen first, then fallbacks) in the header and
    in ``envoy.lb`` dynamic metadata, the route cache cleared so Envoy routes on them."""
    value = ",".join(endpoints)
    sets = [(DESTINATION, value), *extra]
    if content_length is not None:
        sets.append(("content-length", str(content_length)))
    mutation = _mutation(sets)
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION: value}})
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation,
                                                                      clear_route_cache=True)),
        dynamic_metadata=meta)


def body_responses(body: bytes, request: bool = True) -> list[ep.ProcessingResponse]:
    """``body`` handed back in streamed chunks (FULL_DUPLEX_STREAMED: what Envoy sends on is what
    the processor returns); an empty body is one empty end-of-stream chunk."""
    chunks = [body[i:i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
            body=chunk, end_of_stream=i == len(chunks) - 1)))
        br = ep.BodyResponse(response=common)
        out.append(ep.ProcessingResponse(request_body=br) if request else ep.ProcessingResponse(response_body=br))
    return out


def response_chunk(body: bytes, end: bool) -> ep.ProcessingResponse:
    """One response-body chunk passed back as it came."""
    return ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
        body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end)))))


def immediate(status: int, message: str, code: str, headers: Sequence[tuple[str, str]] = ()) -> ep.ProcessingResponse:
    """Answer the client directly (no upstream): an OpenAI-style error body with ``status``."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "code": code}}).encode()
    sets = [("content-type", "application/json"), *headers]
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body, details=code,  # type: ignore[arg-type]
        headers=_mutation(sets)))


def response_headers_ack(extra: Sequence[tuple[str, str]] = ()) -> ep.ProcessingResponse:
    """The response-headers answer, adding ``extra`` headers for the client."""
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse(
        header_mutation=_mutation(extra))))


def trailers_ack(request: bool) -> ep.ProcessingResponse:
    """An empty trailers answer."""
    return (ep.ProcessingResponse(request_trailers=ep.TrailersResponse()) if request else
            ep.ProcessingResponse(response_trailers=ep.TrailersResponse()))
