"""Scripted upstream engines for fault tests: raw TCP servers on 127.0.0.1 whose answer to each
completion request is whatever bytes the test scripts (malformed, truncated, hung, closing), and
a gateway in front of them, all on one background event loop so tests can use blocking clients.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable

from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.replicas import ReplicaConfig

METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
OK_JSON = (b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"stop"}],'
           b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}')
SSE_EVENT = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"t"}]}\n\n'


def http_response(status: int = 200, body: bytes = OK_JSON, extra: bytes = b"") -> bytes:
    """A well-formed response with Content-Length."""
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b" % (
        status, len(body), extra, body)


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
SSE_OK = SSE_HEAD + chunk(SSE_EVENT * 3) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"

# A script answers one request: it gets the request's head and body, writes to the stream, and
# returns True to keep the connection open for the next request.
Script = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[bool]]


def replies(data: bytes, keep_open: bool = True) -> Script:
    """A script that writes fixed bytes."""
    async def script(head: bytes, body: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(data)
        await w.drain()
        return keep_open
    return script


class ScriptedUpstream:
    """One fake engine: answers GET /metrics itself (so probes pass) and every POST by ``script``.
    Lists ``models`` at GET /v1/models. Records the heads and bodies it received and counts requests and connections."""

    def __init__(self, script: Script):
        self.script = script
        self.metrics: bytes | None = METRICS  # what GET /metrics answers (None: the connection drops)
        self.models = ["m"]  # what GET /v1/models lists
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.connections = 0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await r.readexactly(length) if length else b""
                if head.startswith(b"GET /v1/models"):
                    listing = json.dumps({"object": "list", "data": [{"id": m, "object": "model"}
                                                                     for m in self.models]}).encode()
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(listing), listing))
                    await w.drain()
                    continue
                if head.startswith(b"GET /metrics"):
                    if self.metrics is None:  # a test took the engine away: drop the connection
                        break
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(self.metrics), self.metrics))
                    await w.drain()
                    continue
                self.heads.append(head)
                self.bodies.append(body)
                if not await self.script(head, body, w):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass
        w.close()

    @property
    def requests(self) -> int:
        return len(self.heads)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
            task.cancel()  # scripts still sleeping (hung engines) end with the loop


class FaultyDeployment:
    """A gateway in front of scripted upstreams, on a background loop."""

    def __init__(self, scripts: list[Script], engine: str = "vllm", metrics: bytes = METRICS, **overrides):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.upstreams = [ScriptedUpstream(s) for s in scripts]
        for u in self.upstreams:
            u.metrics = metrics
        self.engine = engine
        self.gateway = self.call(self._start(overrides))
        self.url = f"http://127.0.0.1:{self.gateway.port}"
        self.runtime = self.gateway.runtime

    async def _start(self, overrides: dict) -> Gateway:
        for u in self.upstreams:
            await u.start()
        settings = {"policy": "round_robin", "probe": {"interval_s": 0.05, "timeout_s": 0.5},
                    "timeouts": {"connect_s": 1.0, "first_byte_s": 2.0, "idle_s": 2.0, "non_stream_s": 2.0,
                                 "non_stream_total_s": 4.0},
                    "retry": {"backoff_s": 0.0}, **overrides}
        config = GatewayConfig(host="127.0.0.1", port=0,
                               replicas=[ReplicaConfig(url=f"http://127.0.0.1:{u.port}", id=f"r{i}", engine=self.engine)
                                         for i, u in enumerate(self.upstreams)], **settings)
        gw = Gateway(config)
        await gw.start()
        return gw

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def settle(self, timeout: float = 5.0) -> tuple[int, int, int]:
        """Wait until nothing is in flight or queued; returns (in-flight, queue, tickets)."""
        async def wait():
            rt = self.runtime
            deadline = self.loop.time() + timeout
            while self.loop.time() < deadline:
                if not rt.router.tickets and not rt.queue and all(e.inflight == 0 for e in rt.router.endpoints):
                    break
                await asyncio.sleep(0.02)
            return sum(e.inflight for e in rt.router.endpoints), len(rt.queue), len(rt.router.tickets)
        return self.call(wait(), timeout + 5)

    def close(self) -> None:
        async def stop():
            await self.gateway.stop()
            for u in self.upstreams:
                await u.stop()
        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
