"""A small emulated deployment in the gateway's own process: `kvroute serve` with no config.

Four emulated replicas (vLLM metric names, the H100 / Llama-3.2-3B profile, so answers come back
in tens of milliseconds) on ephemeral loopback ports, and a gateway in front of them — a new
user can point curl or the openai SDK at it straight away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from kvroute.emulator.server import Emulator, Faults, start_emulator
from kvroute.gateway.config import GatewayConfig, ReplicaConfig
from kvroute.gateway.server import Gateway

DEFAULT_PROFILE = "h100-llama3.2-3b"


@dataclass
class Deployment:
    """A gateway and the emulated replicas behind it, all in this process (kvroute serve without --config, the
    demo, tests)."""

    gateway: Gateway
    emulators: list[tuple[web.AppRunner, Emulator, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return f"http://{self.gateway.config.host}:{self.gateway.port}"

    async def stop(self) -> None:
        """Stop the gateway, then every emulator."""
        await self.gateway.stop()
        for runner, _, _ in self.emulators:
            await runner.cleanup()


async def start_emulators(n: int, profile: str = DEFAULT_PROFILE, engine: str = "vllm",
                          host: str = "127.0.0.1", bytes_per_token: float = 4.0,
                          ) -> list[tuple[web.AppRunner, Emulator, int]]:
    """``n`` emulated replicas on free ports of ``host``, as (runner, Emulator, port)."""
    return [await start_emulator(host, 0, profile, engine, Faults(), bytes_per_token=bytes_per_token)
            for _ in range(n)]


async def start_deployment(replicas: int = 4, policy: str | dict = "skywalker", host: str = "127.0.0.1",
                           port: int = 8000, profile: str = DEFAULT_PROFILE, **overrides) -> Deployment:
    """``replicas`` emulators and a gateway in front of them with ``policy`` (extra GatewayConfig fields via
    ``overrides``); the emulators are stopped again when the gateway cannot listen."""
    emus = await start_emulators(replicas, profile, host=host)
    config = GatewayConfig(host=host, port=port, policy=policy,
                           replicas=[ReplicaConfig(url=f"http://{host}:{p}", id=f"emulated-{i}", engine="vllm")
                                     for i, (_, _, p) in enumerate(emus)], **overrides)
    gw = Gateway(config)
    try:
        await gw.start()
    except OSError:
        for runner, _, _ in emus:
            await runner.cleanup()
        raise
    return Deployment(gw, emus)
