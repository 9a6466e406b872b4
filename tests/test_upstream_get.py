"""The probes' GET over the lean upstream client (gateway/upstream_get.py), against raw HTTP servers
on 127.0.0.1: what the probes had from aiohttp — redirects, one total timeout, error kinds,
charset decoding, a stale kept-alive connection retried — and a gateway probing through it."""

import asyncio
import time

import pytest

from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.gateway.upstream import UpstreamConnectError, UpstreamPool, UpstreamProtocolError
from kvroute.gateway.upstream_get import MAX_REDIRECTS, get
from kvroute.ports import free_ports
from kvroute.replicas import ReplicaConfig

METRICS = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc 0.25\n"


def answer(status: int, body: bytes = b"", fields: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%b\r\n%b" % (status, len(body), fields, body)


class Server:
    """Answers each request head by ``route(target) -> bytes | None`` (None: hang); records the
    targets and counts connections. ``close_after``: drop each connection after that many answers."""

    def __init__(self, route, close_after: int = 0):
        self.route, self.close_after = route, close_after
        self.targets: list[bytes] = []
        self.heads: list[bytes] = []
        self.connections = 0
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.stop()

    def stop(self):
        """Stop listening and drop every open connection (the engine is gone)."""
        self.server.close()
        for w in self.writers:
            w.close()

    async def _serve(self, r, w):
        self.connections += 1
        self.writers.add(w)
        answered = 0
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                target = head.split(b" ")[1]
                self.targets.append(target)
                out = self.route(target)
                if out is None:
                    await asyncio.sleep(3600)
                w.write(out)
                await w.drain()
                answered += 1
                if self.close_after and answered >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        w.close()


def test_same_origin_redirects_are_followed_on_one_connection_and_brackets_encoded():
    port = {}

    def route(t):
        if t == b"/metrics":
            return answer(307, fields=b"Location: /metrics/\r\n")
        if t == b"/metrics/?name%5B%5D=vllm:x":
            return answer(200, METRICS, b"Content-Type: text/plain; charset=utf-8\r\n")
        if t == b"/abs":
            return answer(301, fields=b"Location: http://127.0.0.1:%d/metrics/?name%%5B%%5D=vllm:x\r\n" % port[0])
        return answer(404)

    async def run():
        async with Server(route) as srv:
            port[0] = srv.port
            pool = UpstreamPool(f"http://127.0.0.1:{srv.port}")
            got = await get(pool, "/metrics", 1.0)
            assert (got.status, got.text()) == (404, "")  # followed to /metrics/, which has no page here
            got = await get(pool, "/metrics/?name[]=vllm:x", 1.0)
            assert (got.status, got.body) == (200, METRICS)
            got = await get(pool, "/abs", 1.0)  # an absolute Location on the same origin
            assert (got.status, got.body) == (200, METRICS)
            assert srv.connections == 1  # kept alive across answers and redirects
            assert all(b"\r\nAccept-Encoding: identity\r\n" in h for h in srv.heads)
            assert srv.targets[:2] == [b"/metrics", b"/metrics/"]
            pool.close()
    asyncio.run(run())


def test_redirects_elsewhere_or_without_end_are_not_followed():
    async def run():
        ports = free_ports(1)
        async with Server(lambda t: answer(302, fields=b"Location: http://127.0.0.1:%d/m\r\n" % ports[0])) as srv:
            pool = UpstreamPool(f"http://127.0.0.1:{srv.port}")
            assert (await get(pool, "/m", 1.0)).status == 302  # another port: another origin
            assert len(srv.targets) == 1
        async with Server(lambda t: answer(307, fields=b"Location: " + t + b"\r\n")) as loop_srv:
            pool = UpstreamPool(f"http://127.0.0.1:{loop_srv.port}")
            assert (await get(pool, "/loop", 1.0)).status == 307
            assert len(loop_srv.targets) == MAX_REDIRECTS + 1  # aiohttp's limit of 10 redirects
    asyncio.run(run())


def test_one_total_timeout_over_head_and_body():
    trickle = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"

    async def run():
        async with Server(lambda t: None) as hung:  # never answers
            pool = UpstreamPool(f"http://127.0.0.1:{hung.port}")
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await get(pool, "/metrics", 0.3)
            assert 0.3 <= time.monotonic() - t0 < 2.0

        async def slow(r, w):  # a head, then a byte every 0.1 s: each within an idle limit, not in total
            await r.readuntil(b"\r\n\r\n")
            w.write(trickle)
            for _ in range(100):
                await asyncio.sleep(0.1)
                w.write(b"x")
        server = await asyncio.start_server(slow, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await get(pool, "/metrics", 0.5)
        assert 0.5 <= time.monotonic() - t0 < 2.0
        assert not pool._idle  # the abandoned connection is closed, not pooled
        server.close()
    asyncio.run(run())


def test_error_kinds_and_a_stale_connection_retried():
    async def run():
        port = free_ports(1)[0]
        with pytest.raises(UpstreamConnectError):  # nothing listens: what ejection aborts exchanges on
            await get(UpstreamPool(f"http://127.0.0.1:{port}"), "/metrics", 1.0)
        async with Server(lambda t: b"NOT HTTP\r\n\r\n") as bad:
            with pytest.raises(UpstreamProtocolError):
                await get(UpstreamPool(f"http://127.0.0.1:{bad.port}"), "/metrics", 1.0)
        async with Server(lambda t: answer(200, b"ok"), close_after=1) as closing:
            pool = UpstreamPool(f"http://127.0.0.1:{closing.port}")
            assert (await get(pool, "/metrics", 1.0)).body == b"ok"
            await asyncio.sleep(0.05)  # the server's close reaches the pooled connection... or not yet
            assert (await get(pool, "/metrics", 1.0)).body == b"ok"  # either way: answered on a new one
            assert closing.connections == 2
    asyncio.run(run())


def test_text_decoding_follows_the_charset_like_aiohttp():
    bodies = {b"/latin": ("é".encode("latin-1"), b"Content-Type: text/plain; charset=ISO-8859-1\r\n"),
              b"/unknown": ("é".encode(), b"Content-Type: text/plain; charset=no-such\r\n"),
              b"/bad": (b"\xff", b"Content-Type: text/plain\r\n")}

    async def run():
        async with Server(lambda t: answer(200, bodies[t][0], bodies[t][1])) as srv:
            pool = UpstreamPool(f"http://127.0.0.1:{srv.port}")
            assert (await get(pool, "/latin", 1.0)).text() == "é"
            assert (await get(pool, "/unknown", 1.0)).text() == "é"
            with pytest.raises(UnicodeDecodeError):
                (await get(pool, "/bad", 1.0)).text()
    asyncio.run(run())


def test_gateway_probes_through_a_redirect_and_ejects_a_replica_that_stops_listening():
    """vLLM's /metrics mount may answer 307 (to /metrics/): the probe follows it and reads the load;
    once nothing listens, the replica is ejected after its failed probes."""
    def route(t):
        if t.startswith(b"/metrics/"):  # the filter (name[]=) refused: the whole page is read next
            return answer(404)
        if t == b"/metrics":
            return answer(307, fields=b"Location: /metrics/page\r\n")
        return answer(200, b'{"data": [{"id": "m"}]}') if t == b"/v1/models" else answer(404)

    async def run():
        async with Server(lambda t: answer(200, METRICS) if t == b"/metrics/page" else route(t)) as srv:
            config = GatewayConfig(host="127.0.0.1", port=0, policy="round_robin",
                                   probe={"interval_s": 0.05, "timeout_s": 0.5, "unhealthy_after": 2},
                                   replicas=[ReplicaConfig(url=f"http://127.0.0.1:{srv.port}", id="r0",
                                                           engine="vllm")])
            gw = Gateway(config)
            await gw.start()
            try:
                up = gw.runtime.upstreams["r0"]
                assert up.filtered is False and up.reading is not None
                assert (up.reading.running, up.reading.waiting, up.reading.kv_usage) == (3, 2, 0.25)
                assert up.models == frozenset({"m"}) and up.endpoint.healthy
                srv.stop()
                for _ in range(100):  # pooled connections are dropped with the server; new ones refused
                    if not up.endpoint.healthy:
                        break
                    await asyncio.sleep(0.05)
                assert not up.endpoint.healthy
            finally:
                await gw.stop()
    asyncio.run(run())
