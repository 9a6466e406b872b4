"""Run an emulated deployment on a background event loop, so tests can use blocking clients
(the official openai SDK) against real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import aiohttp
import httpx

from kvroute.live.embedded import start_deployment


class LiveDeployment:
    def __init__(self, replicas: int = 3, policy="skywalker", profile: str = "h100-llama3.2-3b", **overrides):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dep = self.call(start_deployment(replicas=replicas, policy=policy, port=0, profile=profile,
                                              **overrides))
        self.url = self.dep.url
        self.runtime = self.dep.gateway.runtime

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def emulator_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.dep.emulators[i][2]}"

    def replica_id(self, i: int) -> str:
        return f"emulated-{i}"

    def fault(self, i: int, **faults) -> None:
        async def post():
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{self.emulator_url(i)}/_fault", json=faults) as r:
                    assert r.status == 200, await r.text()
        self.call(post())

    def inflight(self) -> int:
        async def read():
            return sum(e.inflight for e in self.runtime.router.endpoints), len(self.runtime.queue), \
                len(self.runtime.router.tickets)
        return self.call(read())

    def settle(self, timeout: float = 5.0) -> tuple[int, int, int]:
        """Wait until no request is in flight or queued at the gateway; returns the counters."""
        async def wait():
            deadline = self.loop.time() + timeout
            while self.loop.time() < deadline:
                rt = self.runtime
                if not rt.router.tickets and not rt.queue and all(e.inflight == 0 for e in rt.router.endpoints):
                    break
                await asyncio.sleep(0.02)
            rt = self.runtime
            return sum(e.inflight for e in rt.router.endpoints), len(rt.queue), len(rt.router.tickets)
        return self.call(wait(), timeout + 5)

    def close(self) -> None:
        self.call(self.dep.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def wait_healthy(url: str, n: int, timeout: float = 10.0) -> int:
    """Poll a gateway's ``/health`` until it counts ``n`` healthy replicas (bounded); the last count.
    Its 200 says only that one replica is healthy: a gateway started beside its engines probes them
    before they listen and re-admits each after ``probe.healthy_after`` answered probes, so a test
    that needs every replica routable waits for this."""
    deadline = time.monotonic() + timeout
    while True:
        healthy = httpx.get(f"{url}/health", timeout=5).json()["healthy"]
        if healthy == n or time.monotonic() > deadline:
            return healthy
        time.sleep(0.05)


@contextlib.contextmanager
def settled(**kw) -> Iterator[LiveDeployment]:
    """A LiveDeployment (``kw`` as its arguments) that must end with nothing left in flight, queued
    or ticketed: checked once the block is done, after the deployment is closed."""
    dep = LiveDeployment(**kw)
    yield dep
    counters = dep.settle()
    dep.close()
    assert counters == (0, 0, 0), f"in-flight / queue / tickets not back to zero: {counters}"


class BackgroundGateway:
    """A kvroute gateway built from a GatewayConfig, serving on an event loop of its own thread."""

    def __init__(self, config) -> None:
        from kvroute.gateway.server import Gateway

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gw = Gateway(config)
        self.call(self.gw.start())
        self.rt = self.gw.runtime
        self.url = f"http://127.0.0.1:{self.gw.port}"

    def call(self, coro, timeout: float = 60):
        """Run ``coro`` on the gateway's loop; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stop the gateway and its loop."""
        self.call(self.gw.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
