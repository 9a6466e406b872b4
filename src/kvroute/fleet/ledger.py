"""What the other gateways of one region are doing, mirrored into this gateway's Routers.

Several ``kvroute serve`` instances behind one front load balancer route over the same replicas.
Each Router accounts only what it dispatched itself, so without help each instance sees a third
of the load: in-flight counts, queued prefill, SkyWalker's dispatches-since-probe (the pending
gate) and the prompts it sent where (the approximate prefix index). NVIDIA Dynamo's router
replicas solve the same problem with ``--router-replica-sync``: every router publishes each
request's lifecycle — ``AddRequest`` (worker, prompt block hashes, input length, overlap),
``MarkPrefillCompleted``, ``Free`` — on a NATS subject, best effort, and every other router
applies them to its own active-sequence table (``lib/kv-router`` ``multi_worker_sequence.rs``;
events from its own router id are skipped); a periodic load snapshot per router (1 s) doubles
as a heartbeat (``SCHEDULER_LOAD_PUBLISH_INTERVAL``). This module is that table for kvroute,
pure (no I/O, no clock: the transport in ``fleet/sync.py`` passes times in):

* ``add`` / ``prefill`` / ``free`` messages mirror one dispatch of a sibling instance into the
  local Router with ``Router.commit(notify=False)`` — the same counters and index insert as a
  local dispatch, but the policy's learning plugins are not told (they learn from the requests
  whose outcome this instance measures). A ``free`` of a request the engine did not serve also
  takes its blocks back out of the index, as ``Router.on_failed`` does locally.
* ``snap`` — every instance's full in-flight set, queue length and queued tokens, sent every
  ``snapshot_every`` heartbeats — replaces what was mirrored from it: requests it no longer holds
  are freed, ones missed are added (without prefix hashes: a snapshot carries counters, not
  prompts). NATS core delivers at most once, so a lost message is repaired by the next snapshot.
* ``hb`` — a heartbeat with the queue only; ``hello`` — an instance (re)joining asks every
  other one for a snapshot at once; ``bye`` — an instance stopping is forgotten at once.
* an instance silent for ``timeout_s`` (killed, or cut off from NATS) is forgotten: its
  mirrored requests leave the counters (their prefix blocks stay: the engines did get them).

Everything mirrored is eventually consistent: a sibling's dispatch is visible here one NATS hop
later (sub-millisecond on one host), its queue one heartbeat later, and a lost message one
snapshot later. Ordering holds per sender (one connection, one subject), which is all the
ledger needs: an instance's ``free`` never overtakes its ``add``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.errors import ServiceError
from kvroute.model import Request
from kvroute.policy.router import Router, Ticket

REPLICA = "replica"  # the layer of a dispatch: to an engine replica ...
PEER = "peer"  # ... or forwarded to another region's gateway (SkyWalker / GORGO peers)
LAYERS = (REPLICA, PEER)


class BadMessage(ServiceError):
    """A fleet message that cannot be applied; the text says why (it is counted, never raised on)."""


def encode(msg: Mapping[str, Any]) -> bytes:
    """A message on the wire: compact JSON (every field is a number, a string or a list of them)."""
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    """The message in ``data``; :class:`BadMessage` when it is not a JSON object naming its type and sender."""
    try:
        msg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise BadMessage(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str) or not isinstance(msg.get("o"), str):
        raise BadMessage("not an object with a type 't' and a sender 'o'")
    return msg


def add_message(origin: str, seq: int, rid: str, ticket: Ticket, block_tokens: int, layer: str) -> dict[str, Any]:
    """A dispatch of ``rid`` as its ticket recorded it (endpoint, prompt tokens, prefix matched, hashes)."""
    return {"t": "add", "o": origin, "s": seq, "id": rid, "ep": ticket.endpoint_id, "tok": ticket.tokens,
            "m": ticket.matched_blocks, "bt": block_tokens, "h": list(ticket.hashes), "l": layer}


def simple_message(kind: str, origin: str, seq: int, **fields: Any) -> dict[str, Any]:
    """A ``prefill``, ``free``, ``hb`` or ``hello`` message."""
    return {"t": kind, "o": origin, "s": seq, **fields}


def snapshot_message(origin: str, seq: int, routers: Mapping[str, Router], own: Sequence[tuple[str, str]],
                     queue: int, queued_tokens: int) -> dict[str, Any]:
    """Everything ``origin`` has in flight (``own``: its request ids with their layer), with each
    request's endpoint, prompt tokens and the prefill still outstanding, plus its LB queue."""
    reqs = []
    for rid, layer in own:
        t = routers[layer].tickets.get(rid)
        if t is not None:
            reqs.append([rid, t.endpoint_id, t.tokens, t.prefill_tokens, layer])
    return {"t": "snap", "o": origin, "s": seq, "q": queue, "qt": queued_tokens, "r": reqs}


