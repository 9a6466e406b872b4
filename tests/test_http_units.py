"""The gateway's protocols and breaker without sockets: a fake transport records what the server
writes and whether it reads; a fake upstream connection feeds the client parser bytes."""

import asyncio
import re

import pytest

from kvroute.gateway import deadlines
from kvroute.gateway.breaker import CircuitBreaker, CircuitState
from kvroute.gateway.http import HTTPLimits, HTTPServer, _Connection
from kvroute.gateway.upstream import UpstreamPool, UpstreamProtocolError, UpstreamResponse, _Conn, _StaleConnection


class FakeTransport(asyncio.Transport):
    """Records writes, pause/resume of reading and close."""

    def __init__(self):
        super().__init__()
        self.out = bytearray()
        self.reading = True
        self.closed = False

    def write(self, data):
        self.out += data

    def writelines(self, parts):
        for p in parts:
            self.out += p

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return default


# -- breaker ----------------------------------------------------------------------------------------

def test_breaker_opens_after_consecutive_failures_only():
    b = CircuitBreaker(failures=3, cooldown_s=5)
    for _ in range(2):
        b.failure(0)
    b.success()  # resets the streak
    b.failure(0)
    b.failure(0)
    assert b.state is CircuitState.CLOSED and b.allows
    b.failure(1)
    assert b.state is CircuitState.OPEN and not b.allows


def test_breaker_half_open_admits_one_trial_and_needs_n_successes():
    b = CircuitBreaker(failures=1, cooldown_s=5, successes=2)
    b.failure(10)
    b.tick(14.9)
    assert b.state is CircuitState.OPEN
    b.tick(15)
    assert b.state is CircuitState.HALF_OPEN and b.allows
    b.dispatched()
    assert not b.allows  # the single trial is out
    b.success()
    assert b.state is CircuitState.HALF_OPEN and b.allows
    b.dispatched()
    b.neutral()  # the client left: no verdict, the slot frees
    assert b.state is CircuitState.HALF_OPEN and b.allows
    b.dispatched()
    b.success()
    assert b.state is CircuitState.CLOSED and b.allows


def test_breaker_failed_trial_reopens_for_a_full_cooldown():
    b = CircuitBreaker(failures=1, cooldown_s=5)
    b.failure(0)
    b.tick(5)
    b.dispatched()
    b.failure(7)
    assert b.state is CircuitState.OPEN
    b.tick(11.9)
    assert b.state is CircuitState.OPEN
    b.tick(12)
    assert b.state is CircuitState.HALF_OPEN


# -- server protocol ----------------------------------------------------------------------------------

def _server_conn(handler, **limits):
    loop = asyncio.get_running_loop()
    server = HTTPServer(handler, HTTPLimits(**limits))
    server.now = loop.time()
    conn = _Connection(server)
    transport = FakeTransport()
    conn.connection_made(transport)
    return server, conn, transport


REQ = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"


def test_reading_pauses_while_a_complete_request_waits_behind_a_running_one():
    async def run():
        gate = asyncio.Event()
        seen = []

        async def handler(req, resp):
            seen.append(req.body)
            await gate.wait()
            resp.send(200, b"ok")
        server, conn, t = _server_conn(handler)
        conn.data_received(REQ * 10)  # ten pipelined requests in one read
        await asyncio.sleep(0)
        assert seen == [b"hello"] and not t.reading and len(conn.pending) == 9
        gate.set()
        for _ in range(50):
            await asyncio.sleep(0)
        assert seen == [b"hello"] * 10 and t.out.count(b"HTTP/1.1 200") == 10 and t.reading
    asyncio.run(run())


def test_a_run_of_pipelined_answers_stops_when_a_write_finds_the_connection_reset():
    """Answers that never wait (a handler without an await, as /metrics) run in a row without a turn of
    the loop, so connection_lost cannot arrive between them: the transport closing (as uvloop's does
    when a write fails) ends the run, instead of answering the rest of a read's requests for nobody."""
    async def run():
        seen = []

        def handler(req, resp):
            seen.append(req.body)
            resp.send(200, b"ok")
            if len(seen) == 3:
                t.closed = True  # this write found the client gone
        server, conn, t = _server_conn(handler)
        conn.data_received(REQ * 10)  # ten pipelined requests in one read
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(seen) == 3, len(seen)
        conn.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
        assert not conn.pending
    asyncio.run(run())


