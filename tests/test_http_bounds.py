"""Issue 24: each cheap, unauthenticated attack on the gateway, reproduced over real sockets (the
attacks of ``kvroute bench hostile``, from 127.0.0.2) against a gateway in its own process, with
the bound measured from that process: resident memory and CPU time from /proc, new clients
probed from 127.0.0.1 meanwhile. The asserted bounds leave room for a loaded 2-core machine;
the exact targets (RSS +64 MB, CPU 1 s, probe p99 50 ms) are the benchmark's."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from functools import partial

import httpx
import pytest

from kvroute.bench import attacks, hostile
from kvroute.bench.gateway import UPSTREAM, _proc_stats, _stop
from kvroute.ports import free_ports, wait_for_port

RSS_MB = 64  # the bound; memory is not timing: no extra margin needed
CPU_S = 3.0  # the benchmark's target is 1 s; a shared 2-core machine can triple CPU time per byte


@pytest.fixture(scope="module")
def upstreams():
    ports = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-c", UPSTREAM, "0", *map(str, ports)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for p in ports:
            wait_for_port(p)
        yield ports
    finally:
        _stop(proc)


class GatewayProc:
    """``kvroute serve`` in its own process, its log kept in a file."""

    def __init__(self, tmp_path, upstreams: list[int], http: dict):
        self.port = free_ports(1)[0]
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(json.dumps({"port": self.port, "policy": "round_robin", "http": http,
                                   "replicas": [{"url": f"http://127.0.0.1:{p}", "engine": "vllm"}
                                                for p in upstreams]}))
        self.log = tmp_path / "gw.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(cfg),
                                          "--log-level", "WARNING"], stderr=f)
        wait_for_port(self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while httpx.get(f"{self.url}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)  # the upstreams probed healthy

    def measure(self, run, bound_on: str = "peak") -> dict:
        return hostile.measure(self.proc.pid, self.port, "", spec=hostile.AttackSpec(run, bound_on))

    def rejected(self) -> dict[tuple[str, str], float]:
        text = httpx.get(f"{self.url}/metrics").text
        found = re.findall(r'kvroute_http_rejected_total\{reason="([^"]+)",status="(\d+)"\} (\S+)', text)
        return {(status, reason): float(n) for reason, status, n in found}

    def stop(self) -> None:
        _stop(self.proc)


@pytest.fixture
def gateway(tmp_path, upstreams):
    started: list[GatewayProc] = []

    def start(**http) -> GatewayProc:
        gw = GatewayProc(tmp_path, upstreams, http)
        started.append(gw)
        return gw
    yield start
    for gw in started:
        gw.stop()
        log = gw.log.read_text()
        assert "Traceback" not in log and '"level": "ERROR"' not in log, log[-3000:]


def test_aborted_bodies_are_freed_at_once(gateway):
    """10 clients × 16 MiB bodies short of their last byte, three rounds (two answered 408 by the
    body deadline, one aborted by the client): the memory comes back without the cyclic GC."""
    gw = gateway(body_timeout_s=2.0)
    answered = gw.measure(partial(hostile.aborted_bodies, rounds=2, wait_answer_s=10.0), "after")
    # a client still sending when the deadline passes is reset instead of reading its 408
    assert set(answered["attack"]["answers"]) <= {"HTTP/1.1 408", "none"}, answered
    aborted = gw.measure(partial(hostile.aborted_bodies, rounds=1), "after")
    grown = answered["rss_after_growth_mb"] + aborted["rss_after_growth_mb"]
    assert grown <= RSS_MB, (answered, aborted)
    assert answered["probe"]["failed"] == aborted["probe"]["failed"] == 0
    assert gw.rejected()[("408", "body_timeout")] >= 20  # an aborting client may be slower than 2 s too


def test_pipelining_without_reading_stops_reading(gateway):
    """Pipelined GET /metrics, and requests asking for 1 MiB answers, never read: the gateway
    stops reading once an answer waits unread, so neither memory nor CPU follows the flood."""
    gw = gateway()
    row = gw.measure(partial(hostile.pipelined_metrics, hold_s=2.0))
    assert row["rss_peak_growth_mb"] <= RSS_MB and row["cpu_s"] <= CPU_S, row
    # once the unread answers fill the socket buffers the gateway goes quiet: no CPU while the
    # client keeps not reading (answering on cost the old gateway 15 s of CPU for these 1.7 MB)
    one = b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n"
    with socket.create_connection(("127.0.0.1", gw.port), timeout=2, source_address=(hostile.ATTACKER, 0)) as s:
        cpu_start = _proc_stats(gw.proc.pid)[1]
        with contextlib.suppress(TimeoutError):  # the gateway stopped reading: the send blocks
            s.sendall(one * (1_700_000 // len(one)))
        # the answers it did compute fill the buffers (about 4 MB: 0.6 s of CPU, which a loaded
        # machine spreads over 3 s and more of wall time): wait until that work is done, then time
        spent = _until_quiet(gw.proc.pid, cpu_start)
        cpu0 = _proc_stats(gw.proc.pid)[1]
        time.sleep(2.0)
        quiet = _proc_stats(gw.proc.pid)[1] - cpu0
        unsent = _unsent_bytes(s)
    assert spent <= CPU_S, spent  # it stopped after the buffers' worth, not after answering all
    assert quiet <= 0.3, quiet
    assert unsent > 0, "the gateway read the whole flood"  # it stopped reading, with requests left
    row = gw.measure(partial(hostile.pipelined_answers, hold_s=4.0))
    # one unread 1 MiB answer stops the next; buffering them on grew 78 MB in 3 s before
    assert row["rss_peak_growth_mb"] <= 32 and row["cpu_s"] <= CPU_S, row
    assert row["probe"]["failed"] == 0


def _until_quiet(pid: int, cpu_start: float, timeout_s: float = 30.0) -> float:
    """The gateway's CPU seconds since ``cpu_start`` once one second passes in which it used at
    most 0.05 s (it was done working); an AssertionError if that never happens within ``timeout_s``.
    Waiting for this, instead of a fixed time, keeps the quiet window below from catching the
    gateway still filling the buffers on a loaded machine (0.51 s of CPU in it, in a CI run)."""
    deadline = time.monotonic() + timeout_s
    last = _proc_stats(pid)[1]
    while True:
        time.sleep(1.0)
        now = _proc_stats(pid)[1]
        if now - last <= 0.05:
            return now - cpu_start
        assert time.monotonic() < deadline, f"the gateway still used {now - last:.2f} s of CPU a second " \
                                            f"{timeout_s:g} s after the flood ({now - cpu_start:.2f} s in all)"
        last = now


def _unsent_bytes(sock: socket.socket) -> int:
    """Bytes the client wrote that still wait in its send queue (Linux's SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def test_an_unterminated_trailer_is_cut_at_the_head_limit(gateway):
    gw = gateway()
    row = gw.measure(hostile.unterminated_trailer)
    taken = row["attack"]["trailer_mb_taken"]
    assert taken < 32, row  # what the kernel's socket buffers hold; the gateway stopped at 64 KiB
    assert row["attack"]["s"] < 10, row  # refused at once, not at the 60 s body deadline
    assert row["rss_peak_growth_mb"] <= RSS_MB and row["cpu_s"] <= CPU_S, row
    assert gw.rejected()[("431", "trailer_too_large")] == 1


def test_a_long_chunk_extension_is_cut_too(gateway):
    gw = gateway()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
        s.sendall(attacks.HEAD + b"Transfer-Encoding: chunked\r\n\r\n5;ext=")
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(2000):
                s.sendall(b"a" * 65536)
    assert gw.rejected()[("431", "trailer_too_large")] == 1


def _probe_while(stop: threading.Event, url: str, seen: list) -> None:
    while not stop.is_set():
        try:
            r = httpx.get(f"{url}/health", timeout=5)  # a new connection each time
            seen.append((r.status_code, r.text[:80]))
        except httpx.HTTPError as exc:
            seen.append((0, repr(exc)))
        time.sleep(0.05)


def test_silent_connections_get_the_head_deadline_and_a_per_client_cap(gateway):
    gw = gateway(header_timeout_s=1.0, keepalive_timeout_s=30.0, max_connections=160,
                 max_connections_per_client=50)
    stop, seen = threading.Event(), []
    prober = threading.Thread(target=_probe_while, args=(stop, gw.url, seen))
    prober.start()
    try:
        out = asyncio.run(hostile.silent_flood(gw.port, n=120, hold_s=4.0))
    finally:
        stop.set()
        prober.join()
    assert out["refused"] == 70 and out["closed_by_server"] == 50, out
    assert out["median_close_s"] < 3.5, out  # the 1 s head deadline, not the 30 s keep-alive time
    assert seen and all(status == 200 for status, _ in seen), seen  # other addresses were served throughout
    assert gw.rejected()[("503", "too_many_client_connections")] == 70
    lines = [ln for ln in gw.log.read_text().splitlines() if "too_many_client_connections" in ln]
    assert len(lines) == 1 and "69 more" not in lines[0]  # one line per 10 s, however many are refused


def test_silent_connections_from_many_addresses_make_room_for_new_clients(gateway):
    """At the global cap a connection holding no request is closed to admit a new one (the
    longest-held first), so a flood spread over addresses cannot lock new clients out."""
    gw = gateway(max_connections=60, max_connections_per_client=20)
    held = [socket.create_connection(("127.0.0.1", gw.port), timeout=5, source_address=(f"127.0.0.{3 + i // 20}", 0))
            for i in range(60)]
    try:
        time.sleep(0.3)
        for _ in range(5):
            r = httpx.get(f"{gw.url}/health", timeout=5)
            assert r.status_code == 200, r.text
        held[0].settimeout(2)
        assert held[0].recv(100) == b""  # the oldest silent one made room, closed without a word
    finally:
        for s in held:
            s.close()
    assert gw.rejected()[("0", "evicted_idle")] >= 1  # one made room; the probes then reuse the freed slot


def test_the_global_cap_answers_a_clear_503_with_retry_after(gateway):
    gw = gateway(max_connections=40, max_connections_per_client=20)
    held = []
    try:
        for i in range(2):  # two addresses hold every connection the gateway allows, each mid-request
            for _ in range(20):
                s = socket.create_connection(("127.0.0.1", gw.port), timeout=5, source_address=(f"127.0.0.{3 + i}", 0))
                s.sendall(b"GET /health HTTP/1.1\r\n")
                held.append(s)
        time.sleep(0.3)
        # a client that writes its request before reading still gets the refusal, not a reset
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in data, data
        assert b'"code": "too_many_connections"' in data
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert gw.rejected()[("503", "too_many_connections")] == 1


def test_bench_hostile_reports_each_attack_and_names_unknown_ones(tmp_path, capsys):
    from kvroute.cli import main

    assert main(["bench", "hostile", "--attacks", "nope"]) == 2
    assert "unknown nope; allowed: aborted-bodies" in capsys.readouterr().err
    out = tmp_path / "h.json"
    assert main(["bench", "hostile", "--attacks", "unterminated-trailer-100MB", "--no-references",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["servers"]["gateway"]["unterminated-trailer-100MB"]
    assert row["attack"]["trailer_mb_taken"] < 32 and row["within"]["rss"], row
    assert "unterminated-trailer-100MB" in capsys.readouterr().out
