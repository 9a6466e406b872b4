"""A region with several gateway instances, for real, on 127.0.0.1: emulated replicas
(``kvroute emulate``), a nats-server, N ``kvroute serve`` instances sharing load over it, and
HAProxy in front checking ``/readyz`` — every one a child process stopped by its own PID.

Used by ``kvroute bench fleet`` and the fleet tests. The front (NATS, instances, HAProxy) can be
torn down and started again with another instance count over the same replicas; ``reset`` empties
the replicas' caches in between (the emulator's ``POST /_restart``), so runs start alike.

With ``kv_events`` (the default) every emulator publishes its cache's KV events as vLLM does, on
Unix sockets in the region's folder (``ipc://``: nothing listens beyond this host), and every
instance subscribes to every replica: each builds the same exact index from the same events
(issue 19 items 1-2), and the fleet sync only has to carry load. Instances take two API keys:
``client_key`` for requests, ``admin_key`` for the admin API (``GET /admin/fleet``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvroute.fleet.services import Service, haproxy, nats_server
from kvroute.ports import free_ports
from kvroute.processes import Child, Fleet

DEFAULT_PROFILE = "h100-llama3.2-3b"  # answers in tens of milliseconds
ADMIN_ENV, CLIENT_ENV = "KVROUTE_FLEET_ADMIN_KEY", "KVROUTE_FLEET_CLIENT_KEY"


@dataclass
class RegionFleet:
    """Replicas, and in front of them ``instances`` gateways (+ NATS when ``sync``) behind HAProxy."""

    folder: Path
    replicas: int = 4
    profile: str = DEFAULT_PROFILE
    policy: str | dict[str, Any] = "skywalker"
    seed: int = 0
    gateway_overrides: dict[str, Any] = field(default_factory=dict)
    kv_events: bool = True
    admin_key: str = field(default_factory=lambda: secrets.token_hex(8))
    client_key: str = field(default_factory=lambda: secrets.token_hex(8))
    procs: Fleet = field(init=False)
    emulators: list[Child] = field(default_factory=list)
    instances: list[Child] = field(default_factory=list)
    last_views: list[dict[str, Any]] = field(default_factory=list)  # the instances' /admin/fleet after a run
    nats: Service | None = None
    front: Service | None = None

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.procs = Fleet(self.folder, env={ADMIN_ENV: self.admin_key, CLIENT_ENV: self.client_key})

    @property
    def url(self) -> str:
        """HAProxy's address: where clients go."""
        assert self.front is not None, "start_front() first"
        return f"http://127.0.0.1:{self.front.port}"

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return f"nats://127.0.0.1:{self.nats.port}"

    async def start_replicas(self) -> None:
        """One emulator process per replica, started together."""
        for i in range(self.replicas):
            events = ["--kv-events", self._events(i), "--kv-events-replay", self._events(i, replay=True)] \
                if self.kv_events else []
            self.emulators.append(self.procs.add(f"replica-{i}", [
                "emulate", "--host", "127.0.0.1", "--port", "0", "--profile", self.profile, "--engine", "vllm",
                "--model", "emulated", *events]))
        await self.procs.start([c.name for c in self.emulators], timeout_s=60)

    async def reset(self) -> None:
        """Empty every replica's cache (a simulated engine restart)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for child in self.emulators:
                async with s.post(f"{child.url}/_restart") as r:
                    r.raise_for_status()

    def _events(self, i: int, replay: bool = False) -> str:
        return f"ipc://{self.folder.resolve()}/r{i}-{'replay' if replay else 'events'}.sock"

    def gateway_config(self, name: str, port: int, sync: bool) -> dict[str, Any]:
        """The YAML of one instance: every replica (with its events), the policy, keys, the fleet section when
        synced."""
        replicas = []
        for i, c in enumerate(self.emulators):
            r: dict[str, Any] = {"url": c.url, "id": f"r{i}", "engine": "vllm"}
            if self.kv_events:
                r["kv_events"] = {"endpoint": self._events(i), "replay_endpoint": self._events(i, replay=True)}
            replicas.append(r)
        cfg: dict[str, Any] = {
            "host": "127.0.0.1", "port": port, "region": "local", "policy": self.policy, "seed": self.seed,
            "replicas": replicas, "access_log": False, "drain_delay_s": 0.0,
            "auth": {"keys": [{"name": "admin", "env": ADMIN_ENV, "admin": True},
                              {"name": "clients", "env": CLIENT_ENV}]},
            **self.gateway_overrides}
        if sync:
            cfg["fleet"] = {"nats_url": self.nats_url, "instance": name}
        return cfg

    async def start_front(self, instances: int, sync: bool = True) -> None:
        """NATS (when ``sync``), ``instances`` gateways, and HAProxy over them."""
        if sync:
            self.nats = nats_server(self.folder)
            await asyncio.to_thread(self.nats.start)
        ports = free_ports(instances)
        self.instances = []
        for i, port in enumerate(ports):
            name = f"gw-{i}"
            path = self.folder / f"{name}.yaml"
            path.write_text(yaml.safe_dump(self.gateway_config(name, port, sync), sort_keys=False))
            self.instances.append(self.procs.add(name, ["serve", "--config", str(path), "--log-level", "INFO"]))
        await self.procs.start([c.name for c in self.instances], timeout_s=60)
        self.front = haproxy(self.folder, [(c.name, c.port) for c in self.instances])
        await asyncio.to_thread(self.front.start)
        await self.wait_front_ready(len(self.instances))

    async def wait_front_ready(self, up: int, timeout_s: float = 20.0) -> None:
        """Until HAProxy has ``up`` instances passing their health checks (its stats via /health
        of each instance is not enough: HAProxy marks a server up after ``rise`` checks)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                ok = 0
                for child in self.instances:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with s.get(f"{child.url}/readyz") as r:
                            ok += r.status == 200
                if ok >= up:
                    await asyncio.sleep(0.5)  # HAProxy's two checks at 200 ms
                    return
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"only {ok} of {up} instances ready after {timeout_s:g} s")
                await asyncio.sleep(0.1)

    async def kill_instance(self, i: int) -> None:
        """SIGKILL instance ``i`` by its PID."""
        await self.instances[i].kill()

    async def stop_front(self) -> None:
        """HAProxy, the instances and NATS, each by PID."""
        if self.front is not None:
            await asyncio.to_thread(self.front.stop)
            self.front = None
        await asyncio.gather(*(c.stop() for c in self.instances), return_exceptions=True)
        for c in self.instances:
            self.procs.children.pop(c.name, None)
        self.instances = []
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
            self.nats = None

    async def stop(self) -> None:
        """Everything this region started."""
        await self.stop_front()
        await self.procs.stop_all()

    async def fleet_views(self) -> list[dict[str, Any]]:
        """Every live instance's ``GET /admin/fleet``."""
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5),
                                         headers={"Authorization": f"Bearer {self.admin_key}"}) as s:
            for child in self.instances:
                if child.alive:
                    async with s.get(f"{child.url}/admin/fleet") as r:
                        out.append(await r.json(content_type=None))
        return out

    def instance_log(self, i: int) -> str:
        """What instance ``i`` logged (all its starts)."""
        path = self.instances[i].log_path
        return path.read_text(errors="replace") if path.exists() else ""
