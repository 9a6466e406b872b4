"""A gRPC client that drives kvroute's ext_proc service the way Envoy does in FULL_DUPLEX_STREAMED
mode (request headers, the body in chunks without waiting, then response headers with the served
endpoint in metadata and the response body chunk by chunk), and forwards the request to the
endpoint the picker chose over real HTTP — the part of Envoy a test can play."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from kvroute.epp import protocol as P


def headers(pairs: dict[str, str], end: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=end)


def metadata(namespace: str, key: str, value: str | list[str]) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update({key: value})
    return base_pb2.Metadata(filter_metadata={namespace: s})


@dataclass
class Result:
    """What one exchange produced."""

    immediate: ep.ImmediateResponse | None = None
    endpoints: list[str] = field(default_factory=list)
    lb_metadata: str = ""
    set_headers: dict[str, str] = field(default_factory=dict)
    upstream_body: bytes = b""  # the request body as the picker handed it back
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)  # what the picker added
    response: bytes = b""  # the response body as echoed back through the picker


class Stream:
    """One Process stream: a queue of requests to send, responses read as they come."""

    def __init__(self, stub: ep_grpc.ExternalProcessorStub):
        self.queue: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self):
        while (m := await self.queue.get()) is not None:
            yield m

    def send(self, msg: ep.ProcessingRequest) -> None:
        self.queue.put_nowait(msg)

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def read(self, timeout: float = 10.0) -> ep.ProcessingResponse:
        async with asyncio.timeout(timeout):
            msg = await self.call.read()
        assert msg is not grpc.aio.EOF, "the picker ended the stream"
        return msg


async def exchange(stub: ep_grpc.ExternalProcessorStub, path: str, body: dict | bytes, chunk: int = 700,
                   extra_headers: dict[str, str] | None = None, subset: list[str] | None = None,
                   served: str | None = None, http: httpx.AsyncClient | None = None) -> Result:
    """One request through the picker and, when it picks, to the chosen endpoint (``served``
    overrides which address the "proxy" uses and reports; ``"use-fallback"``: the first fallback, as
    after a retry)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    s = Stream(stub)
    res = Result()
    hdrs = {":method": "POST", ":path": path, ":authority": "gateway.example", ":scheme": "http",
            "content-type": "application/json", **(extra_headers or {})}
    first = ep.ProcessingRequest(request_headers=headers(hdrs))
    if subset is not None:
        first.metadata_context.CopyFrom(metadata(P.SUBSET_NAMESPACE, P.SUBSET, subset))
    s.send(first)
    parts = [raw[i:i + chunk] for i in range(0, len(raw), chunk)] or [b""]
    for i, part in enumerate(parts):  # FULL_DUPLEX: every chunk goes without waiting for an answer
        s.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=part, end_of_stream=i == len(parts) - 1)))
    head = await s.read()
    if head.HasField("immediate_response"):
        res.immediate = head.immediate_response
        s.close()
        return res
    assert head.HasField("request_headers"), head
    common = head.request_headers.response
    assert common.clear_route_cache
    res.set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    res.endpoints = res.set_headers[P.DESTINATION].split(",")
    res.lb_metadata = head.dynamic_metadata.fields[P.LB_NAMESPACE].struct_value.fields[P.DESTINATION].string_value
    while True:  # the body comes back in streamed chunks
        b = await s.read()
        sr = b.request_body.response.body_mutation.streamed_response
        res.upstream_body += sr.body
        if sr.end_of_stream:
            break
    target = res.endpoints[1] if served == "use-fallback" else served or res.endpoints[0]
    own = http is None
    http = http or httpx.AsyncClient(timeout=30)
    try:
        async with http.stream("POST", f"http://{target}{path}", content=res.upstream_body,
                               headers={"content-type": "application/json"}) as r:
            res.status = r.status_code
            rh = ep.ProcessingRequest(response_headers=headers({":status": str(r.status_code),
                                                                "content-type": r.headers.get("content-type", "")}))
            rh.metadata_context.CopyFrom(metadata(P.LB_NAMESPACE, P.SERVED, target))
            s.send(rh)
            ack = await s.read()
            res.response_headers = {h.header.key: h.header.raw_value.decode()
                                    for h in ack.response_headers.response.header_mutation.set_headers}
            async for piece in r.aiter_raw():
                s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=piece, end_of_stream=False)))
                echo = await s.read()
                res.response += echo.response_body.response.body_mutation.streamed_response.body
        s.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)))
        last = await s.read()
        assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    finally:
        s.close()
        if own:
            await http.aclose()
    return res
