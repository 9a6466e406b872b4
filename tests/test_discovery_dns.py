"""DNS discovery against a real dnsmasq on a loopback port (Debian's dnsmasq-base; `make test`
installs it): a headless Service's A records re-resolved as pods come and go, SRV records with
their ports, a server that stops answering (the last answer stays), and a name with no records."""

import asyncio
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import time

import httpx
import pytest

from kvroute.discovery.config import DNSSource
from kvroute.discovery.dns import A, build_query, resolve
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from tests.conftest import until
from tests.k8s_api import engines_on

DNSMASQ = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.path.exists("/usr/sbin/dnsmasq") else None)
pytestmark = pytest.mark.skipif(DNSMASQ is None, reason="dnsmasq not installed (make test installs dnsmasq-base)")
NAME = "engines.llm.svc.cluster.local"


def free_udp_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (dnsmasq binds both), taken below the kernel's
    ephemeral range: a port from ``bind(0)`` lies inside it, where any outgoing connection of the suite
    may take it as its source port before dnsmasq binds it (seen in CI: "Address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, socket.socket() as t:
            try:
                u.bind(("127.0.0.1", port))
                t.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port below the ephemeral range is free for UDP and TCP")


class Dnsmasq:
    """dnsmasq in the foreground on 127.0.0.1:port, answering for cluster.local only, from a hosts
    file (SIGHUP re-reads it) and extra options; stopped by its PID."""

    def __init__(self, hosts, port: int, *extra: str):
        self.hosts, self.port, self.extra = hosts, port, extra
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [DNSMASQ, "--keep-in-foreground", f"--port={self.port}", "--listen-address=127.0.0.1",
             "--bind-interfaces", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", "--conf-file=/dev/null",
             "--local=/cluster.local/", "--local-ttl=0", "--cache-size=0", "--pid-file=", "--user=root",
             "--log-facility=-", *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # answering yet?
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {self.proc.stderr.read().decode()[-500:]}")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # blocking: callers may be in a loop
                s.settimeout(0.2)
                try:
                    s.sendto(build_query(7, NAME, A), ("127.0.0.1", self.port))
                    s.recv(512)
                    return
                except OSError:
                    time.sleep(0.05)
        raise RuntimeError("dnsmasq did not answer")

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


def test_headless_service_re_resolved(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvroute")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.2 {NAME}\n127.0.0.3 {NAME}\n")
    dns = Dnsmasq(hosts, free_udp_port())
    dns.start()

    async def run():
        port, engines = await engines_on(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        gw = Gateway(GatewayConfig(port=0, policy="round_robin", probe={"interval_s": 0.05}, discovery=[{
            "kind": "dns", "name": NAME, "port": port, "nameserver": f"127.0.0.1:{dns.port}", "interval_s": 0.1,
            # 2 s per query, not 0.3: the first resolution (three queries) must succeed before the gateway
            # listens, and dnsmasq, another process, may wait that long for a core on a loaded machine
            "timeout_s": 2.0, "defaults": {"engine": "vllm", "region": "us"}}]))
        await gw.start()
        rt = gw.runtime
        names = lambda: set(rt.upstreams)  # noqa: E731
        a, b, c = (f"127.0.0.{i}:{port}" for i in (2, 3, 4))
        try:
            assert names() == {a, b}  # resolved once before the gateway started listening
            assert rt.upstreams[a].config.region == "us"
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(f"http://127.0.0.1:{gw.port}/v1/completions",
                                      json={"model": "emulated", "prompt": "hi", "max_tokens": 3})
                assert r.status_code == 200 and r.headers["x-kvroute-replica"] in {a, b}
                # a pod left and another came: the next resolution follows
                hosts.write_text(f"127.0.0.3 {NAME}\n127.0.0.4 {NAME}\n")
                dns.reload()
                await until(lambda: names() == {b, c}, what="re-resolution")
                # the server stops answering: the last answer stays, the failure is reported
                dns.stop()
                await until(lambda: "keeping the last answer" in caplog.text, what="a failed resolution")
                assert names() == {b, c}
                assert f"127.0.0.1:{dns.port}" in rt.discovery.status()[f"dns[0]:{NAME}"]["error"]
                # back, with no record for the name (a Service with no ready endpoints): NXDOMAIN
                hosts.write_text("")
                dns.start()
                await until(lambda: not names(), what="every engine gone")
                assert "has no records" in caplog.text
                r = await client.post(f"http://127.0.0.1:{gw.port}/v1/completions",
                                      json={"model": "emulated", "prompt": "hi", "max_tokens": 3})
                assert r.status_code == 503
        finally:
            await gw.stop()
            for runner, _ in engines:
                await runner.cleanup()

    try:
        asyncio.run(run())
    finally:
        dns.stop()


def test_srv_records_give_each_engine_its_port(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("")
    srv = f"_http._tcp.{NAME}"
    dns = Dnsmasq(hosts, free_udp_port(), f"--srv-host={srv},vllm-0.{NAME},8000,0,10",
                  f"--srv-host={srv},vllm-1.{NAME},8001,0,10", f"--host-record=vllm-0.{NAME},10.1.0.7",
                  f"--host-record=vllm-1.{NAME},10.1.0.8,fd00::8")
    dns.start()
    try:
        got = asyncio.run(resolve(DNSSource(kind="dns", name=srv, srv=True, nameserver=f"127.0.0.1:{dns.port}")))
        assert got == [("10.1.0.7", 8000), ("10.1.0.8", 8001), ("fd00::8", 8001)]
        a_only = asyncio.run(resolve(DNSSource(kind="dns", name=f"vllm-1.{NAME}", port=9,
                                               nameserver=f"127.0.0.1:{dns.port}")))
        assert a_only == [("10.1.0.8", 9), ("fd00::8", 9)]
    finally:
        dns.stop()


def test_dns_source_needs_a_port_for_a_records():
    with pytest.raises(ValueError, match="needs port"):
        DNSSource(kind="dns", name=NAME)
