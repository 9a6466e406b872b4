"""Snapshots from discovery sources → replicas added to and removed from the running gateway.

Each source reports the whole set it sees; the reconciler diffs it against what that source
added before and calls the runtime's ``add_replica`` / ``remove_replica`` (the admin API's path),
so a discovered engine is probed, ejected, broken and indexed like a static one. An engine whose
address or role changed is removed and added again (its cache state is not the old one's).
A discovered id that a static replica or another source already uses is skipped with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from kvroute.discovery.model import Engine
from kvroute.replicas import ReplicaConfig, events_extra_installed

log = logging.getLogger("kvroute.discovery")

# ReplicaConfig fields the discovered role and KV-event endpoint fill: role (prefill | decode |
# mixed, the P/D work) and kv_events.endpoint (the KV-event consumer subscribes to it)
ROLE_FIELD, KV_EVENTS_FIELD = "role", "kv_events"


class Reconciler:
    """Applies each source's snapshot to a runtime through two callbacks (and knows which ids
    belong to which source)."""

    def __init__(self, add: Callable[[ReplicaConfig], None], remove: Callable[[str], None],
                 taken: Callable[[str], bool], place: Callable[[ReplicaConfig], ReplicaConfig] = lambda r: r):
        self._add, self._remove, self._taken, self._place = add, remove, taken, place
        self.owned: dict[str, dict[str, Engine]] = {}  # source → id → engine it added
        self.synced: set[str] = set()  # sources that delivered at least one snapshot
        self.errors: dict[str, str] = {}  # source → its last error, until a snapshot succeeds
        self.roles = False  # pass discovered prefill/decode roles on (the gateway runs P/D)
        self._said_events = False

    def replica(self, e: Engine, defaults: dict[str, Any]) -> ReplicaConfig:
        """The ``replicas:`` entry for ``e``: the source's defaults, the engine's own fields, its id and URL."""
        known = ReplicaConfig.model_fields  # a field the gateway does not define is dropped, not an error
        data: dict[str, Any] = {**defaults, **{k: v for k, v in e.fields.items() if k in known},
                                "url": e.url, "id": e.id}
        if self.roles and ROLE_FIELD in known and e.role != "both":
            data[ROLE_FIELD] = e.role  # only for a P/D gateway: elsewhere every engine serves whole requests
        if KV_EVENTS_FIELD not in e.fields:  # (a file's entry carries its own, complete)
            base = data.pop(KV_EVENTS_FIELD, None)  # the defaults' event settings, for pods that publish
            if e.kv_events and KV_EVENTS_FIELD in known and self._events_installed():
                data[KV_EVENTS_FIELD] = {**(base if isinstance(base, dict) else {}), "endpoint": e.kv_events}
        return self._place(ReplicaConfig.model_validate(data))

    def _events_installed(self) -> bool:
        """Whether KV events can be consumed (the ``events`` extra); said once when they cannot."""
        try:
            events_extra_installed()
        except ValueError as exc:
            if not self._said_events:
                log.warning("discovery: engines publish KV events but %s; routing on the approximate index", exc)
                self._said_events = True
            return False
        return True

    def apply(self, source: str, engines: list[Engine], defaults: dict[str, Any]) -> list[str]:
        """Make ``source``'s replicas equal to ``engines``; returns the changes, as log words."""
        mine = self.owned.setdefault(source, {})
        fresh = {e.id: e for e in engines}
        changes = []
        for name in [n for n in mine if n not in fresh or not mine[n].same(fresh[n])]:
            self._remove(name)
            del mine[name]
            changes.append(f"-{name}")
        for name, e in fresh.items():
            if name in mine:
                continue
            if self._taken(name):
                log.warning("discovery %s: engine %s (%s) skipped: a replica with that id exists already",
                            source, name, e.url)
                continue
            try:
                rc = self.replica(e, defaults)
            except (ValidationError, ValueError) as exc:
                log.warning("discovery %s: engine %s (%s) skipped: %s", source, name, e.url,
                            str(exc).splitlines()[0])
                continue
            self._add(rc)
            mine[name] = e
            changes.append(f"+{name}")
        self.synced.add(source)
        self.errors.pop(source, None)
        if changes:
            log.info("discovery %s: %s (%d engines)", source, " ".join(changes), len(mine))
        return changes

    def failed(self, source: str, why: str) -> None:
        """A source could not read its engines; what it had stays (stale beats empty)."""
        self.errors[source] = why

    def forget(self, source: str) -> None:
        """Remove every replica ``source`` added (the source was configured away)."""
        for name in list(self.owned.pop(source, {})):
            self._remove(name)
        self.synced.discard(source)
        self.errors.pop(source, None)

    def status(self) -> dict[str, Any]:
        """Per source: its engines (id, url, role, kv_events), synced or not, and its last error."""
        out = {}
        for source in sorted(set(self.owned) | self.synced | set(self.errors)):
            out[source] = {"synced": source in self.synced, "error": self.errors.get(source),
                           "engines": [{"id": e.id, "url": e.url, "role": e.role, "kv_events": e.kv_events}
                                       for e in self.owned.get(source, {}).values()]}
        return out
