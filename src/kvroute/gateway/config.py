"""Gateway configuration (YAML, validated with pydantic; errors name file:line and the field): the
whole file (:class:`GatewayConfig`), API keys, peers and P/D; the replicas' model is
:mod:`kvroute.replicas`, the operating sections :mod:`kvroute.gateway.settings`, ``fleet:``
:mod:`kvroute.fleet.config`.

    host: 127.0.0.1
    port: 8000
    region: us
    policy: {preset: skywalker, params: {cache_threshold: 0.5}}
    replicas:
      - {url: http://10.0.0.5:8000, region: us, engine: vllm, weight: 1}
      - {url: http://10.0.0.6:30000, engine: sglang}
    probe: {interval_s: 0.1, timeout_s: 0.5}
    queue: {max_len: 1024, max_wait_s: 30}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kvroute import yamlconf
from kvroute.discovery.config import Source
from kvroute.errors import ConfigError
from kvroute.fleet.config import FleetConfig
from kvroute.gateway.auth import KeyRing, KeyState, TokenBucket, digest
from kvroute.gateway.http import HTTPLimits
from kvroute.gateway.settings import (
    BreakerConfig,
    HTTPConfig,
    KVEventsSettings,
    ProbeConfig,
    QueueConfig,
    RetryConfig,
    StallConfig,
    TimeoutConfig,
    TLSConfig,
    TracingConfig,
)
from kvroute.policy import policy_from_config
from kvroute.policy.pd import PDPolicySpec, role_check
from kvroute.policyfiles import load_entry_points
from kvroute.replicas import ReplicaConfig, base_url, events_extra_installed
from kvroute.schema import StrictModel, checked


class KeyConfig(StrictModel):
    """One API key: its digest, or where to read it (hashed when the config loads), and limits."""

    name: str = Field(description="the key's name in metrics and logs")
    sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$")  # sha256 hex digest of the key
    env: str | None = None  # an environment variable holding the key
    file: str | None = None  # a file holding the key (surrounding whitespace ignored)
    requests_per_min: float | None = Field(None, gt=0, description="requests per minute (token bucket); "
                                           "beyond: 429 with Retry-After")
    tokens_per_min: float | None = Field(None, gt=0)  # prompt estimate + max_tokens, at admission
    admin: bool = False  # may use the admin API
    zone: str | None = Field(None, description="residency: this key's requests are served only by replicas "
                             "and peers in this zone (as if every request carried x-kvroute-residency)")

    @model_validator(mode="after")
    def _one_source(self) -> KeyConfig:
        sources = [s for s in ("sha256", "env", "file") if getattr(self, s) is not None]
        if len(sources) != 1:
            raise ValueError(f"key {self.name!r} needs exactly one of sha256, env, file; got "
                             f"{', '.join(sources) or 'none'}")
        return self

    def key_digest(self) -> str:
        """The key's digest; an env var or file that is missing or empty is an error naming it."""
        if self.sha256 is not None:
            return self.sha256
        return digest(yamlconf.read_secret(self.env, self.file, f"key {self.name!r}: "))


class AuthConfig(StrictModel):
    """API keys; none configured: the gateway is open (and forwards Authorization as it came)."""

    keys: list[KeyConfig] = Field(default_factory=list, description="the API keys clients may send "
                                  "(Authorization: Bearer KEY)")
    forward_authorization: bool = False  # with keys on: pass the client's Authorization upstream
    admin_token_env: str | None = Field(None, description="an environment variable holding the admin API's own "
                                        "token (Authorization: Bearer TOKEN on /admin/); clients need no key")
    admin_token_file: str | None = Field(None, description="a file holding the admin token (surrounding "
                                         "whitespace ignored)")

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[KeyConfig]) -> list[KeyConfig]:
        yamlconf.unique_items((k.name for k in keys), "key names", "keys")
        for k in keys:
            k.key_digest()  # fail at load, naming the key, not at the first request
        return keys

    @model_validator(mode="after")
    def _admin_token(self) -> AuthConfig:
        if self.admin_token_env is not None and self.admin_token_file is not None:
            raise ValueError("give the admin token one source: admin_token_env or admin_token_file")
        self.admin_digest()  # a missing variable or file fails at load, naming it
        return self

    def admin_digest(self) -> str | None:
        """The admin token's digest (None: no admin token configured)."""
        if self.admin_token_env is None and self.admin_token_file is None:
            return None
        return digest(yamlconf.read_secret(self.admin_token_env, self.admin_token_file, "auth admin token: "))

    def key_ring(self, now: float) -> KeyRing:
        """The keys as the gateway checks them."""
        ring = KeyRing(admin_digest=self.admin_digest())
        for k in self.keys:
            ring.keys[k.key_digest()] = KeyState(
                k.name, k.admin, TokenBucket(k.requests_per_min, now) if k.requests_per_min else None,
                TokenBucket(k.tokens_per_min, now) if k.tokens_per_min else None, zone=k.zone)
        return ring


