"""Three `kvroute serve` processes behind a real HAProxy (health check on /readyz), sharing load
over a real nats-server, all on 127.0.0.1 and stopped by PID, driven with the openai SDK:
an instance SIGKILLed mid-run fails only its own in-flight requests, fast and with a clear error,
and every later request is served; NATS killed, the instances route on their own view and say
so (/health, log), and resync when it comes back."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from kvroute.fleet.deploy import RegionFleet
from kvroute.fleet.services import nats_server
from tests.fleet_harness import needs_haproxy, needs_nats

pytestmark = [needs_nats, needs_haproxy]

SYSTEM = {"role": "system", "content": "You tell long stories about caches and queues. " * 40}  # blocks to index
LONG = 300  # tokens: seconds of decoding on the emulated L4, so requests are in flight at the kill


async def _stream(client: openai.AsyncOpenAI, i: int, started: list[float]) -> tuple[str, float, str]:
    """One long streamed chat: ('ok' | 'failed', when it ended, the error text)."""
    try:
        stream = await client.chat.completions.create(
            model="emulated", messages=[SYSTEM, {"role": "user", "content": f"conversation {i}: tell me a story"}],
            max_tokens=LONG, stream=True)
        async for _chunk in stream:
            if len(started) <= i or not started[i]:
                started[i] = time.monotonic()
        return "ok", time.monotonic(), ""
    except (openai.APIError, httpx.HTTPError) as exc:  # a cut stream: the SDK's connection error, whose
        return "failed", time.monotonic(), f"{type(exc).__name__}: {exc} ({exc.__cause__!r})"  # cause says so


async def _whole(client: openai.AsyncOpenAI, i: int) -> tuple[str, float, str]:
    """One long non-streamed chat: its answer comes only when generation ends."""
    try:
        await client.chat.completions.create(
            model="emulated", messages=[{"role": "user", "content": f"whole answer {i}: a long story"}],
            max_tokens=LONG // 4)
        return "ok", time.monotonic(), ""
    except openai.APIStatusError as exc:
        return "failed", time.monotonic(), f"{exc.status_code} {exc.code}: {exc.message}"
    except openai.APIConnectionError as exc:
        return "failed", time.monotonic(), f"connection: {exc.__cause__!r}"


async def _scenario(folder) -> None:
    region = RegionFleet(folder, replicas=2, profile="l4-llama3.1-8b")  # ~25 ms a token: long streams
    try:
        await region.start_replicas()
        await region.start_front(3)
        client = openai.AsyncOpenAI(base_url=f"{region.url}/v1", api_key=region.client_key, max_retries=0,
                                    timeout=30)
        # -- one instance killed mid-run ------------------------------------------------------------
        n = 9
        started = [0.0] * n
        tasks = [asyncio.create_task(_stream(client, i, started)) for i in range(n)]
        deadline = time.monotonic() + 20
        while not all(started) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert all(started), "the long streams did not all start"
        whole = [asyncio.create_task(_whole(client, i)) for i in range(6)]  # waiting for their head
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        await region.kill_instance(1)
        results = await asyncio.gather(*tasks)
        failed = [r for r in results if r[0] == "failed"]
        assert 1 <= len(failed) < n, results  # leastconn put some on the killed instance, not all
        for _, ended, error in failed:
            assert ended - killed_at < 2.0, (ended - killed_at, error)  # fast, not a timeout
            assert "RemoteProtocolError" in error, error  # the stream was cut: said by the cause
        results = await asyncio.gather(*whole)
        failed = [r for r in results if r[0] == "failed"]
        assert len(failed) < len(results), results
        for _, ended, error in failed:  # no head yet: HAProxy's JSON error names the cause
            assert ended - killed_at < 2.0 and error.startswith("502 gateway_instance_lost"), error
        for i in range(12):  # every later request is served (HAProxy retries and health checks)
            r = await client.chat.completions.create(model="emulated", max_tokens=4,
                                                     messages=[{"role": "user", "content": f"after the kill {i}"}])
            assert r.choices[0].message.content is not None
        await asyncio.sleep(0.5)  # quiet: the last events delivered
        views = await region.fleet_views()  # each survivor built its index from the same engine events
        assert len(views) == 2 and sum(r["blocks"] for r in views[0]["event_index"].values()) > 0
        assert views[0]["event_index"] == views[1]["event_index"], [v["event_index"] for v in views]
        async with httpx.AsyncClient(timeout=5) as http:
            async def siblings(i: int) -> float:
                text = (await http.get(f"{region.instances[i].url}/metrics")).text
                return next(float(line.split()[-1]) for line in text.splitlines()
                            if line.startswith("kvroute_fleet_siblings "))
            for _ in range(100):  # the survivors forget the dead instance (fleet timeout_s: 3 s)
                if await siblings(0) == 1 and await siblings(2) == 1:
                    break
                await asyncio.sleep(0.1)
            assert await siblings(0) == 1 and await siblings(2) == 1
            # -- NATS killed: routing goes on, on each instance's own view, and they say so ----------------
            assert region.nats is not None
            port = region.nats.port
            region.nats.kill()
            for _ in range(50):
                states = [(await http.get(f"{region.instances[i].url}/health")).json().get("fleet") for i in (0, 2)]
                if states == ["local-view", "local-view"]:
                    break
                await asyncio.sleep(0.1)
            assert states == ["local-view", "local-view"]
            for i in range(6):
                r = await client.chat.completions.create(model="emulated", max_tokens=4,
                                                         messages=[{"role": "user", "content": f"no nats {i}"}])
                assert r.choices[0].message.content is not None
            assert "routing on this instance's own view" in region.instance_log(0)
            region.nats = nats_server(folder, port)  # back on the same address
            await asyncio.to_thread(region.nats.start)
            for _ in range(100):
                states = [(await http.get(f"{region.instances[i].url}/health")).json().get("fleet") for i in (0, 2)]
                if states == ["synced", "synced"] and await siblings(0) == 1:
                    break
                await asyncio.sleep(0.1)
            assert states == ["synced", "synced"] and await siblings(0) == 1
            assert "reconnected to NATS" in region.instance_log(2)
    finally:
        await region.stop()
    assert all(not c.alive for c in region.procs.children.values())


def test_instance_kill_and_nats_kill_behind_haproxy(tmp_path):
    asyncio.run(asyncio.wait_for(_scenario(tmp_path), 150))


@pytest.mark.parametrize("status", [502, 503])
def test_front_error_pages_are_openai_errors(tmp_path, status):
    from kvroute.fleet.services import ERRORS, haproxy_config

    haproxy_config(tmp_path, 1, [("gw-0", 2)])
    raw = (tmp_path / f"haproxy-{status}.http").read_bytes()
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(f"HTTP/1.1 {status}".encode()) and f"Content-Length: {len(body)}".encode() in head
    assert ERRORS[status][2].encode() in body
