"""Gateway configuration (YAML, validated with pydantic; errors name file:line and the field).

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

import os
import ssl
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvroute import yamlconf
from kvroute.discovery.config import Source
from kvroute.errors import ConfigError
from kvroute.gateway.auth import KeyRing, KeyState, TokenBucket, digest
from kvroute.gateway.http import HTTPLimits
from kvroute.gateway.tracing import Tracer
from kvroute.policy import DEFAULT_TICK_S, policy_from_config
from kvroute.policy.pd import PDPolicySpec, role_check
from kvroute.policyfiles import load_entry_points
from kvroute.schema import StrictModel


def base_url(v: str) -> str:
    """``v`` as a base URL without its trailing slash; anything but http(s)://host[:port]... is a ValueError."""
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"url must be http://host:port or https://host:port, got {v!r}")
    return v.rstrip("/")


def read_secret(env: str | None, file: str | None, owner: str = "") -> str:
    """A secret from the environment variable ``env`` or else from ``file`` (surrounding whitespace
    dropped), so that keys and tokens never sit in the YAML; unset, unreadable or empty is a
    ValueError naming the source, after ``owner`` (e.g. ``"peer_auth: "``)."""
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ValueError(f"{owner}environment variable {env} is unset or empty")
        return value
    try:
        value = Path(str(file)).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{owner}cannot read {file}: {exc.strerror}") from None
    if not value:
        raise ValueError(f"{owner}{file} is empty")
    return value


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def zmq_endpoint(v: str, what: str) -> str:
    """``v`` if it is an endpoint a subscriber can connect to: tcp://host:port, ipc://path or
    inproc://name (a ``*`` host is where an engine binds, not an address to dial)."""
    if not v.startswith(_ZMQ_SCHEMES):
        raise ValueError(f"{what} must start with one of {', '.join(_ZMQ_SCHEMES)}, got {v!r}")
    if v.startswith("tcp://"):
        host, _, port = v[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what} must be tcp://host:port with a port from 1 to 65535, got {v!r}")
        if host == "*":
            raise ValueError(f"{what} {v!r} is the engine's bind address; give the host to connect to, "
                             "e.g. tcp://10.0.0.5:5557")
    return v


class ReplicaEventsConfig(StrictModel):
    """Where a replica publishes its KV-cache events (vLLM ``--kv-events-config``, SGLang alike):
    the gateway subscribes and keeps the replica's exact cache in its prefix index."""

    endpoint: str = Field(description="the engine's event PUB endpoint to connect to, tcp://host:port "
                          "(the engine binds tcp://*:port)")
    replay_endpoint: str | None = Field(None, description="the engine's replay ROUTER endpoint, tcp://host:port; "
                                        "without it gaps cannot be recovered (the replica goes stale)")
    topic: str = Field("", description="the engine's topic (first frame); subscribed as a prefix")
    dp_ranks: int = Field(1, ge=1, le=1024, description="data-parallel ranks publishing, on consecutive ports "
                          "from endpoint's (and replay_endpoint's)")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        return zmq_endpoint(v, "endpoint")

    @field_validator("replay_endpoint")
    @classmethod
    def _replay(cls, v: str | None) -> str | None:
        return None if v is None else zmq_endpoint(v, "replay_endpoint")


