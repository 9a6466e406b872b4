"""Which headers a proxied exchange passes on: the client's request headers to the engine, the engine's
response headers to the client — end-to-end ones only (RFC 9110 §7.6.1), less what the gateway sets itself.

On the per-request path of every proxied request (compiled in the optional build, kvroute/buildinfo.py).
"""

from __future__ import annotations

from typing import Final

from kvroute.gateway.peers import PEER_HEADERS
from kvroute.gateway.residency import REGION_HEADER, RESIDENCY_HEADER

# never forwarded in either direction (RFC 9110 §7.6.1), plus what the gateway sets itself and its own
# routing headers (an engine has no use for them; a forward to a peer carries them again: Peering.outbound)
HOP_HEADERS: Final = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect",
                                "accept-encoding", "upgrade", "te", "trailer", "proxy-authorization",
                                "proxy-authenticate", "proxy-connection", "server", "date",
                                RESIDENCY_HEADER, REGION_HEADER}) | PEER_HEADERS
_HOP_BYTES: Final = frozenset(h.encode() for h in HOP_HEADERS)  # upstream response headers come as bytes
_HOP_ACCESS: Final = _HOP_BYTES | {b"x-request-id"}  # with the access log the gateway sets x-request-id itself
# whether a response header passes, by its name as it came (without / with the access log): an engine sends
# the same few names on every answer, and a lookup of those bytes costs less than lowering each and testing
# the hop set (a bytes method and a set test, ~750 instructions a field in the compiled build; sixth round,
# docs/hot-path.md). Bounded: names past the bound are judged every time.
_PASSES: Final[dict[bytes, bool]] = {}
_PASSES_ACCESS: Final[dict[bytes, bool]] = {}
_PASSES_MAX: Final = 256
# the names of the last response's fields in order, and whether each passed (index 0: access log off, 1: on):
# an engine sends the same names in the same order on every answer, so a field is first compared with the name
# at its place last time — a memory comparison, where the lookup above hashes each new bytes object (~430
# instructions a field, four fields per answer; eleventh round, docs/hot-path.md). Only a cache: a name that
# differs is judged as above and takes the place.
_LAST_NAMES: Final[list[list[bytes]]] = [[], []]
_LAST_KEPT: Final[list[list[bool]]] = [[], []]
_LAST_MAX: Final = 64


def forwarded(headers: dict[str, str]) -> list[tuple[str, str]]:
    """The client's end-to-end headers: hop-by-hop ones and those its Connection header names are dropped."""
    drop = HOP_HEADERS
    if "connection" in headers:
        drop = drop | {t.strip().lower() for t in headers["connection"].split(",")}
    return [(k, v) for k, v in headers.items() if k not in drop]


def _passes(name: bytes, access_log: bool) -> bool:
    """Whether a response header field named ``name`` (as it came) goes on to the client."""
    passes = _PASSES_ACCESS if access_log else _PASSES
    keep = passes.get(name)
    if keep is None:
        keep = name.lower() not in (_HOP_ACCESS if access_log else _HOP_BYTES)
        if len(passes) < _PASSES_MAX:
            passes[name] = keep
    return keep


def response_fields(headers: list[tuple[bytes, bytes]], access_log: bool) -> list[bytes]:
    """The pieces of the engine's end-to-end response header fields (``name: value\\r\\n``, as they came:
    bytes, not decoded), for the client's response head; ``access_log``: x-request-id is the gateway's."""
    mode = 1 if access_log else 0
    names, kept = _LAST_NAMES[mode], _LAST_KEPT[mode]
    out: list[bytes] = []
    i = 0
    for name, value in headers:  # joined by the caller: no bytes %-formatting per field
        if i < len(names) and names[i] == name:  # the same name at this place as last time
            keep = kept[i]
        else:
            keep = _passes(name, access_log)
            if i < len(names):
                names[i], kept[i] = name, keep
            elif i == len(names) and i < _LAST_MAX:
                names.append(name)
                kept.append(keep)
        i += 1
        if keep:
            out += (name, b": ", value, b"\r\n")
    return out
