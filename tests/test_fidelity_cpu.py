"""bench/fidelity_cpu.py: the CPU ledger of a live fidelity run (what else uses the engines' cores),
against a real process listening on 127.0.0.1."""

import subprocess
import sys
import time

import httpx
import pytest

from kvroute.bench.fidelity_cpu import CpuLedger, background, listening_pid, machine_busy_s, thread_cpu_s
from kvroute.ports import free_port

pytestmark = pytest.mark.skipif(machine_busy_s() is None, reason=(
    "the CPU ledger reads Linux's /proc/stat and /proc/net/tcp, which this system lacks: bench fidelity then records "
    "no background load, and these tests have nothing to measure"))


@pytest.fixture
def server():
    """A Python HTTP server on a free loopback port (its own process), stopped by PID."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield port, proc
    finally:
        proc.kill()
        proc.wait(5)


def test_the_ledger_finds_a_local_engine_by_its_port_and_counts_its_busiest_thread(server):
    port, proc = server
    assert listening_pid(port) == proc.pid
    ledger = CpuLedger([f"http://127.0.0.1:{port}"])
    t0 = time.perf_counter()
    # make the "engine" work until /proc shows it (CPU time counts in clock ticks, 10 ms here: 40
    # requests sometimes stayed under one), within 20 s
    start = sum(thread_cpu_s(proc.pid).values())
    while sum(thread_cpu_s(proc.pid).values()) - start < 0.02 and time.perf_counter() - t0 < 20:
        for _ in range(20):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
    wall = time.perf_counter() - t0
    got = ledger.stop(wall, gateway_cpu_s=0.01, client_cpu_s=0.02)
    assert got["engines"][0] is not None and got["engines"][0] > 0
    # one process, no children: nothing beside the busiest thread but the server's other threads
    assert got["frontend"][0] is not None and got["frontend"][0] >= 0 and got["engine_other"][0] == 0
    assert got["machine"] >= got["engines"][0]
    assert got["background"] == pytest.approx(max(0.0, got["machine"] - got["engines"][0]), abs=1e-3)
    assert "machine busy" in got["how"]


def test_an_engine_not_found_leaves_the_gateway_and_client_only():
    port = free_port()  # nobody listens there
    got = CpuLedger([f"http://127.0.0.1:{port}", "http://10.0.0.9:8000"]).stop(2.0, 0.2, 0.1)
    assert got["engines"] == [None, None]
    assert got["frontend"] == [None, None] and got["engine_other"] == [None, None]
    assert got["background"] == pytest.approx(0.15) and "gateway and client" in got["how"]


def test_background_from_a_stored_run():
    """What the simulator gets: the ledger's, else (older runs) the gateway's and client's shares;
    none without shared cores; never the whole machine."""
    assert background({"host_cpu": {"background": 0.3}}, 2) == 0.3
    assert background({"gateway_cpu_share": 0.04, "client_cpu_share": 0.02}, 2) == pytest.approx(0.06)
    assert background({"host_cpu": {"background": 0.3}}, None) == 0.0
    assert background({"host_cpu": {"background": 5.0}}, 2) == pytest.approx(1.8)