class ReplicaConfig(StrictModel):
    """One engine replica behind the gateway: where it is, what it runs and how to reach it."""

    url: str = Field(description="the engine's base URL, http://host:port")
    id: str | None = Field(None, description="its name in metrics, logs and x-kvroute-replica; default: host:port "
                           "of the url (two replicas at one address need one each)")
    region: str = Field("local", description="the replica's region; default: the gateway's `region` when "
                        "the config sets one, else local")
    zone: str | None = Field(None, description="the replica's residency zone; default: its region")
    engine: Literal["auto", "vllm", "sglang", "llamacpp"] = Field(
        "auto", description="which engine's metrics the probes read; auto: detected from /metrics")
    weight: float = Field(1.0, gt=0, description="relative share for policies that weigh replicas")
    # the engine's KV-cache capacity in tokens and batch limit; the prefix index of this replica is
    # bounded by the capacity. Unset: learned from vLLM's cache_config_info or SGLang's
    # max_total_num_tokens when probes see them (llama.cpp exports neither: set it, e.g. its -c)
    kv_tokens: int | None = Field(None, gt=0)
    max_running: int | None = Field(None, gt=0, description="the engine's batch limit (requests running at "
                                    "once); unset: learned from the engine's metrics where they say")
    # the models this replica serves; unset: read from its /v1/models by the probes
    models: list[str] | None = None
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="prefill/decode disaggregation (needs `pd:`): prefill engines compute prompts and "
        "hand the KV cache to decode engines; mixed engines do both")
    bootstrap_port: int | None = Field(None, ge=1, le=65535, description="SGLang prefill engines: the port of "
                                       "their KV bootstrap server (--disaggregation-bootstrap-port); default 8998, "
                                       "SGLang's own default")
    kv_events: ReplicaEventsConfig | None = Field(None, description="the replica's KV-cache events; unset: "
                                                  "its prefix index is the gateway's approximate one")

    ca_file: str | None = None  # https: trust this CA bundle (e.g. a self-signed engine's certificate)
    tls_verify: bool = True  # https: check the engine's certificate and name

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return base_url(v)

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS settings for an https engine (None for http)."""
        if not self.url.startswith("https://"):
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"ca_file {self.ca_file}: {exc}") from None
        if not self.tls_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    @model_validator(mode="after")
    def _tls_loads(self) -> ReplicaConfig:
        self.tls_context()
        return self

    @property
    def name(self) -> str:
        """The replica's id: ``id`` when given, else host:port of its URL."""
        return self.id or urlsplit(self.url).netloc


class ProbeConfig(StrictModel):
    """How often and how patiently replicas (and peers) are probed, and when a streak of results ejects or
    re-admits one."""

    interval_s: float = Field(0.1, gt=0)  # SkyWalker probes every 100 ms
    idle_interval_s: float = Field(1.0, gt=0, description="a replica with nothing in flight and nothing running "
                                   "or waiting at its last probe is probed less often: the wait doubles from "
                                   "interval_s up to this; a dispatch to it restores interval_s (set it equal to "
                                   "interval_s for a fixed rate)")
    timeout_s: float = Field(0.5, gt=0, description="a probe that takes longer fails")
    unhealthy_after: int = Field(3, ge=1)  # consecutive probe failures → ejected
    healthy_after: int = Field(2, ge=1)  # consecutive successes → re-admitted
    rtt_ewma: float = Field(0.3, gt=0, le=1)  # GORGO's RTT smoothing
    models_every_s: float = Field(10.0, gt=0)  # how often /v1/models is read, for model routing


class KVEventsSettings(StrictModel):
    """How the gateway consumes the replicas' KV-cache events (``replicas[].kv_events``)."""

    stale_s: float = Field(30.0, gt=0, description="after a gap replay cannot fill, the replica is routed on the "
                           "approximate index for this long while events rebuild its table")
    speculative_ttl_s: float = Field(2.0, ge=0, description="a routed prompt counts as cached on its replica for "
                                     "this long unless its BlockStored arrives first (0: off)")
    replay_timeout_s: float = Field(2.0, gt=0, description="a replay that sends nothing for this long failed")


class QueueConfig(StrictModel):
    """The gateway's own FIFO for requests a policy holds: its length limit, wait limit and dispatch pacing."""

    max_len: int = Field(1024, ge=0)  # beyond this: 429
    max_wait_s: float = Field(30.0, gt=0)  # waited longer: 503
    # at most one request leaves the queue per tick (SkyWalker's 10 ms queue processor); 0: no pacing
    dispatch_tick_s: float = Field(DEFAULT_TICK_S, ge=0)


