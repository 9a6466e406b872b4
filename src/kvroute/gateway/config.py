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
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvroute import yamlconf
from kvroute.gateway.auth import KeyRing, KeyState, TokenBucket, digest
from kvroute.gateway.http import HTTPLimits
from kvroute.policy import DEFAULT_TICK_S, ConfigError, policy_from_config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaConfig(_Strict):
    url: str
    id: str | None = None
    region: str = "local"
    engine: Literal["auto", "vllm", "sglang", "llamacpp"] = "auto"
    weight: float = Field(1.0, gt=0)
    # the engine's KV-cache capacity in tokens and batch limit; the prefix index of this replica is
    # bounded by the capacity. Unset: learned from vLLM's cache_config_info or SGLang's
    # max_total_num_tokens when probes see them (llama.cpp exports neither: set it, e.g. its -c)
    kv_tokens: int | None = Field(None, gt=0)
    max_running: int | None = Field(None, gt=0)
    # the models this replica serves; unset: read from its /v1/models by the probes
    models: list[str] | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "http" or not parts.netloc:
            raise ValueError(f"url must be http://host:port (engines are reached over plain HTTP "
                             f"inside the cluster), got {v!r}")
        return v.rstrip("/")

    @property
    def name(self) -> str:
        return self.id or urlsplit(self.url).netloc


class ProbeConfig(_Strict):
    interval_s: float = Field(0.1, gt=0)  # SkyWalker probes every 100 ms
    timeout_s: float = Field(0.5, gt=0)
    unhealthy_after: int = Field(3, ge=1)  # consecutive probe failures → ejected
    healthy_after: int = Field(2, ge=1)  # consecutive successes → re-admitted
    rtt_ewma: float = Field(0.3, gt=0, le=1)  # GORGO's RTT smoothing
    models_every_s: float = Field(10.0, gt=0)  # how often /v1/models is read, for model routing


class QueueConfig(_Strict):
    max_len: int = Field(1024, ge=0)  # beyond this: 429
    max_wait_s: float = Field(30.0, gt=0)  # waited longer: 503
    # at most one request leaves the queue per tick (SkyWalker's 10 ms queue processor); 0: no pacing
    dispatch_tick_s: float = Field(DEFAULT_TICK_S, ge=0)


class RetryConfig(_Strict):
    max_attempts: int = Field(3, ge=1)
    backoff_s: float = Field(0.02, ge=0)
    backoff_max_s: float = Field(0.5, ge=0)


class TimeoutConfig(_Strict):
    connect_s: float = Field(2.0, gt=0)
    # until the first body byte: per attempt, and in all for every attempt of one request
    first_byte_s: float = Field(60.0, gt=0)
    first_byte_total_s: float = Field(120.0, gt=0)
    idle_s: float = Field(60.0, gt=0)  # between body pieces once the response has begun


class BreakerConfig(_Strict):
    failures: int = Field(5, ge=1)  # consecutive failures → open
    cooldown_s: float = Field(5.0, gt=0)  # then half-open: one trial request at a time
    successes: int = Field(1, ge=1)  # consecutive good trials that close it again


class HTTPConfig(_Strict):
    """Limits on what one client can hold (see ``gateway/http.py``)."""

    max_head_bytes: int = Field(64 * 1024, ge=1024)
    max_headers: int = Field(100, ge=8)
    header_timeout_s: float = Field(10.0, gt=0)  # to send a whole request head (slowloris)
    body_timeout_s: float = Field(60.0, gt=0)  # to send a whole body, once the head is in
    keepalive_timeout_s: float = Field(30.0, gt=0)  # an idle kept-alive connection is closed
    max_connections: int = Field(4096, ge=1)  # beyond: 503 and close


class KeyConfig(_Strict):
    """One API key: its digest, or where to read it (hashed when the config loads), and limits."""

    name: str
    sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$")  # sha256 hex digest of the key
    env: str | None = None  # an environment variable holding the key
    file: str | None = None  # a file holding the key (surrounding whitespace ignored)
    requests_per_min: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)  # prompt estimate + max_tokens, at admission
    admin: bool = False  # may use the admin API

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
        if self.env is not None:
            value = os.environ.get(self.env, "").strip()
            if not value:
                raise ValueError(f"key {self.name!r}: environment variable {self.env} is unset or empty")
        else:
            try:
                value = Path(str(self.file)).read_text().strip()
            except OSError as exc:
                raise ValueError(f"key {self.name!r}: cannot read {self.file}: {exc.strerror}") from None
            if not value:
                raise ValueError(f"key {self.name!r}: {self.file} is empty")
        return digest(value)


class AuthConfig(_Strict):
    """API keys; none configured: the gateway is open (and forwards Authorization as it came)."""

    keys: list[KeyConfig] = Field(default_factory=list)
    forward_authorization: bool = False  # with keys on: pass the client's Authorization upstream

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[KeyConfig]) -> list[KeyConfig]:
        names = [k.name for k in keys]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"key names must be unique; repeated: {', '.join(dup)}")
        for k in keys:
            k.key_digest()  # fail at load, naming the key, not at the first request
        return keys

    def key_ring(self, now: float) -> KeyRing:
        """The keys as the gateway checks them."""
        ring = KeyRing()
        for k in self.keys:
            ring.keys[k.key_digest()] = KeyState(
                k.name, k.admin, TokenBucket(k.requests_per_min, now) if k.requests_per_min else None,
                TokenBucket(k.tokens_per_min, now) if k.tokens_per_min else None)
        return ring


class GatewayConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    region: str = "local"
    policy: str | dict[str, Any] = "skywalker"
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    http: HTTPConfig = Field(default_factory=HTTPConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    replica_header: bool = True  # x-kvroute-replica on responses
    session_headers: list[str] = Field(default_factory=lambda: ["x-session-id", "x-hash-key", "x-user-id"])
    block_tokens: int = Field(64, gt=0)
    max_prefix_blocks: int = Field(256, ge=0)  # leading blocks indexed per prompt (llm-d: 256); 0 = all
    tokenizer_path: str | None = None
    access_log: bool = True  # one structured line per request (ids, replica, branch, timings)
    log_prompts: bool = False  # add the prompt's canonical key (truncated) to access lines
    drain_delay_s: float = Field(0.0, ge=0)  # on SIGTERM: /readyz 503 but still serving, this long
    drain_timeout_s: float = Field(30.0, gt=0)  # then in-flight requests get this long to finish
    seed: int = 0

    @field_validator("policy")
    @classmethod
    def _policy(cls, v):
        try:
            policy_from_config(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _unique(self) -> GatewayConfig:
        names = [r.name for r in self.replicas]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"replica ids must be unique; repeated: {', '.join(dup)}")
        return self

    def http_limits(self) -> HTTPLimits:
        """The HTTP server's limits, body size included."""
        return HTTPLimits(max_body_bytes=self.max_body_bytes, **self.http.model_dump())

    def build_policy(self):
        return policy_from_config(self.policy, seed=self.seed)


def load_config(path: str) -> GatewayConfig:
    return yamlconf.load(GatewayConfig, path)
