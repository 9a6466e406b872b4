"""A replica is not routable until its first probe answers (gateway/prober.py, Runtime._route):
right after the gateway starts, ``/health`` counts only the replicas that answered, no request goes
to an engine that is not listening yet (to be retried elsewhere), a request that only a starting
replica could take waits for its first answer, and once that replica has failed
``probe.unhealthy_after`` probes such a request gets a clear 503 at once. Real gateways and
emulated engines on 127.0.0.1; an engine that starts late listens on a port held bound (not
listening) from the start, so no other process can take it meanwhile."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from kvroute.emulator.server import Faults, start_emulator
from kvroute.gateway.admin import replica_view
from kvroute.gateway.config import GatewayConfig
from kvroute.replicas import ReplicaConfig
from tests.gateway_harness import BackgroundGateway

BODY = {"model": "emulated", "prompt": "a replica that never answered", "max_tokens": 3}
PROFILE = "h100-llama3.2-3b"


class Engines:
    """Emulated engines on an event loop of their own thread (stopped by :meth:`close`)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: list = []

    def start(self, port: int = 0) -> int:
        """An emulated vLLM listening on ``port`` (0: any free one); its port."""
        coro = start_emulator("127.0.0.1", port, PROFILE, "vllm", Faults())
        runner, _, bound = asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)
        self.runners.append(runner)
        return bound

    def close(self) -> None:
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def engines():
    e = Engines()
    yield e
    e.close()


@pytest.fixture
def reserved():
    """A port bound but not listening: a connection there is refused, and only a socket that also sets
    SO_REUSEADDR (the emulator's aiohttp site does) can bind it while this one holds it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def _gateway(ports: list[int], **probe) -> BackgroundGateway:
    return BackgroundGateway(GatewayConfig(
        host="127.0.0.1", port=0, policy="round_robin", probe={"interval_s": 0.05, **probe},
        replicas=[ReplicaConfig(url=f"http://127.0.0.1:{p}", id=f"r{i}", engine="vllm") for i, p in enumerate(ports)]))


async def _views(gw: BackgroundGateway) -> list[dict]:
    return [replica_view(gw.rt, name) for name in gw.rt.upstreams]


def _retries(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvroute_retries_total"))


def test_a_replica_not_listening_at_start_is_not_healthy_and_gets_no_request(engines, reserved):
    port = engines.start()
    gw = _gateway([port, reserved], interval_s=5.0)  # after the start-up round, no probe for 5 s
    try:
        health = httpx.get(f"{gw.url}/health").json()
        assert (health["healthy"], health["starting"], health["replicas"]) == (1, 1, 2), health
        views = gw.call(_views(gw))  # what GET /admin/replicas shows
        assert [(v["healthy"], v["answered"]) for v in views] == [(True, True), (False, False)], views
        served = [httpx.post(f"{gw.url}/v1/completions", json=BODY, timeout=30) for _ in range(6)]
        assert [(r.status_code, r.headers["x-kvroute-replica"]) for r in served] == [(200, "r0")] * 6
        assert _retries(gw.url) == 0  # round robin had nothing to send to r1: no attempt failed there
    finally:
        gw.close()


def test_a_request_only_a_starting_replica_can_take_waits_for_its_first_answer(engines, reserved):
    """The static single-replica case: its engine listens 0.5 s after the gateway started; a request
    sent before that waits (in the LB queue) and is served there once a probe answers, not failed."""
    gw = _gateway([reserved], unhealthy_after=200)  # 10 s of probes before it would count as down
    try:
        assert httpx.get(f"{gw.url}/health").json()["healthy"] == 0
        got: list = []
        sent = time.monotonic()
        client = threading.Thread(target=lambda: got.append(
            (httpx.post(f"{gw.url}/v1/completions", json=BODY, timeout=30), time.monotonic() - sent)))
        client.start()
        time.sleep(0.5)
        assert not got  # still waiting
        engines.start(reserved)
        client.join(30)
        (r, waited), = got
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "r0", r.text
        assert waited >= 0.5 and _retries(gw.url) == 0
        assert httpx.get(f"{gw.url}/health").json()["healthy"] == 1
    finally:
        gw.close()


def test_a_replica_that_never_answers_turns_its_waiting_requests_into_a_clear_503(reserved):
    gw = _gateway([reserved], unhealthy_after=3)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{gw.url}/v1/completions", json=BODY, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "all-filtered" and "unhealthy" in error["message"], error
        # three failed probes at 50 ms apart (each refused at once): well under a second, not queue.max_wait_s
        assert took < 5.0, took
        health = httpx.get(f"{gw.url}/health")
        assert health.status_code == 503 and (health.json()["healthy"], health.json()["starting"]) == (0, 0)
    finally:
        gw.close()
