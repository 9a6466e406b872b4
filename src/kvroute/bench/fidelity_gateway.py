"""The live side's gateway for `kvroute bench fidelity` (bench/fidelity.py): `kvroute serve` in a
process of its own, told what the simulated balancer knows of the engines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import yaml

from kvroute.ports import free_port


def gateway_facts(profile: str) -> dict:
    """What the simulator's balancer knows of each engine (sim/balancer.py: the profile's batch
    limit and KV capacity), as the live gateway's replica fields. A gateway learns neither from
    llama-server's /metrics (replicas.py), so without them its pending gate (SkyWalker's,
    policy/admission.py) saw no batch limit where the simulated one saw llama-server's 4 slots
    (issue 21g)."""
    from kvroute.perf.loader import load_profile

    p = load_profile(profile)
    return {"max_running": p.max_running, "kv_tokens": p.kv_tokens}


class GatewayProcess:
    """`kvroute serve` in its own process, stopped by its PID."""

    def __init__(self, urls: list[str], policy: str, folder: Path, facts: dict | None = None):
        """``facts``: replica fields every replica gets (``max_running``, ``kv_tokens``: what the
        simulated balancer knows of its engines, :func:`gateway_facts`)."""
        self.config = folder / f"gateway-{policy}.yaml"
        self.port = free_port()
        self.config.write_text(yaml.safe_dump({
            "host": "127.0.0.1", "port": self.port, "policy": policy, "access_log": False,
            "replicas": [{"url": u, "id": f"engine-{i}", **(facts or {})} for i, u in enumerate(urls)]}))
        self.log = folder / f"gateway-{policy}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The gateway's base URL on 127.0.0.1."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 20) -> None:
        """Start `kvroute serve` and return once /health reports a healthy replica; RuntimeError with the
        log's tail when it exits or times out."""
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(self.config),
                                          "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # not up yet
                    async with s.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200 and (await r.json()).get("healthy"):
                            return
                await asyncio.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the gateway did not become healthy; log: {self.log.read_text()[-800:]}")

    def cpu_s(self) -> float:
        """CPU seconds the gateway process has used so far (user + system, from /proc)."""
        assert self.proc is not None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM by PID (a graceful drain), SIGKILL if it has not exited 10 s later; nothing when it already
        ended."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