class PeerConfig(StrictModel):
    """Another region's gateway this one may forward to (and probes)."""

    name: str = Field(description="the peer's name in metrics, logs and x-kvroute-peer")
    url: str = Field(description="the peer gateway's base URL, http://host:port")
    region: str = Field(description="the peer's region")
    zone: str | None = Field(None, description="the peer's residency zone; default: its region")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)


class PeerAuthConfig(StrictModel):
    """The token gateways share to authenticate forwards and status probes to each other."""

    token_env: str | None = Field(None, description="an environment variable holding the shared peer token")
    token_file: str | None = Field(None, description="a file holding the shared peer token (surrounding "
                                   "whitespace ignored)")

    @model_validator(mode="after")
    def _one_source(self) -> PeerAuthConfig:
        if (self.token_env is None) == (self.token_file is None):
            raise ValueError("peer_auth needs exactly one of token_env, token_file")
        self.token()  # a missing variable or file fails at load, naming it
        return self

    def token(self) -> str:
        """The shared token; unset, unreadable or empty is an error naming its source."""
        return yamlconf.read_secret(self.token_env, self.token_file, "peer_auth: ")


RoutingMode = Literal["local", "skywalker", "gorgo_distributed", "gorgo_proxy"]
PEERING_MODES = ("skywalker", "gorgo_distributed")  # the routing modes that forward to peers
SGLANG_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port (srt/server_args.py)


class PDConfig(PDPolicySpec):
    """Prefill/decode disaggregation: the wire protocol the engines speak and how pairs are chosen
    (docs/pd.md)."""

    protocol: Literal["vllm", "sglang"] = Field(description="vllm: prefill with kv_transfer_params, then decode "
                                                "with what the prefill returned (NixlConnector); sglang: "
                                                "bootstrap_host/port/room injected, both requests sent at once")


