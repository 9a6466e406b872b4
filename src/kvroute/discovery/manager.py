"""Runs the configured discovery sources against a runtime (one task per source)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvroute.discovery.config import DNSSource, FileSource, KubernetesSource, Source, source_label
from kvroute.discovery.dns import DNSWatcher
from kvroute.discovery.files import FileWatcher
from kvroute.discovery.kube import EndpointSliceWatcher
from kvroute.discovery.model import Engine
from kvroute.discovery.reconcile import Reconciler
from kvroute.replicas import ReplicaConfig

log = logging.getLogger("kvroute.discovery")

Watcher = EndpointSliceWatcher | DNSWatcher | FileWatcher


class _Settings(Protocol):
    @property
    def discovery(self) -> Sequence[Source]:
        """The configured sources."""

    @property
    def pd(self) -> object | None:
        """The P/D section: discovered prefill/decode roles are passed on only when it is set."""

    def placed(self, replica: ReplicaConfig) -> ReplicaConfig:
        """``replica`` in the gateway's region when it names none."""


class DiscoveryHost(Protocol):
    """What discovery asks of the gateway runtime it feeds (the admin API's replica calls)."""

    @property
    def config(self) -> _Settings:
        """The gateway's config."""

    @property
    def upstreams(self) -> Mapping[str, object]:
        """The replicas by name (a discovered id already in use is skipped)."""

    def add_replica(self, rc: ReplicaConfig) -> None:
        """Add a replica; it is probed from the next round on."""

    def remove_replica(self, name: str) -> None:
        """Remove a replica; its in-flight requests finish where they are."""

    def drain_queue(self) -> None:
        """A new engine may take what the queue holds."""


class Discovery:
    """The gateway's discovery: a Reconciler over the runtime and a watcher per source."""

    def __init__(self, runtime: DiscoveryHost):
        self.rt = runtime
        self.reconciler = Reconciler(runtime.add_replica, runtime.remove_replica,
                                     lambda name: name in runtime.upstreams,
                                     lambda rc: runtime.config.placed(rc))
        self.watchers: dict[str, Watcher] = {}
        self._tasks: list[asyncio.Task] = []

    @property
    def synced(self) -> bool:
        """Every source has delivered a snapshot (readiness waits for this)."""
        return all(label in self.reconciler.synced for label in self.watchers)

    def _watcher(self, src: KubernetesSource | DNSSource | FileSource, label: str) -> Watcher:
        def publish(engines: list[Engine]) -> None:
            self.reconciler.roles = self.rt.config.pd is not None
            self.reconciler.apply(label, engines, src.defaults)
            self.rt.drain_queue()  # a new engine may take what the queue holds

        def failed(why: str) -> None:
            self.reconciler.failed(label, why)

        if isinstance(src, KubernetesSource):
            return EndpointSliceWatcher(src, publish, failed, label)
        if isinstance(src, DNSSource):
            return DNSWatcher(src, publish, failed, label)
        return FileWatcher(src, publish, failed, label)

    async def start(self) -> None:
        """Build each source's watcher (a bad source is a ValueError naming it), give file and DNS
        sources one read before returning — so the first probe round sees their engines — and run
        them all in the background."""
        for i, src in enumerate(self.rt.config.discovery):
            label = source_label(src, i)
            self.watchers[label] = self._watcher(src, label)
        for w in self.watchers.values():
            if isinstance(w, FileWatcher):
                w.once()
            elif isinstance(w, DNSWatcher):
                await w.once()
            self._tasks.append(asyncio.create_task(self._run(w)))

    async def _run(self, w: Watcher) -> None:
        if isinstance(w, (FileWatcher, DNSWatcher)):
            await asyncio.sleep(w.src.interval_s)  # start() read it once already
        try:
            await w.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in a watcher must not end discovery silently
            log.exception("discovery %s stopped", w.label)
            raise

    async def stop(self) -> None:
        """Cancel every watcher."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    def status(self) -> dict[str, Any]:
        """What each source found, whether it is synced, and its last error."""
        return self.reconciler.status()