class RetryConfig(StrictModel):
    """Retrying a failed attempt on another replica, and continuing a stream that broke or outgrew its
    replica."""

    max_attempts: int = Field(3, ge=1, description="attempts per request, the first included, each on another "
                              "replica when one is left")
    backoff_s: float = Field(0.02, ge=0, description="wait before the first retry; doubles per attempt, with jitter")
    backoff_max_s: float = Field(0.5, ge=0, description="longest wait between attempts")
    max_continuations: int = Field(2, ge=0, description="times one streamed chat or completions request may "
                                   "be continued on another replica with its prompt plus the text generated so "
                                   "far: when its replica fails mid-stream, or when it outgrows the replica's "
                                   "stage (a policy's context_limit); 0: never (a mid-stream failure ends the "
                                   "stream with an SSE error)")


class TimeoutConfig(StrictModel):
    """Time limits of one proxied request: connect, first byte, gaps between body pieces, a whole non-streamed
    response."""

    connect_s: float = Field(2.0, gt=0, description="to open a connection to a replica")
    # until the first body byte: per attempt, and in all for every attempt of one request
    first_byte_s: float = Field(60.0, gt=0)
    first_byte_total_s: float = Field(120.0, gt=0, description="until the first body byte, over every attempt "
                                      "of one request")
    idle_s: float = Field(60.0, gt=0)  # between body pieces once the response has begun
    non_stream_s: float = Field(600.0, gt=0, description="a whole non-streamed response, per attempt: an "
                                "engine answers it when generation ends, so first_byte_s would cut it short")
    non_stream_total_s: float = Field(600.0, gt=0, description="a non-streamed response over every attempt; "
                                      "equal to non_stream_s by default, so a slow generation that times out "
                                      "is not started again on another replica")


class BreakerConfig(StrictModel):
    """Per-replica circuit breaker: consecutive failures that open it, the cooldown, trials that close it."""

    failures: int = Field(5, ge=1)  # consecutive failures → open
    cooldown_s: float = Field(5.0, gt=0)  # then half-open: one trial request at a time
    successes: int = Field(1, ge=1)  # consecutive good trials that close it again


class StallConfig(StrictModel):
    """Ejecting an engine whose streams all stopped making progress (``gateway/outlier.py``)."""

    enabled: bool = Field(True, description="watch streamed requests' progress; eject an engine none of whose "
                          "streams got a token for its threshold, retry or continue them elsewhere")
    factor: float = Field(10.0, gt=0, description="threshold: this many times the longest gap between tokens "
                          "the engine normally shows (a decaying peak)")
    min_s: float = Field(1.0, gt=0, description="the threshold is never shorter (plus the expected prefill of "
                         "prompts still waiting for their first token)")
    max_s: float = Field(3.0, gt=0, description="nor longer (plus that prefill): with the sweep's granularity, "
                         "a frozen engine is out within max_s + 0.25 s")
    canary_interval_s: float = Field(1.0, gt=0, description="while ejected, a one-token request is sent this "
                                     "often; the first answered re-admits the engine")

    @model_validator(mode="after")
    def _bounds(self) -> StallConfig:
        if self.min_s > self.max_s:
            raise ValueError(f"min_s ({self.min_s:g}) must not exceed max_s ({self.max_s:g})")
        return self


