"""The deployment file: what the controller manages, and the only state it keeps.

    host: 127.0.0.1
    port: 9000
    admin_key: {env: KVROUTE_ADMIN_KEY}          # or {file: /run/secrets/kvroute-admin}
    network: {rtt_ms: {us-eu: 80, us-asia: 150, eu-asia: 200}}
    gateways:
      - {name: gw-us, region: us, url: http://10.0.0.2:8000}
      - {name: gw-eu, region: eu, url: http://10.1.0.2:8000, manages: [eu]}
    replicas:
      - {id: us-0, region: us, url: http://10.0.0.5:8000, engine: vllm}

A gateway manages its own region's replicas unless ``manages`` says otherwise (``all``: every
region, GORGO's proxy or distributed modes). ``urls_from`` gives, per region, the address by
which something in that region reaches a gateway or replica when it differs from ``url`` — on one
machine, ``kvroute live`` points it at the delay proxy of that cross-region link.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kvroute import yamlconf
from kvroute.perf.network import NetworkSpec
from kvroute.replicas import ReplicaConfig, base_url
from kvroute.schema import StrictModel
from kvroute.yamlconf import read_secret


class SecretSource(StrictModel):
    """Where a secret is read from: an environment variable or a file (never the YAML itself)."""

    env: str | None = Field(None, description="environment variable holding the secret")
    file: str | None = Field(None, description="file holding the secret (surrounding whitespace ignored)")

    @model_validator(mode="after")
    def _one(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env, file")
        return self

    def read(self) -> str:
        """The secret; a missing or empty source is a ValueError naming it."""
        return read_secret(self.env, self.file)


class DeployedGateway(StrictModel):
    """One gateway of the deployment."""

    name: str = Field(description="its name in /resolve answers, /status and logs")
    region: str = Field(description="the region it is in")
    url: str = Field(description="its base URL, http://host:port")
    manages: list[str] | Literal["all"] | None = Field(
        None, description="replica regions it manages (default: its own); `all`: every region")
    urls_from: dict[str, str] = Field(default_factory=dict, description="per region: the URL by which clients "
                                      "there reach it, when not `url` (a delay proxy in `kvroute live`)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)

    def url_from(self, region: str) -> str:
        """Where a client in ``region`` sends its requests."""
        return self.urls_from.get(region, self.url)

    def manages_region(self, region: str) -> bool:
        """Whether ``region``'s replicas are this gateway's own (in its config file)."""
        if self.manages == "all":
            return True
        return region in (self.manages if self.manages is not None else [self.region])


class DeployedReplica(ReplicaConfig):
    """A replica: a gateway ``replicas:`` entry (``id`` required) plus how other regions reach it."""

    id: str = Field(description="its name at every gateway (x-kvroute-replica, metrics, the admin API)")
    urls_from: dict[str, str] = Field(default_factory=dict, description="per region: the URL by which a "
                                      "gateway there reaches it, when not `url`")

    def as_seen_from(self, region: str) -> ReplicaConfig:
        """The ``replicas:`` entry a gateway in ``region`` needs (the admin API's body)."""
        data = self.model_dump(exclude={"urls_from"})
        data["url"] = self.urls_from.get(region, self.url)
        return ReplicaConfig(**data)


class ControllerProbe(StrictModel):
    """How the controller watches gateways and replicas."""

    interval_s: float = Field(0.1, gt=0, description="gateway probe period (SkyWalker: 100 ms)")
    timeout_s: float = Field(0.25, gt=0, description="a probe slower than this fails (a frozen gateway "
                             "must fail fast for failover to take under a second)")
    unhealthy_after: int = Field(3, ge=1, description="consecutive failed probes before a gateway is failed over")
    healthy_after: int = Field(2, ge=1, description="consecutive good probes before its replicas move back")
    replica_interval_s: float = Field(1.0, gt=0, description="replica probe period (for /status; gateways "
                                      "eject dead replicas themselves)")
    reconcile_s: float = Field(0.5, gt=0, description="how often each healthy gateway's replica set is "
                               "checked against the plan even without a health change")


class Deployment(StrictModel):
    """Regions, gateways and replicas: the controller's source of truth."""

    host: str = Field("127.0.0.1", description="address the controller listens on (`--host`)")
    port: int = Field(9000, ge=0, le=65535, description="its port; 0: any free port (`--port`)")
    admin_key: SecretSource | None = Field(None, description="the gateways' admin API key (a key with "
                                           "`admin: true` in their auth.keys); without it the controller "
                                           "resolves and reports but cannot move replicas")
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="round-trip times "
                                       "between regions")
    probe: ControllerProbe = Field(default_factory=ControllerProbe, description="health probes")
    gateways: list[DeployedGateway] = Field(description="every gateway")
    replicas: list[DeployedReplica] = Field(default_factory=list, description="every replica")

    @field_validator("gateways")
    @classmethod
    def _gateways(cls, gws: list[DeployedGateway]) -> list[DeployedGateway]:
        if not gws:
            raise ValueError("list at least one gateway")
        yamlconf.unique_items((g.name for g in gws), "gateway names", "gateways")
        return gws

    @field_validator("replicas")
    @classmethod
    def _replicas(cls, reps: list[DeployedReplica]) -> list[DeployedReplica]:
        yamlconf.unique_items((r.id for r in reps), "replica ids", "replicas")
        return reps

    @model_validator(mode="after")
    def _every_replica_has_a_home(self) -> Deployment:
        for i, r in enumerate(self.replicas):
            if not any(g.manages_region(r.region) for g in self.gateways):
                raise yamlconf.AtItem(f"replica {r.id!r} is in region {r.region!r}, which no gateway manages; "
                                      f"gateway regions: {', '.join(sorted({g.region for g in self.gateways}))}",
                                      ("replicas", i, "region"))
        return self

    def admin_token(self) -> str | None:
        """The admin key, read now (None when none is configured)."""
        return self.admin_key.read() if self.admin_key is not None else None


def load_deployment(path: str) -> Deployment:
    """Read and validate a deployment file; errors name file:line and the field."""
    dep = yamlconf.load(Deployment, path)
    try:
        dep.admin_token()
    except ValueError as exc:
        raise yamlconf.ConfigFileError(f"{path}: admin_key: {exc}") from None
    return dep
