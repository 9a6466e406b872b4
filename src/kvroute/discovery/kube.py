"""Engines from a Kubernetes Service's EndpointSlices: list, then watch from the list's
resourceVersion (with bookmarks), relisting when the watch expires (410 Gone) or a watch event
cannot be read. Only Ready endpoints count. A pod's role comes from a label and its KV-event
endpoint from a slice port or a pod annotation, both read with one GET of the pod.

API shapes: discovery.k8s.io/v1 EndpointSlice (``endpoints[].addresses``,
``endpoints[].conditions.ready`` — unset means ready — ``endpoints[].targetRef``, ``ports[]``),
watch events as JSON lines ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``
(Kubernetes API concepts, "Efficient detection of changes"). In-cluster credentials: the service
account's token file (re-read on every request: the kubelet rotates it) and CA bundle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from kvroute.discovery.config import KubernetesSource
from kvroute.discovery.model import ROLE_VALUES, Engine, host_port
from kvroute.errors import ServiceError

log = logging.getLogger("kvroute.discovery")

SERVICE_LABEL = "kubernetes.io/service-name"  # the label every EndpointSlice of a Service carries
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one watch event longer than this is malformed


class Relist(ServiceError):
    """The watch cannot go on from its resourceVersion: list again — at once when it expired,
    after ``retry_s`` when the server sent something unreadable (``backoff``)."""

    def __init__(self, why: str, backoff: bool = False):
        super().__init__(why)
        self.backoff = backoff


class APIError(ServiceError):
    """The API server refused or failed a call."""


def _port_of(ports: list[Any], want: int | str | None) -> int | None:
    """The slice port named or numbered ``want`` (None: the first port)."""
    for p in ports:
        if not isinstance(p, dict) or not isinstance(p.get("port"), int):
            continue
        if want is None or p.get("name") == want or p.get("port") == want:
            return int(p["port"])
    return None


def _kv_endpoint(value: str, ip: str) -> str | None:
    """A KV-event endpoint from an annotation: tcp://host:port as written (``*`` → the pod IP),
    or a bare port on the pod's IP."""
    value = value.strip()
    if value.isdigit():
        return f"tcp://{host_port(ip, int(value))}"
    if value.startswith("tcp://"):
        return value.replace("*", ip, 1)
    return None


def _as_list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _as_dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def ready_endpoints(slices: dict[str, dict[str, Any]], src: KubernetesSource,
                    pods: dict[str, dict[str, Any]]) -> list[Engine]:
    """Every Ready endpoint of ``slices`` as an Engine (pure: ``pods`` holds the pod metadata read
    so far, by pod name). An endpoint without the serving port, or not ready, is left out."""
    out: dict[str, Engine] = {}
    for sl in slices.values():
        ports = _as_list(sl.get("ports"))
        port = _port_of(ports, src.port)
        if port is None:
            continue
        kv_port = _port_of(ports, src.kv_events_port) if src.kv_events_port is not None else None
        for ep in _as_list(sl.get("endpoints")):
            if not isinstance(ep, dict):
                continue  # shapes a schema-valid slice never has are skipped, not trusted
            conditions = _as_dict(ep.get("conditions"))
            if conditions.get("ready") is False or conditions.get("terminating") is True:
                continue  # unset "ready" means ready (discovery.k8s.io/v1 EndpointConditions)
            addresses = ep.get("addresses")
            if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
                continue
            ip = addresses[0]
            ref = _as_dict(ep.get("targetRef"))
            pod_name = ref.get("name") if ref.get("kind") == "Pod" else None
            meta = pods.get(pod_name, {}) if isinstance(pod_name, str) else {}
            role = ROLE_VALUES.get(str((meta.get("labels") or {}).get(src.role_label or "", "")), "both")
            kv = f"tcp://{host_port(ip, kv_port)}" if kv_port is not None else None
            note = (meta.get("annotations") or {}).get(src.kv_events_annotation or "")
            if kv is None and isinstance(note, str):
                kv = _kv_endpoint(note, ip)
            fields = {}
            boot = (meta.get("annotations") or {}).get(src.bootstrap_port_annotation or "")
            if isinstance(boot, str) and boot.isdigit() and 0 < int(boot) < 65536:
                fields["bootstrap_port"] = int(boot)
            name = pod_name if isinstance(pod_name, str) and pod_name else host_port(ip, port)
            out[name] = Engine(name, f"{src.scheme}://{host_port(ip, port)}", role, kv, fields)
    return sorted(out.values(), key=lambda e: e.id)


