"""The ``discovery:`` section of gateway.yaml: where engines come from besides ``replicas:``.

    discovery:
      - kind: kubernetes            # EndpointSlices of a Service, watched
        service: vllm-engines
        port: http                  # the slice port (name or number) the engine serves on
        kv_events_port: kv-events   # optional: a slice port that is the pod's KV-event endpoint
        role_label: llm-d.ai/role   # pod label: prefill | decode | prefill-decode
      - kind: dns                   # a headless Service's A (or SRV) records, re-resolved
        name: vllm-engines.llm.svc.cluster.local
        port: 8000
      - kind: file                  # a list of replicas: entries, re-read when it changes
        path: /etc/kvroute/engines.yaml
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from kvroute.replicas import ReplicaConfig
from kvroute.schema import StrictModel

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where the kubelet mounts the pod's token


def check_defaults(v: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` are fields of a ``replicas:`` entry given to every engine a source finds;
    ``url`` and ``id`` come from the source itself."""
    own = sorted({"url", "id"} & v.keys())
    if own:
        raise ValueError(f"defaults may not set {', '.join(own)}: the source gives each engine its own")
    probe = dict(v)
    if isinstance(probe.get("kv_events"), dict):  # settings for every pod's publisher; the endpoint is per pod
        probe["kv_events"] = {"endpoint": "tcp://127.0.0.1:1", **probe["kv_events"]}
    ReplicaConfig.model_validate({"url": "http://127.0.0.1:1", **probe})  # unknown or bad fields fail at load
    return v


class _Source(StrictModel):
    defaults: dict[str, Any] = Field(default_factory=dict, description="fields of a replicas: entry (engine, "
                                     "region, kv_tokens, ...) given to every engine this source finds")

    @field_validator("defaults")
    @classmethod
    def _defaults(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_defaults(v)


class KubernetesSource(_Source):
    """A Service's ready endpoints, from the EndpointSlice API (list, then watch)."""

    kind: Literal["kubernetes"] = Field(description="this source's kind")
    scheme: Literal["http", "https"] = Field("http", description="how the engines are reached")
    service: str = Field(description="the Service whose EndpointSlices list the engines")
    namespace: str | None = Field(None, description="its namespace; default: the gateway pod's own")
    port: int | str | None = Field(None, description="the slice port (name or number) engines serve on; "
                                   "default: the slice's first port")
    kv_events_port: int | str | None = Field(None, description="a slice port that is each pod's KV-event "
                                             "publisher (tcp://ip:port)")
    kv_events_annotation: str | None = Field("kvroute.io/kv-events", description="pod annotation naming the "
                                             "KV-event endpoint (tcp://host:port, or a port of the pod's IP)")
    bootstrap_port_annotation: str | None = Field("sglang.ai/bootstrap-port", description="pod annotation with "
                                                  "an SGLang prefill engine's KV bootstrap port (SGLang's router "
                                                  "reads the same one)")
    role_label: str | None = Field("llm-d.ai/role", description="pod label giving the role: prefill, decode or "
                                   "prefill-decode; unset: every engine does both")
    api_server: str | None = Field(None, description="API server base URL; default: in-cluster, from "
                                   "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT")
    token_file: str = Field(f"{SA_DIR}/token", description="bearer token (the service account's; re-read, "
                            "since the kubelet rotates it)")
    ca_file: str | None = Field(f"{SA_DIR}/ca.crt", description="CA bundle the API server's certificate "
                                "is checked against")
    watch_timeout_s: int = Field(300, ge=1, description="each watch asks the server to end after this long; "
                                 "it is then resumed from the last resourceVersion")
    retry_s: float = Field(2.0, gt=0, description="wait before relisting after an API error")

    @model_validator(mode="after")
    def _reachable(self) -> KubernetesSource:
        self.resolved_api_server()  # out of a cluster without api_server: fails at load, with file:line
        return self

    def resolved_namespace(self) -> str:
        """``namespace``, else the pod's own (the service account's namespace file), else default."""
        if self.namespace:
            return self.namespace
        try:
            return Path(f"{SA_DIR}/namespace").read_text().strip() or "default"
        except OSError:
            return "default"

    def resolved_api_server(self) -> str:
        """The API server's base URL; out of a cluster with none configured, a ValueError."""
        if self.api_server:
            return self.api_server.rstrip("/")
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("discovery kind kubernetes: not in a cluster (KUBERNETES_SERVICE_HOST unset) and "
                             "no api_server given")
        return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class DNSSource(_Source):
    """A headless Service's records: A/AAAA with one ``port``, or SRV (each target with its port)."""

    kind: Literal["dns"] = Field(description="this source's kind")
    scheme: Literal["http", "https"] = Field("http", description="how the engines are reached")
    name: str = Field(description="the name to resolve, e.g. engines.ns.svc.cluster.local (A records), or "
                      "_http._tcp.engines.ns.svc.cluster.local with srv: true")
    port: int | None = Field(None, ge=1, le=65535, description="the engines' port (A records carry none)")
    srv: bool = Field(False, description="resolve SRV records: each target and port is an engine")
    interval_s: float = Field(5.0, gt=0, description="re-resolved this often")
    nameserver: str | None = Field(None, description="host or host:port of the DNS server; default: the first "
                                   "nameserver in /etc/resolv.conf")
    timeout_s: float = Field(2.0, gt=0, description="one query's time limit")

    @model_validator(mode="after")
    def _port_known(self) -> DNSSource:
        if not self.srv and self.port is None:
            raise ValueError("dns discovery of A records needs port: (or srv: true to read ports from SRV records)")
        return self


class FileSource(_Source):
    """A YAML or JSON list of ``replicas:`` entries (or ``{replicas: [...]}``), re-read when it changes."""

    kind: Literal["file"] = Field(description="this source's kind")
    path: str = Field(description="the file; a mounted ConfigMap is swapped atomically by the kubelet")
    interval_s: float = Field(2.0, gt=0, description="checked for changes this often")


Source = Annotated[KubernetesSource | DNSSource | FileSource, Field(discriminator="kind")]


def source_label(s: KubernetesSource | DNSSource | FileSource, i: int) -> str:
    """A short name for logs and metrics: kind, what it watches and its position."""
    what = s.service if isinstance(s, KubernetesSource) else s.name if isinstance(s, DNSSource) else s.path
    return f"{s.kind}[{i}]:{what}"
