"""The TCP delay proxy: a 40 ms RTT link adds about 40 ms to a request, bytes keep their order,
and a stream of chunks is delayed, not piled up behind its own delay."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import aiohttp
from aiohttp import web

from kvroute.live.delay import DelayProxy


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _http_app() -> tuple[web.AppRunner, int]:
    async def ping(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def ticks(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(20):
            await resp.write(f"{time.perf_counter():.6f}\n".encode())
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/ping", ping)
    app.router.add_get("/ticks", ticks)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def _median_request_s(session: aiohttp.ClientSession, url: str, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.get(url) as r:
            assert r.status == 200
            await r.read()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_a_40ms_rtt_link_adds_about_40ms_to_a_request():
    asyncio.run(asyncio.wait_for(_test_a_40ms_rtt_link_adds_about_40ms_to_a_request(), 15))


async def _test_a_40ms_rtt_link_adds_about_40ms_to_a_request():
    runner, port = await _http_app()
    proxy = DelayProxy(0.020, ("127.0.0.1", port))
    await proxy.start()
    try:
        async with aiohttp.ClientSession() as s:  # keep-alive: the handshake is not in the numbers
            direct = await _median_request_s(s, f"http://127.0.0.1:{port}/ping")
            via = await _median_request_s(s, f"{proxy.url}/ping")
        added = via - direct
        assert 0.035 <= added <= 0.090, f"added {added * 1000:.1f} ms, expected about 40"
        assert proxy.stats.connections >= 1 and proxy.stats.bytes_back > 0
    finally:
        await proxy.stop()
        await runner.cleanup()


def test_bytes_keep_their_order_both_ways():
    asyncio.run(asyncio.wait_for(_test_bytes_keep_their_order_both_ways(), 15))


async def _test_bytes_keep_their_order_both_ways():
    server, port = await _echo_server()
    proxy = DelayProxy(0.005, ("127.0.0.1", port))
    await proxy.start()
    try:
        payload = os.urandom(1 << 20)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)

        async def send() -> None:
            for i in range(0, len(payload), 7919):  # odd-sized writes
                writer.write(payload[i:i + 7919])
                await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        got = await asyncio.wait_for(reader.read(-1), 10)
        await sender
        writer.close()
        assert got == payload
    finally:
        await proxy.stop()
        server.close()


def test_a_stream_is_delayed_not_piled_up():
    asyncio.run(asyncio.wait_for(_test_a_stream_is_delayed_not_piled_up(), 15))


async def _test_a_stream_is_delayed_not_piled_up():
    """Chunks written every 10 ms each arrive about one delay after they were sent: the delay
    of one chunk never adds to the next one's."""
    runner, port = await _http_app()
    proxy = DelayProxy(0.050, ("127.0.0.1", port))
    await proxy.start()
    try:
        lateness = []
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}/ticks") as r:
            async for line in r.content:
                lateness.append(time.perf_counter() - float(line))
        assert len(lateness) == 20
        assert min(lateness) >= 0.045
        assert max(lateness) <= 0.050 + 0.060, f"worst chunk {max(lateness) * 1000:.0f} ms late"
        assert lateness[-1] - lateness[0] < 0.040  # no growth along the stream
    finally:
        await proxy.stop()
        await runner.cleanup()


def test_a_link_to_a_dead_target_closes_the_client_connection():
    asyncio.run(asyncio.wait_for(_test_a_link_to_a_dead_target_closes_the_client_connection(), 15))


async def _test_a_link_to_a_dead_target_closes_the_client_connection():
    proxy = DelayProxy(0.001, ("127.0.0.1", 9))  # discard port: nothing listens
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
    finally:
        await proxy.stop()