class EndpointSliceWatcher:
    """Keeps the ready endpoints of one Service, calling ``publish`` with every new snapshot and
    ``failed`` with a one-line reason when the API cannot be read (the last snapshot stays)."""

    def __init__(self, src: KubernetesSource, publish: Callable[[list[Engine]], None],
                 failed: Callable[[str], None], label: str):
        self.src, self.publish, self.failed, self.label = src, publish, failed, label
        self.namespace = src.resolved_namespace()
        self.base = src.resolved_api_server()
        self.slices: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # pod name → {labels, annotations}
        self.resource_version = ""
        self.lists = 0  # how many times it listed (tests and the status read it)
        self._tls: ssl.SSLContext | bool = True
        if self.base.startswith("https://"):
            ca = src.ca_file if src.ca_file and Path(src.ca_file).is_file() else None
            self._tls = ssl.create_default_context(cafile=ca)

    def _headers(self) -> dict[str, str]:
        try:
            token = Path(self.src.token_file).read_text().strip()
        except OSError:
            token = ""
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"} if token else \
            {"Accept": "application/json"}

    def _path(self) -> str:
        sel = quote(f"{SERVICE_LABEL}={self.src.service}", safe="")
        return f"{self.base}/apis/discovery.k8s.io/v1/namespaces/{quote(self.namespace)}/endpointslices" \
               f"?labelSelector={sel}"

    async def run(self) -> None:
        """List and watch until cancelled; errors are logged, reported and retried."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as session:
            while True:
                try:
                    await self._list(session)
                    while True:
                        await self._watch(session)
                except Relist as relist:
                    log.warning("discovery %s: %s; listing again", self.label, relist)
                    if relist.backoff:
                        self.failed(str(relist))
                        await asyncio.sleep(self.src.retry_s)
                except (APIError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    why = str(exc) or exc.__class__.__name__
                    log.warning("discovery %s: %s; retrying in %g s", self.label, why, self.src.retry_s)
                    self.failed(why)
                    await asyncio.sleep(self.src.retry_s)

    async def _get_json(self, session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        async with session.get(url, headers=self._headers(), ssl=self._tls,
                               timeout=aiohttp.ClientTimeout(total=30)) as r:
            body = await r.read()
            if r.status == 410:
                raise Relist("resourceVersion expired (410 Gone)")
            if r.status != 200:
                raise APIError(f"GET {url.split('?')[0]} answered {r.status}: {_status_message(body)}"
                               + (" (check the gateway's RBAC: it needs list/watch on endpointslices, get on "
                                  "pods)" if r.status in (401, 403) else ""))
        data = json.loads(body)
        if not isinstance(data, dict):
            raise APIError(f"GET {url.split('?')[0]}: not a JSON object")
        return data

    async def _list(self, session: aiohttp.ClientSession) -> None:
        data = await self._get_json(session, self._path())
        items = data.get("items")
        if not isinstance(items, list):
            raise APIError("EndpointSliceList without items")
        self.slices = {it["metadata"]["name"]: it for it in items
                       if isinstance(it, dict) and isinstance((it.get("metadata") or {}).get("name"), str)}
        self.resource_version = str((data.get("metadata") or {}).get("resourceVersion") or "")
        self.lists += 1
        await self._changed(session)

    async def _watch(self, session: aiohttp.ClientSession) -> None:
        """One watch request, from the last resourceVersion, until the server ends it."""
        url = (f"{self._path()}&watch=true&allowWatchBookmarks=true&timeoutSeconds={self.src.watch_timeout_s}"
               f"&resourceVersion={quote(self.resource_version)}")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.src.watch_timeout_s + 30)
        async with session.get(url, headers=self._headers(), ssl=self._tls, timeout=timeout) as r:
            if r.status == 410:
                raise Relist("watch resourceVersion expired (410 Gone)")
            if r.status != 200:
                raise APIError(f"watch answered {r.status}: {_status_message(await r.read())}")
            async for line in _lines(r.content):
                if await self._event(line):
                    await self._changed(session)

    async def _event(self, line: bytes) -> bool:
        """Apply one watch event; True when the set of slices changed. A malformed event or an
        ERROR event is a Relist (the stream cannot be trusted to continue)."""
        try:
            ev = json.loads(line)
            kind, obj = ev["type"], ev["object"]
            if not isinstance(obj, dict):
                raise TypeError("object is not a mapping")
        except (ValueError, KeyError, TypeError) as exc:
            raise Relist(f"malformed watch event ({exc.__class__.__name__}: {str(exc)[:80]}): "
                         f"{line[:120].decode(errors='replace')!r}", backoff=True) from None
        meta = obj.get("metadata") or {}
        if kind == "ERROR":
            code, msg = obj.get("code"), obj.get("message", "")
            raise Relist(f"watch ended with an error ({code}: {msg})")
        rv = meta.get("resourceVersion")
        if kind == "BOOKMARK":
            if rv:
                self.resource_version = str(rv)
            return False
        name = meta.get("name")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not isinstance(name, str):
            raise Relist(f"malformed watch event (type {kind!r}, name {name!r})", backoff=True)
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        if rv:
            self.resource_version = str(rv)
        return True

    async def _changed(self, session: aiohttp.ClientSession) -> None:
        await self._read_pods(session)
        engines = ready_endpoints(self.slices, self.src, self.pods)
        if not engines:
            log.warning("discovery %s: service %s/%s has no ready endpoints", self.label, self.namespace,
                        self.src.service)
        self.publish(engines)

    async def _read_pods(self, session: aiohttp.ClientSession) -> None:
        """Labels and annotations of pods not seen yet (for role and KV-event endpoint); a pod that
        cannot be read is taken with neither, and read again at the next change."""
        if not (self.src.role_label or self.src.kv_events_annotation or self.src.bootstrap_port_annotation):
            return
        names = {ep["targetRef"]["name"] for sl in self.slices.values() for ep in sl.get("endpoints") or []
                 if isinstance(ep, dict) and isinstance(ep.get("targetRef"), dict)
                 and ep["targetRef"].get("kind") == "Pod" and isinstance(ep["targetRef"].get("name"), str)}
        for gone in set(self.pods) - names:
            del self.pods[gone]
        for name in sorted(names - set(self.pods)):
            url = f"{self.base}/api/v1/namespaces/{quote(self.namespace)}/pods/{quote(name)}"
            try:
                meta = (await self._get_json(session, url)).get("metadata") or {}
            except (APIError, Relist, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("discovery %s: pod %s unreadable (%s); taken without role or KV-event endpoint",
                            self.label, name, exc)
                continue
            labels, notes = meta.get("labels"), meta.get("annotations")
            self.pods[name] = {"labels": labels if isinstance(labels, dict) else {},
                               "annotations": notes if isinstance(notes, dict) else {}}


def _status_message(body: bytes) -> str:
    """The message of a Kubernetes Status body, else its first bytes."""
    try:
        return str(json.loads(body).get("message"))[:200]
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


async def _lines(stream: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Newline-separated events of a watch response, however the chunks fall."""
    buf = b""
    async for chunk in stream.iter_any():
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
        if len(buf) > MAX_EVENT_BYTES:
            raise Relist(f"watch event longer than {MAX_EVENT_BYTES} bytes", backoff=True)
    if buf.strip():
        yield buf
