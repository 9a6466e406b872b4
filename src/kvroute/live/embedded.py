"""A small emulated deployment in the gateway's own process: `kvroute serve` with no config.

Four emulated replicas (vLLM metric names, the H100 / Llama-3.2-3B profile, so answers come back
in tens of milliseconds) on ephemeral loopback ports, and a gateway in front of them — a new
user can point curl or the openai SDK at it straight away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from kvroute.emulator.kv_events import KVEventsOptions
from kvroute.emulator.server import Emulator, Faults, start_emulator
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.replicas import ReplicaConfig, ReplicaEventsConfig

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
                          kv_events: str | None = None) -> list[tuple[web.AppRunner, Emulator, int]]:
    """``n`` emulated replicas on free ports of ``host``, as (runner, Emulator, port); ``kv_events``
    (``map`` or ``array``): each publishes its KV events on free ports (``event_source``)."""
    opts = (KVEventsOptions(f"tcp://{host}:*", f"tcp://{host}:*", generation=kv_events)
            if kv_events else None)
    return [await start_emulator(host, 0, profile, engine, Faults(), bytes_per_token=bytes_per_token,
                                 kv_events=opts)
            for _ in range(n)]


def event_source(emu: Emulator) -> ReplicaEventsConfig | None:
    """The ``kv_events`` entry of a gateway replica for an emulator that publishes them."""
    if emu.events is None:
        return None
    pub = emu.events.publisher
    return ReplicaEventsConfig(endpoint=pub.bound_endpoint(), replay_endpoint=pub.bound_endpoint(replay=True),
                               topic=pub.topic.decode())


async def start_deployment(replicas: int = 4, policy: str | dict = "auto", host: str = "127.0.0.1",
                           port: int = 8000, profile: str = DEFAULT_PROFILE, kv_events: str | None = None,
                           **overrides) -> Deployment:
    """``replicas`` emulators and a gateway in front of them with ``policy`` (extra GatewayConfig fields via
    ``overrides``); the emulators are stopped again when the gateway cannot listen. ``kv_events`` (``map``
    or ``array``): the emulators publish KV events and the gateway builds its index from them."""
    emus = await start_emulators(replicas, profile, host=host, kv_events=kv_events)
    config = GatewayConfig(host=host, port=port, policy=policy,
                           replicas=[ReplicaConfig(url=f"http://{host}:{p}", id=f"emulated-{i}", engine="vllm",
                                                   kv_events=event_source(emu))
                                     for i, (_, emu, p) in enumerate(emus)], **overrides)
    gw = Gateway(config)
    try:
        await gw.start()
    except OSError:
        for runner, _, _ in emus:
            await runner.cleanup()
        raise
    return Deployment(gw, emus)