class GatewayConfig(StrictModel):
    """The whole ``kvroute serve --config`` file: listener, replicas, policy, queueing, retries, timeouts,
    auth, peers."""

    host: str = Field("127.0.0.1", description="address to listen on (`--host`)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on; 0: any free port (`--port`)")
    region: str = Field("local", description="the gateway's own region; replicas elsewhere are remote to it")
    policy: str | dict[str, Any] = Field("auto", description="a preset name, `{preset, params}`, or a "
                                         "composition of plugins (docs/policies.md; `kvroute policies`)")
    replicas: list[ReplicaConfig] = Field(default_factory=list, description="the engines behind the gateway")
    discovery: list[Source] = Field(default_factory=list, description="where more engines come from at run "
                                    "time: kubernetes (EndpointSlices), dns (a headless Service), file "
                                    "(re-read on change); see kvroute/discovery")
    zone: str | None = Field(None, description="the gateway's residency zone; default: its region")
    peers: list[PeerConfig] = Field(default_factory=list, description="other regions' gateways; "
                                    "`skywalker` and `gorgo_distributed` forward to them, other modes ignore them")
    peer_auth: PeerAuthConfig | None = Field(None, description="the shared peer token; without it forwarded "
                                             "requests and peer status probes are refused (401)")
    routing_mode: RoutingMode = Field("local", description="local: own replicas only; skywalker: forward to a "
                                      "peer when no local replica admits; gorgo_distributed: forward a held "
                                      "request (no local replica admits it) when a peer's advertised cost plus "
                                      "RTT is lower; gorgo_proxy: one gateway over "
                                      "every region's replicas, RTT in the cost, no peers")
    max_hops: int = Field(1, ge=1, description="how many gateways a request may be forwarded through")
    probe: ProbeConfig = Field(default_factory=ProbeConfig, description="how the engines' metrics are read")
    queue: QueueConfig = Field(default_factory=QueueConfig, description="the gateway's queue of requests the "
                               "policy holds")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="retries before any byte reached the client")
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig, description="upstream timeouts")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig, description="a circuit breaker per replica")
    stall: StallConfig = Field(default_factory=StallConfig, description="stall detection from request progress")
    http: HTTPConfig = Field(default_factory=HTTPConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    tls: TLSConfig | None = None  # serve HTTPS (cert_file, key_file)
    tracing: TracingConfig = Field(default_factory=lambda: TracingConfig())
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="largest request body; beyond: 413")
    replica_header: bool = True  # x-kvroute-replica on responses
    session_headers: list[str] = Field(default_factory=lambda: ["x-session-id", "x-hash-key", "x-user-id"],
                                       description="request headers whose value is the session affinity key, "
                                       "first present wins; else the body's `user`")
    block_tokens: int = Field(64, gt=0, description="tokens per prefix block when hashing prompts")
    max_prefix_blocks: int = Field(256, ge=0)  # leading blocks indexed per prompt (llm-d: 256); 0 = all
    tokenizer_path: str | None = Field(None, description="a local HF tokenizer.json: blocks of exact token ids "
                                       "instead of about 4 bytes per token; or a model folder (tokenizer.json, "
                                       "tokenizer_config.json, chat template): the engine's own token ids, "
                                       "which engine KV events need; never downloaded")
    kv_events: KVEventsSettings = Field(default_factory=KVEventsSettings, description="consuming the replicas' "
                                        "KV-cache events (replicas[].kv_events)")
    access_log: bool = True  # one structured line per request (ids, replica, branch, timings)
    log_prompts: bool = False  # add the prompt's canonical key (truncated) to access lines
    drain_delay_s: float = Field(0.0, ge=0)  # on SIGTERM: /readyz 503 but still serving, this long
    drain_timeout_s: float = Field(30.0, gt=0)  # then in-flight requests get this long to finish
    seed: int = Field(0, description="seeds the policy's random choices")
    fleet: FleetConfig | None = Field(None, description="several instances of this gateway in one region, "
                                      "sharing in-flight load and queue over NATS")
    pd: PDConfig | None = Field(None, description="prefill/decode disaggregation: replicas with role prefill "
                                "and decode, the protocol and the pair's policies (docs/pd.md); `policy` then "
                                "does not apply: give pd.decode_policy")

    @field_validator("policy")
    @classmethod
    def _policy(cls, v):
        return checked(policy_from_config, v)

    @field_validator("replicas")
    @classmethod
    def _unique(cls, replicas: list[ReplicaConfig]) -> list[ReplicaConfig]:
        """A repeated id names the second entry's line and says how to tell them apart."""
        hit = yamlconf.first_repeat(r.name for r in replicas)
        if hit is not None:
            i, first = hit
            r = replicas[i]
            how = ("give each its own id:" if r.id is not None else
                   f"the id defaults to host:port; if both are meant, give each an id:, e.g. id: {r.name}-{i}")
            raise yamlconf.AtItem(f"replica ids must be unique; repeated: {r.name} (as in replicas[{first}]); "
                                  f"{how}", (i,))
        return replicas

    @field_validator("tokenizer_path")
    @classmethod
    def _tokenizer(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if Path(v).is_dir():  # a model folder: the engine's tokenizer and chat template (kvevents/tokenize.py)
            if not (Path(v) / "tokenizer.json").is_file():
                raise ValueError(f"folder {v!r} has no tokenizer.json: give a local model or tokenizer folder, "
                                 "or the path of a tokenizer.json")
        elif not Path(v).is_file():
            raise ValueError(f"no such file or folder {v!r}: give a local HF tokenizer.json or model folder "
                             "(kvroute never downloads one), or remove tokenizer_path to estimate tokens from bytes")
        from importlib.util import find_spec

        if find_spec("tokenizers") is None:
            raise ValueError("tokenizer_path needs the optional 'tokenizers' package: "
                             "pip install 'kvroute[tokenizers]'")
        return v

    @model_validator(mode="after")
    def _events_installed(self) -> GatewayConfig:
        if any(r.kv_events is not None for r in self.replicas):
            events_extra_installed()
        return self

    @field_validator("peers")
    @classmethod
    def _unique_peers(cls, peers: list[PeerConfig]) -> list[PeerConfig]:
        yamlconf.unique_items((p.name for p in peers), "peer names", "peers")
        return peers

    @model_validator(mode="after")
    def _replicas_at_home(self) -> GatewayConfig:
        self.replicas = [self.placed(r) for r in self.replicas]
        return self

    def placed(self, replica: ReplicaConfig) -> ReplicaConfig:
        """``replica`` in this gateway's region (and so its zone) when it names no region of its own
        and this config sets one — a request pinned to the gateway's region then finds it."""
        if "region" in replica.model_fields_set or "region" not in self.model_fields_set:
            return replica
        return replica.model_copy(update={"region": self.region})

    @model_validator(mode="after")
    def _peer_mode(self) -> GatewayConfig:
        clash = sorted({p.name for p in self.peers} & {r.name for r in self.replicas})
        if clash:
            raise ValueError(f"peer names must differ from replica ids; both: {', '.join(clash)}")
        if self.routing_mode in PEERING_MODES:
            if not self.peers:
                raise ValueError(f"routing_mode {self.routing_mode} forwards to peers: list them under peers")
            if self.peer_auth is None:
                raise ValueError(f"routing_mode {self.routing_mode} needs peer_auth (token_env or token_file)")
        if self.peers and self.peer_auth is None:  # probes without the token are refused: every peer ejected
            raise ValueError("peers need peer_auth (token_env or token_file): the shared token their status "
                             "probes and forwards carry")
        if self.fleet is not None and self.fleet.scope == "all" and self.routing_mode in PEERING_MODES:
            # the siblings' queues would count as this region's in the peer status and the forward gate
            raise ValueError(f"fleet.scope all is for gateways that each route to every region's replicas "
                             f"(routing_mode local); with routing_mode {self.routing_mode} keep scope: region")
        return self

    @model_validator(mode="after")
    def _pd_roles(self) -> GatewayConfig:
        """Roles need `pd:`, `pd:` needs roles, and each side needs the other (one line, at the replica)."""
        roles: list[str] = [r.role for r in self.replicas]
        split = [i for i, role in enumerate(roles) if role != "mixed"]
        if self.pd is None:
            if split:
                i = split[0]
                raise yamlconf.AtItem(f"role {roles[i]} needs a `pd:` section naming the protocol (vllm or sglang)",
                                      ("replicas", i, "role"))
            return self
        if "policy" in self.model_fields_set:
            raise yamlconf.AtItem("with `pd:` the decode engine is chosen by pd.decode_policy and the prefill "
                                  "engine by pd.prefill_policy; remove `policy`", ("policy",))
        if not split and not self.discovery:  # discovered engines bring their roles at run time
            raise yamlconf.AtItem("pd: no replica has role prefill or decode", ("pd",))
        why = role_check(roles) if not self.discovery else None
        if why is not None:
            lonely = "prefill" if "no decode" in why else "decode"
            raise yamlconf.AtItem(why, ("replicas", roles.index(lonely), "role"))
        if self.pd.protocol == "sglang":
            if "mixed" in roles:
                raise yamlconf.AtItem("protocol sglang: an SGLang engine is started in prefill or decode mode "
                                      "(--disaggregation-mode); give every replica one of those roles",
                                      ("replicas", roles.index("mixed"), "role"))
            if self.pd.disaggregate != "always":
                raise yamlconf.AtItem("protocol sglang: SGLang decode engines cannot prefill alone, so every "
                                      "request is split; use disaggregate: always", ("pd", "disaggregate"))
            self.replicas = [r if r.role == "decode" or r.bootstrap_port is not None
                             else r.model_copy(update={"bootstrap_port": SGLANG_BOOTSTRAP_PORT})
                             for r in self.replicas]
        return self

    @property
    def policy_label(self) -> str:
        """The policy's name in metrics and logs: the preset's, or ``composed`` for a composition
        that names itself nothing."""
        policy = self.policy
        if isinstance(policy, str):
            return policy
        return str(policy.get("preset") or policy.get("name") or "composed")

    @property
    def home_zone(self) -> str:
        """The gateway's residency zone (its region unless set)."""
        return self.zone or self.region

    def http_limits(self) -> HTTPLimits:
        """The HTTP server's limits, body size included."""
        return HTTPLimits(max_body_bytes=self.max_body_bytes, **self.http.model_dump())

    def build_policy(self):
        """A fresh Policy for ``policy`` (a preset name, preset with params, or composition), seeded with
        ``seed``; with `pd:` the decode side's."""
        if self.pd is not None:
            return policy_from_config(self.pd.decode_policy, seed=self.seed)
        return policy_from_config(self.policy, seed=self.seed)

    def build_router(self, **kwargs: Any):
        """The Router for this config: a PDRouter (both sides' policies) with `pd:`, else a Router."""
        from kvroute.policy import Router
        from kvroute.policy.pd import PDRouter

        if self.pd is not None:
            return PDRouter.from_spec(self.pd, self.seed, decode_alone=self.pd.protocol != "sglang", **kwargs)
        return Router(self.build_policy(), **kwargs)


def load_config(path: str) -> GatewayConfig:
    """Read and validate a gateway YAML file; a ConfigFileError names file:line and the field.
    Presets shipped outside kvroute (entry points) are loaded first, so the file may name them."""
    try:
        load_entry_points()
    except ConfigError as exc:
        raise yamlconf.ConfigFileError(str(exc)) from None
    return yamlconf.load(GatewayConfig, path)