class TLSConfig(StrictModel):
    """TLS on the gateway's listener."""

    cert_file: str = Field(description="PEM certificate chain the listener presents")
    key_file: str = Field(description="PEM private key of that certificate")

    def context(self) -> ssl.SSLContext:
        """A server context; unreadable or mismatched files are an error naming them."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"tls: cannot load cert_file {self.cert_file} / key_file {self.key_file}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        return ctx

    @model_validator(mode="after")
    def _loads(self) -> TLSConfig:
        self.context()  # unreadable files fail at load, with the config's file:line
        return self


class TracingConfig(StrictModel):
    """OpenTelemetry spans per request (needs the ``otel`` extra)."""

    enabled: bool = Field(False, description="one span per proxied request, to the process's tracer provider")

    @model_validator(mode="after")
    def _installed(self) -> TracingConfig:
        if self.enabled:
            Tracer(True)  # fails at load, naming the extra, when OpenTelemetry is missing
        return self


class HTTPConfig(StrictModel):
    """Limits on what one client can hold (see ``gateway/http.py``)."""

    max_head_bytes: int = Field(64 * 1024, ge=1024, description="request line and headers; beyond: 431")
    max_headers: int = Field(100, ge=8, description="header fields per request; beyond: 431")
    header_timeout_s: float = Field(10.0, gt=0)  # to send a whole request head (slowloris)
    body_timeout_s: float = Field(60.0, gt=0)  # to send a whole body, once the head is in
    keepalive_timeout_s: float = Field(30.0, gt=0)  # an idle kept-alive connection is closed
    max_connections: int = Field(4096, ge=1)  # beyond: 503 + Retry-After and close
    max_connections_per_client: int = Field(
        1024, ge=1, description="open connections per client address; beyond: 503 + Retry-After and close "
                                "(behind a front proxy every client has its address: set it to max_connections)")


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
        return digest(read_secret(self.env, self.file, f"key {self.name!r}: "))


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
        return digest(read_secret(self.admin_token_env, self.admin_token_file, "auth admin token: "))

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
        return read_secret(self.token_env, self.token_file, "peer_auth: ")


class FleetConfig(StrictModel):
    """Several gateway instances of one region sharing their load over NATS (``kvroute/fleet``):
    every instance lists the same replicas and the same ``nats_url``; a front load balancer
    (HAProxy, checking ``/readyz``) spreads the clients over them."""

    nats_url: str = Field(description="the NATS server, nats://host:port (needs `pip install 'kvroute[fleet]'`)")
    instance: str | None = Field(None, description="this instance's name on the subject; default: "
                                 "host-pid-random, unique per process")
    subject_prefix: str = Field("kvroute.fleet", description="messages go to `<subject_prefix>.<region>`")
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


RoutingMode = Literal["local", "skywalker", "gorgo_distributed", "gorgo_proxy"]
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
                                      "peer when no local replica admits; gorgo_distributed: forward when a "
                                      "peer's advertised cost plus RTT is lower; gorgo_proxy: one gateway over "
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
        try:
            policy_from_config(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

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
        if self.routing_mode in ("skywalker", "gorgo_distributed"):
            if not self.peers:
                raise ValueError(f"routing_mode {self.routing_mode} forwards to peers: list them under peers")
            if self.peer_auth is None:
                raise ValueError(f"routing_mode {self.routing_mode} needs peer_auth (token_env or token_file)")
        if self.peers and self.peer_auth is None:  # probes without the token are refused: every peer ejected
            raise ValueError("peers need peer_auth (token_env or token_file): the shared token their status "
                             "probes and forwards carry")
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


def events_extra_installed() -> None:
    """KV events need pyzmq and msgspec (the ``events`` extra): a ValueError saying so otherwise."""
    from importlib.util import find_spec

    missing = [m for m in ("zmq", "msgspec") if find_spec(m) is None]
    if missing:
        raise ValueError(f"replicas[].kv_events needs the optional 'events' extra (missing: {', '.join(missing)}): "
                         "pip install 'kvroute[events]'")


def load_config(path: str) -> GatewayConfig:
    """Read and validate a gateway YAML file; a ConfigFileError names file:line and the field.
    Presets shipped outside kvroute (entry points) are loaded first, so the file may name them."""
    try:
        load_entry_points()
    except ConfigError as exc:
        raise yamlconf.ConfigFileError(str(exc)) from None
    return yamlconf.load(GatewayConfig, path)
