"""Engines from a file: ``replicas:`` entries (as in gateway.yaml), re-read when the file changes —
for a ConfigMap mounted as a volume, which the kubelet updates in place (an atomic symlink swap,
so a read never sees half a file)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from kvroute import yamlconf
from kvroute.discovery.config import FileSource
from kvroute.discovery.model import Engine
from kvroute.replicas import ReplicaConfig
from kvroute.schema import StrictModel

log = logging.getLogger("kvroute.discovery")


def read_engines(path: str) -> list[Engine]:
    """The engines a file lists; a bad file is a ConfigFileError naming file:line and the field."""
    class EngineFile(StrictModel):
        replicas: list[ReplicaConfig] = Field(default_factory=list)

    data, text = yamlconf.read(path)
    parsed = yamlconf.validate(EngineFile, data, path, text)
    hit = yamlconf.first_repeat(r.name for r in parsed.replicas)
    if hit is not None:
        raise yamlconf.ConfigFileError(f"{path}: replica ids must be unique; repeated: {parsed.replicas[hit[0]].name}")
    return [Engine(r.name, r.url, fields=r.model_dump(exclude={"url", "id"}, exclude_unset=True))
            for r in parsed.replicas]


class FileWatcher:
    """Checks the file every ``interval_s`` and publishes its engines when its content changed; a
    file that is missing or invalid keeps the last good list and logs why once per change."""

    def __init__(self, src: FileSource, publish: Callable[[list[Engine]], None], failed: Callable[[str], None],
                 label: str):
        self.src, self.publish, self.failed, self.label = src, publish, failed, label
        self._seen: bytes | None = None
        self.reads = 0

    def once(self) -> None:
        """Read the file; publish when its bytes differ from the last read."""
        try:
            raw = Path(self.src.path).read_bytes()
        except OSError as exc:
            raw = f"<unreadable: {exc.strerror}>".encode()
        if raw == self._seen:
            return
        self._seen = raw
        try:
            engines = read_engines(self.src.path)
        except yamlconf.ConfigFileError as exc:
            why = str(exc).splitlines()[0]
            log.error("discovery %s: %s; keeping the last good list", self.label, why)
            self.failed(why)
            return
        self.reads += 1
        self.publish(engines)

    async def run(self) -> None:
        """Check until cancelled."""
        while True:
            self.once()
            await asyncio.sleep(self.src.interval_s)
