"""The fleet's section of the gateway config (``fleet:``): how instances of one region reach NATS."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvroute.schema import StrictModel


class FleetConfig(StrictModel):
    """Several gateway instances of one region sharing their load over NATS (``kvroute/fleet``):
    every instance lists the same replicas and the same ``nats_url``; a front load balancer
    (HAProxy, checking ``/readyz``) spreads the clients over them. With ``scope: all`` the
    gateways of every region share one subject (each region's gateway listing every region's
    replicas; a replica one of them does not list is not mirrored there)."""

    nats_url: str = Field(description="the NATS server, nats://host:port (needs `pip install 'kvroute[fleet]'`)")
    instance: str | None = Field(None, description="this instance's name on the subject; default: "
                                 "host-pid-random, unique per process")
    subject_prefix: str = Field("kvroute.fleet", description="messages go to `<subject_prefix>.<region>`")
    scope: Literal["region", "all"] = Field(
        "region", description="`region`: share with this region's instances; `all`: with every region's, on "
        "`<subject_prefix>.all` — for gateways that each route to every region's replicas (a distributed "
        "deployment), so each counts the others' requests one WAN hop after they are sent (docs/auto.md)")
    heartbeat_s: float = Field(0.1, gt=0, description="how often the LB queue is published (the probe interval)")
    snapshot_every: int = Field(10, ge=1, description="every this many heartbeats, the whole in-flight set "
                                "(repairs lost messages)")
    timeout_s: float = Field(3.0, gt=0, description="a sibling silent this long is forgotten (its load with it)")
    reconnect_s: float = Field(0.5, gt=0, description="wait between attempts to reach NATS")
    connect_timeout_s: float = Field(2.0, gt=0, description="one attempt to open the NATS connection")
    ping_interval_s: float = Field(2.0, gt=0, description="NATS pings: a silent connection is dropped after two "
                                   "missed ones")

    @model_validator(mode="after")
    def _beats(self) -> FleetConfig:
        if self.timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(f"timeout_s ({self.timeout_s:g}) must exceed two heartbeats "
                             f"(heartbeat_s {self.heartbeat_s:g})")
        if not self.nats_url.startswith(("nats://", "tls://")):
            raise ValueError(f"nats_url must start with nats:// or tls://, got {self.nats_url!r}")
        from importlib.util import find_spec

        if find_spec("nats") is None:
            raise ValueError("fleet needs the optional 'nats-py' package: pip install 'kvroute[fleet]'")
        return self
