"""An engine replica as every runtime that reaches one sees it — the gateway, discovery, the
controller, live runs: its config (:class:`ReplicaConfig`, with its KV-event source
:class:`ReplicaEventsConfig`) and the validators of the addresses it names. Below the gateway and
discovery in the layers, so discovery builds replicas without naming the gateway.
"""

from __future__ import annotations

import ssl
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvroute.policy.adaptive.replica_speed.datasheet import accelerator_key
from kvroute.schema import StrictModel


def base_url(v: str) -> str:
    """``v`` as a base URL without its trailing slash; anything but http(s)://host[:port]... is a ValueError."""
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"url must be http://host:port or https://host:port, got {v!r}")
    return v.rstrip("/")


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
    accelerator: str | None = Field(None, description="the GPU the replica runs on (a100-80gb, a100-40gb, h100, h200, "
                                    "l4, l40s, a10, ... or a node's nvidia.com/gpu.product label, e.g. NVIDIA-L4): "
                                    "`auto` reads its public datasheet numbers (BF16 TFLOPS, memory bandwidth) as a "
                                    "prior of the replica's relative speed until it has measured the replica; unset: "
                                    "learned from measurements alone")
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

    @field_validator("accelerator")
    @classmethod
    def _accelerator(cls, v: str | None) -> str | None:
        return None if v is None else accelerator_key(v)

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


def events_extra_installed() -> None:
    """KV events need pyzmq and msgspec (the ``events`` extra): a ValueError saying so otherwise."""
    from importlib.util import find_spec

    missing = [m for m in ("zmq", "msgspec") if find_spec(m) is None]
    if missing:
        raise ValueError(f"replicas[].kv_events needs the optional 'events' extra (missing: {', '.join(missing)}): "
                         "pip install 'kvroute[events]'")