@dataclass
class Sibling:
    """Another instance of this fleet as last heard: its in-flight requests (mirrored request id →
    layer), queue, and the sequence number of its last message."""

    name: str
    last_seen: float
    seq: int = -1
    queue: int = 0
    queued_tokens: int = 0
    requests: dict[str, str] = field(default_factory=dict)


@dataclass
class Applied:
    """What applying one message changed: load went down (the local queue may move), the sender
    wants a snapshot, messages were lost before this one, it restarted."""

    freed: bool = False
    wants_snapshot: bool = False
    gap: int = 0
    restarted: bool = False
    skipped: str | None = None  # why an add was not mirrored (an endpoint unknown here)
    added: tuple[str, tuple[int, ...]] | None = None  # a replica-layer add: (endpoint, block hashes)


class Ledger:
    """The mirror of every sibling's in-flight requests in this instance's Routers (the replica
    layer, and the peer layer when it forwards across regions)."""

    def __init__(self, me: str, routers: Mapping[str, Router], timeout_s: float):
        self.me = me
        self.routers = dict(routers)
        self.timeout_s = timeout_s
        self.siblings: dict[str, Sibling] = {}

    # -- reading -----------------------------------------------------------------------------------
    def queue(self) -> int:
        """Requests waiting in the siblings' LB queues (at their last heartbeat)."""
        return sum(s.queue for s in self.siblings.values())

    def queued_tokens(self) -> int:
        """Prompt tokens waiting in the siblings' LB queues."""
        return sum(s.queued_tokens for s in self.siblings.values())

    def mirrored(self) -> int:
        """Sibling requests mirrored into the counters now."""
        return sum(len(s.requests) for s in self.siblings.values())

    # -- applying ----------------------------------------------------------------------------------
    def apply(self, msg: Mapping[str, Any], now: float) -> Applied:
        """Apply one decoded message received at ``now``. Own messages are ignored; a malformed
        one raises :class:`BadMessage` having changed nothing."""
        origin = msg["o"]
        out = Applied()
        if origin == self.me:
            return out
        kind = msg["t"]
        seq = _int(msg, "s")
        parsed: Any = None  # checked in full before anything changes
        if kind == "add":
            parsed = self._parse_add(msg)
        elif kind == "snap":
            parsed = self._parse_snapshot(msg)
        elif kind in ("prefill", "free"):
            parsed = _str(msg, "id")
        elif kind == "hb":
            parsed = (_int(msg, "q"), _int(msg, "qt"))
        elif kind == "bye":
            out.freed = self.forget(origin)
            return out
        elif kind != "hello":
            raise BadMessage(f"unknown message type {kind!r}; known: add, prefill, free, snap, hb, hello, bye")
        sib = self.siblings.get(origin)
        if sib is not None and (kind == "hello" or seq <= sib.seq):  # sequence restarted: a new process
            out.restarted = True
            out.freed = self.forget(origin)
            sib = None
        if sib is None:
            sib = self.siblings[origin] = Sibling(origin, now)
        elif seq > sib.seq + 1:
            out.gap = seq - sib.seq - 1
        if kind == "add":
            self._add(sib, parsed, out)
        elif kind == "prefill":
            self._prefill(sib, parsed)
        elif kind == "free":
            out.freed = self._free(sib, parsed, msg.get("ok", True) is not False) or out.freed
        elif kind == "snap":
            sib.queue, sib.queued_tokens = _int(msg, "q"), _int(msg, "qt")
            out.freed = self._snapshot(sib, parsed, out) or out.freed
        elif kind == "hb":
            sib.queue, sib.queued_tokens = parsed
        else:  # hello
            out.wants_snapshot = True
        sib.seq, sib.last_seen = seq, now
        return out

    def expire(self, now: float) -> list[tuple[str, int]]:
        """Forget the siblings silent for longer than ``timeout_s``; returns (name, requests freed)."""
        gone = [(name, len(s.requests)) for name, s in self.siblings.items() if now - s.last_seen > self.timeout_s]
        for name, _ in gone:
            self.forget(name)
        return gone

    def forget(self, origin: str) -> bool:
        """Drop everything mirrored from ``origin``; True if that freed any load."""
        sib = self.siblings.pop(origin, None)
        if sib is None:
            return False
        for key, layer in sib.requests.items():
            self.routers[layer].on_finish(key, notify=False)
        return bool(sib.requests)

    def forget_all(self) -> bool:
        """Drop every sibling (this instance lost the fleet: routing goes on its own view)."""
        freed = False
        for name in list(self.siblings):
            freed = self.forget(name) or freed
        return freed

    # -- one message each ------------------------------------------------------------------------------
    def _parse_add(self, msg: Mapping[str, Any]) -> tuple[str, str, str, tuple[int, ...], int, int, int]:
        layer = msg.get("l", REPLICA)
        if layer not in self.routers:
            raise BadMessage(f"unknown layer {layer!r}; allowed: {', '.join(self.routers)}")
        hashes = msg.get("h", [])
        if not isinstance(hashes, list) or not all(type(h) is int and 0 <= h < 1 << 64 for h in hashes):
            raise BadMessage("field 'h' must be a list of 64-bit unsigned block hashes")
        return (layer, _str(msg, "id"), _str(msg, "ep"), tuple(hashes), _int(msg, "tok"), _int(msg, "m"),
                max(1, _int(msg, "bt")))

    def _add(self, sib: Sibling, parsed: tuple[str, str, str, tuple[int, ...], int, int, int], out: Applied) -> None:
        layer, rid, ep, hashes, tokens, matched, block_tokens = parsed
        router = self.routers[layer]
        key = f"{sib.name}/{rid}"
        if router.endpoint(ep) is None:
            if key in sib.requests:  # re-dispatched to an endpoint unknown here: the old one is over
                self._free(sib, rid, True)
            out.skipped = ep
            return
        req = Request(id=key, block_hashes=hashes, block_tokens=block_tokens, prompt_tokens=tokens)
        router.commit(req, ep, min(matched, len(hashes)), notify=False)  # a re-dispatch undoes the old one
        sib.requests[key] = layer
        if layer == REPLICA:
            out.added = (ep, hashes)

    def _prefill(self, sib: Sibling, rid: str) -> None:
        key = f"{sib.name}/{rid}"
        layer = sib.requests.get(key)
        if layer is not None:
            self.routers[layer].on_first_token(key)

    def _free(self, sib: Sibling, rid: str, served: bool) -> bool:
        key = f"{sib.name}/{rid}"
        layer = sib.requests.pop(key, None)
        if layer is None:
            return False
        router = self.routers[layer]
        (router.on_finish if served else router.on_failed)(key, notify=False)
        return True

    def _parse_snapshot(self, msg: Mapping[str, Any]) -> dict[str, tuple[str, int, int, str]]:
        reqs = msg.get("r")
        if not isinstance(reqs, list):
            raise BadMessage("field 'r' must be a list of [id, endpoint, tokens, prefill, layer]")
        _int(msg, "q"), _int(msg, "qt")
        rows: dict[str, tuple[str, int, int, str]] = {}
        for row in reqs:
            if not (isinstance(row, list) and len(row) == 5 and all(type(v) is str and v for v in (row[0], row[1]))
                    and all(type(v) is int and v >= 0 for v in (row[2], row[3])) and row[4] in self.routers):
                raise BadMessage("a snapshot row must be [id, endpoint, tokens, prefill, layer]")
            rows[row[0]] = (row[1], row[2], row[3], row[4])
        return rows

    def _snapshot(self, sib: Sibling, rows: dict[str, tuple[str, int, int, str]], out: Applied) -> bool:
        freed = False
        prefix = f"{sib.name}/"
        for key in [k for k in sib.requests if k[len(prefix):] not in rows]:  # over: its free was lost
            freed = self._free(sib, key[len(prefix):], True) or freed
        for rid, (ep, tokens, prefill, layer) in rows.items():
            key = prefix + rid
            router = self.routers[layer]
            ticket = router.tickets.get(key) if sib.requests.get(key) == layer else None
            if ticket is not None and ticket.endpoint_id == ep:
                if prefill == 0 and ticket.prefill_tokens:
                    router.on_first_token(key)  # its prefill message was lost
                continue
            if key in sib.requests:  # moved (or to another layer): the old dispatch is over
                freed = self._free(sib, rid, True) or freed
            if router.endpoint(ep) is None:
                out.skipped = ep
                continue
            req = Request(id=key, prompt_tokens=tokens, block_tokens=1)
            router.commit(req, ep, max(0, tokens - prefill), notify=False)  # no hashes: counters only
            sib.requests[key] = layer
        return freed


def _int(msg: Mapping[str, Any], name: str) -> int:
    v = msg.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise BadMessage(f"field {name!r} must be a non-negative integer")
    return v


def _str(msg: Mapping[str, Any], name: str) -> str:
    v = msg.get(name)
    if not isinstance(v, str) or not v:
        raise BadMessage(f"field {name!r} must be a non-empty string")
    return v