def test_a_bad_request_is_answered_after_the_good_ones_before_it():
    async def run():
        async def handler(req, resp):
            await asyncio.sleep(0.01)
            resp.send(200, req.body)
        server, conn, t = _server_conn(handler)
        conn.data_received(REQ + REQ + b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n")
        await asyncio.sleep(0.1)
        assert re.findall(rb"HTTP/1.1 (\d{3})", t.out) == [b"200", b"200", b"400"]
        assert t.closed
    asyncio.run(run())


def test_head_counted_by_fields_regardless_of_read_boundaries():
    async def run():
        async def handler(req, resp):
            resp.send(200, b"")
        for piece in (1, 7, 4096, 1 << 20):  # however the bytes are split, the limit is the same
            server, conn, t = _server_conn(handler, max_head_bytes=2048)
            raw = b"GET / HTTP/1.1\r\nHost: a\r\nX-A: " + b"a" * 2100 + b"\r\n\r\n"
            for i in range(0, len(raw), piece):
                conn.data_received(raw[i:i + piece])
                if t.closed:
                    break
            assert t.out.startswith(b"HTTP/1.1 431") and t.closed
    asyncio.run(run())


def test_deadlines_by_phase():
    async def run():
        async def handler(req, resp):
            resp.send(200, b"")
        server, conn, t = _server_conn(handler, header_timeout_s=1, body_timeout_s=2, keepalive_timeout_s=3)
        now = server.now
        assert conn.deadline == pytest.approx(now + 1)  # a new connection: the head deadline, not keep-alive's
        server.now += 0.5
        conn.data_received(b"GET / HTTP/1.1\r\nHost: a\r\n")
        assert conn.deadline == pytest.approx(now + 1)  # still counted from the accept
        conn.data_received(b"\r\n")
        for _ in range(5):
            await asyncio.sleep(0)
        assert t.out.startswith(b"HTTP/1.1 200") and conn.deadline == pytest.approx(now + 0.5 + 3)  # idle
        conn.data_received(b"POST / HTTP/1.1\r\nHost: a\r\n")
        assert conn.deadline == pytest.approx(now + 0.5 + 1)  # the next head
        conn.data_received(b"Content-Length: 3\r\n\r\na")
        assert conn.deadline == pytest.approx(now + 0.5 + 2)  # body
        conn.expire()
        assert t.out.count(b"HTTP/1.1 408") == 1 and t.closed
        assert server.rejections.counts == {(408, "body_timeout"): 1}
    asyncio.run(run())


# -- upstream client protocol ------------------------------------------------------------------------

def _client_conn(reused=False):
    conn = _Conn(UpstreamPool("http://127.0.0.1:1"))
    conn.connection_made(FakeTransport())
    head = conn.begin(reused)
    return conn, head


def test_upstream_close_delimited_body_ends_at_eof_and_is_not_reused():
    async def run():
        conn, head = _client_conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\n\r\nabc")
        status, _ = await head
        resp = UpstreamResponse(conn, status, [], 1.0)
        conn.data_received(b"def")
        conn.connection_lost(None)
        assert await resp.read() == b"abcdef" and not conn.keep_alive
    asyncio.run(run())


def test_upstream_interim_responses_are_skipped():
    async def run():
        conn, head = _client_conn()
        conn.data_received(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
        status, _ = await head
        assert status == 201 and await UpstreamResponse(conn, status, [], 1.0).read() == b"ok"
    asyncio.run(run())


def test_upstream_truncated_body_is_an_error_not_a_short_answer():
    async def run():
        conn, head = _client_conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        resp = UpstreamResponse(conn, (await head)[0], [], 1.0)
        conn.connection_lost(None)
        with pytest.raises(UpstreamProtocolError, match="before the body ended"):
            await resp.read()
    asyncio.run(run())


def test_upstream_eof_on_a_reused_connection_is_stale_not_a_failure():
    async def run():
        conn, head = _client_conn(reused=True)
        conn.connection_lost(None)
        with pytest.raises(_StaleConnection):
            await head
        conn, head = _client_conn(reused=True)
        conn.data_received(b"HTTP/1.1 2")  # a byte arrived: the engine died mid-answer
        conn.connection_lost(None)
        with pytest.raises(UpstreamProtocolError) as info:
            await head
        assert not isinstance(info.value, _StaleConnection)
    asyncio.run(run())


def test_upstream_extra_response_bytes_poison_the_connection():
    async def run():
        conn, head = _client_conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\naHTTP/1.1 200 OK\r\n")
        resp = UpstreamResponse(conn, (await head)[0], [], 1.0)
        assert await resp.read() == b"a"
        assert conn.transport.closed and not conn.keep_alive
    asyncio.run(run())


def test_upstream_waits_share_one_coarse_clock_that_never_fires_early():
    """An idle wait times out on the loop's shared clock (no timer per wait), not before its
    time and at most a tick late; the clock's timer stops once nothing waits."""
    from kvroute.gateway import upstream

    async def run():
        loop = asyncio.get_running_loop()
        conn, head = _client_conn()
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        resp = UpstreamResponse(conn, (await head)[0], [], 0.2)
        assert await resp.next_chunk() == b"abc"
        t0 = loop.time()
        with pytest.raises(upstream.UpstreamTimeout, match="upstream sent nothing for 0.2 s"):
            await resp.next_chunk()
        waited = loop.time() - t0
        assert 0.2 <= waited < 0.2 + 2 * deadlines.TICK
        clock = upstream._deadlines(loop)
        assert not clock.waits
        await asyncio.sleep(deadlines.TICK * 1.5)
        assert clock.handle is None  # idle: no tick runs
        # a wait that ends in time leaves nothing behind
        conn2, head2 = _client_conn()
        conn2.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        resp2 = UpstreamResponse(conn2, (await head2)[0], [], 5.0)
        loop.call_later(0.01, conn2.data_received, b"ok")
        assert await resp2.read() == b"ok" and not clock.waits
    asyncio.run(run())
