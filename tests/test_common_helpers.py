"""The helpers several components share: percentile, local ports, the stop signal, probe
streaks, secrets and uniqueness checks in config files, the OpenAI error shape."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvroute import yamlconf
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.http import error_body, error_object
from kvroute.gateway.probes import ProbeStreak
from kvroute.ports import free_port, free_ports, hold_port, wait_for_http, wait_for_port
from kvroute.replicas import base_url
from kvroute.shutdown import until_stopped
from kvroute.stats import percentile, percentile_sorted
from kvroute.yamlconf import read_secret


def test_percentile_is_the_nearest_rank_on_the_zero_based_index():
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 0.5) == 5.0  # sorted[round(4.5)] = sorted[4] (half to even)
    assert percentile(values, 0.95) == 10.0  # sorted[round(8.55)] = sorted[9]
    assert percentile(values, 0.0) == 1.0 and percentile(values, 1.0) == 10.0
    assert percentile([], 0.99) == 0.0 and percentile_sorted([3.0], 0.5) == 3.0


def test_gateway_modules_do_not_import_numpy():
    code = ("import sys, kvroute.gateway.server, kvroute.stats, kvroute.policy; "
            "print('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_command_line_parses_without_the_sim_extra():
    """A base install (`pip install kvroute`, no numpy/matplotlib) runs `kvroute serve`: building the
    parser must not import the simulator, as `bench plan` and `bench auto` once did."""
    code = ("import sys; sys.modules['numpy'] = None; sys.modules['matplotlib'] = None; "
            "from kvroute.commands import build_parser; "
            "a = build_parser().parse_args(['serve', '--config', 'x.yaml']); print(a.command)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "serve"


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(5)
    assert len(set(ports)) == 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_wait_for_port_returns_when_listening_and_times_out_otherwise():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        wait_for_port(s.getsockname()[1], timeout_s=2)
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        wait_for_port(port, timeout_s=0.3)
    assert time.monotonic() - t0 < 3
    with pytest.raises(TimeoutError, match="did not answer 200"):
        wait_for_http(f"http://127.0.0.1:{port}/health", timeout_s=0.3)


def test_a_held_port_refuses_connections_and_only_a_reusing_server_takes_it():
    """A port named before its server starts (a peer's URL, HAProxy's front) is held bound: nothing else —
    a plain bind, an outgoing connection's source port — can take it meanwhile, while the gateway's own
    listener (SO_REUSEADDR, as asyncio's servers, HAProxy and nats-server set it) binds it and serves."""
    held = hold_port()
    port = held.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with socket.socket() as other, pytest.raises(OSError) as taken:  # free_port's port: this bind succeeded
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE

        async def serve() -> bytes:
            from kvroute.gateway.server import Gateway

            gw = Gateway(GatewayConfig(host="127.0.0.1", port=port, replicas=[{"url": "http://127.0.0.1:9"}],
                                       probe={"timeout_s": 0.2}))
            await gw.start()
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /livez HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
                answer = await reader.read()
                writer.close()
                return answer
            finally:
                await gw.stop()
        assert asyncio.run(asyncio.wait_for(serve(), 30)).startswith(b"HTTP/1.1 200")
    finally:
        held.close()


def test_until_stopped_returns_on_sigterm_and_calls_the_hangup_hook():
    hangups: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, os.kill, os.getpid(), signal.SIGHUP)
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(until_stopped(on_hangup=lambda: hangups.append(1)), 5)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)

    asyncio.run(main())
    assert hangups == [1]


def test_probe_streak_ejects_and_readmits_with_hysteresis():
    s = ProbeStreak()
    assert not s.failed(True, 3) and not s.failed(True, 3)
    assert s.failed(True, 3)  # third failure in a row: eject
    assert not s.succeeded(False, 2) and s.succeeded(False, 2)  # two successes: re-admit
    assert not s.failed(True, 3)  # a success reset the failure streak
    assert s.rtt(0.1, 0.3) == 0.1 and s.rtt(0.2, 0.3) == pytest.approx(0.13)


def test_read_secret_names_its_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KVR_TEST_SECRET", "  s3cret \n")
    assert read_secret("KVR_TEST_SECRET", None) == "s3cret"
    monkeypatch.setenv("KVR_TEST_SECRET", "")
    with pytest.raises(ValueError, match="^peer_auth: environment variable KVR_TEST_SECRET is unset or empty$"):
        read_secret("KVR_TEST_SECRET", None, "peer_auth: ")
    f = tmp_path / "tok"
    f.write_text("\n")
    with pytest.raises(ValueError, match=f"{f} is empty"):
        read_secret(None, str(f))
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(None, str(tmp_path / "missing"))


def test_base_url_and_uniqueness_checks():
    assert base_url("http://h:1/") == "http://h:1"
    with pytest.raises(ValueError, match="http://host:port"):
        base_url("h:1")
    assert yamlconf.first_repeat(["a", "b", "c"]) is None
    assert yamlconf.first_repeat(["a", "b", "a", "b"]) == (2, 0)
    with pytest.raises(yamlconf.AtItem, match=r"peer names must be unique; repeated: b \(as in peers\[1\]\)"):
        yamlconf.unique_items(["a", "b", "b"], "peer names", "peers")


def test_a_repeated_key_name_points_at_its_line(tmp_path):
    cfg = tmp_path / "gw.yaml"
    digest = "0" * 64
    cfg.write_text(f"replicas: [{{url: 'http://127.0.0.1:9'}}]\nauth:\n  keys:\n"
                   f"    - {{name: a, sha256: '{digest}'}}\n    - {{name: a, sha256: '{digest}'}}\n")
    with pytest.raises(yamlconf.ConfigFileError, match=r":5: auth\.keys\.1: key names must be unique"):
        yamlconf.load(GatewayConfig, cfg)


def test_openai_error_shape():
    assert error_object("no", code="c") == {"error": {"message": "no", "type": "invalid_request_error",
                                                      "param": None, "code": "c"}}
    assert json.loads(error_body("x", "server_error")) == error_object("x", "server_error")
