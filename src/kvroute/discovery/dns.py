"""Engines from DNS: a headless Service's A/AAAA records (one address per ready pod) with a
configured port, or its SRV records (target and port per pod), re-resolved periodically.

A small DNS client of its own (RFC 1035 messages over UDP, TCP when the answer is truncated;
RFC 2782 SRV), so the server is configurable (a test's dnsmasq on a loopback port) and each
re-resolution really asks the server rather than a process-wide cache.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import struct
from collections.abc import Callable
from pathlib import Path

from kvroute.discovery.config import DNSSource
from kvroute.discovery.model import Engine, host_port
from kvroute.errors import ServiceError

log = logging.getLogger("kvroute.discovery")

A, AAAA, SRV = 1, 28, 33
NXDOMAIN = 3


class DNSError(ServiceError):
    """The server failed the query (SERVFAIL, refused, timeout, unreadable answer)."""


def encode_name(name: str) -> bytes:
    """A domain name as length-prefixed labels."""
    out = b""
    for label in name.rstrip(".").split("."):
        raw = label.encode("idna") if label else b""
        if not 0 < len(raw) < 64:
            raise DNSError(f"bad name {name!r}")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def build_query(qid: int, name: str, qtype: int) -> bytes:
    """One recursive query for ``name``/``qtype`` in class IN."""
    return struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack(">HH", qtype, 1)


def _read_name(msg: bytes, off: int) -> tuple[str, int]:
    """A (possibly compressed) name at ``off``; returns it and the offset after it."""
    labels: list[str] = []
    end: int | None = None
    hops = 0
    while True:
        if off >= len(msg):
            raise DNSError("truncated name")
        n = msg[off]
        if n & 0xC0 == 0xC0:
            if off + 1 >= len(msg) or hops > 32:
                raise DNSError("bad name pointer")
            end = off + 2 if end is None else end
            off, hops = ((n & 0x3F) << 8) | msg[off + 1], hops + 1
            continue
        if n == 0:
            return ".".join(labels), (off + 1 if end is None else end)
        labels.append(msg[off + 1:off + 1 + n].decode("ascii", "replace"))
        off += 1 + n


def parse_response(msg: bytes, qid: int) -> tuple[int, bool, list[tuple[str, int, object]]]:
    """(rcode, truncated, records) of an answer; records as (owner, type, value) from the answer and
    additional sections: an address string for A/AAAA, (priority, weight, port, target) for SRV."""
    if len(msg) < 12:
        raise DNSError("answer shorter than a header")
    rid, flags, qd, an, ns, ar = struct.unpack(">HHHHHH", msg[:12])
    if rid != qid:
        raise DNSError("answer for another query")
    off = 12
    for _ in range(qd):
        _, off = _read_name(msg, off)
        off += 4
    records: list[tuple[str, int, object]] = []
    for i in range(an + ns + ar):
        owner, off = _read_name(msg, off)
        if off + 10 > len(msg):
            raise DNSError("truncated record")
        rtype, _cls, _ttl, rdlen = struct.unpack(">HHIH", msg[off:off + 10])
        off += 10
        rdata = msg[off:off + rdlen]
        if len(rdata) != rdlen:
            raise DNSError("truncated record data")
        if an <= i < an + ns:  # authority section: nothing an engine list needs
            pass
        elif rtype == A and rdlen == 4:
            records.append((owner, A, ".".join(str(b) for b in rdata)))
        elif rtype == AAAA and rdlen == 16:
            records.append((owner, AAAA, str(ipaddress.IPv6Address(rdata))))
        elif rtype == SRV and rdlen >= 7:
            prio, weight, port = struct.unpack(">HHH", rdata[:6])
            target, _ = _read_name(msg, off + 6)
            records.append((owner, SRV, (prio, weight, port, target)))
        off += rdlen
    return flags & 0x000F, bool(flags & 0x0200), records


class _UDP(asyncio.DatagramProtocol):
    def __init__(self, qid: int):
        self.qid = qid
        self.answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: object) -> None:
        if len(data) >= 2 and struct.unpack(">H", data[:2])[0] == self.qid and not self.answer.done():
            self.answer.set_result(data)

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(DNSError(getattr(exc, "strerror", None) or str(exc)))


def resolv_conf_nameserver(path: str = "/etc/resolv.conf") -> str:
    """The first ``nameserver`` of resolv.conf (127.0.0.1 when there is none)."""
    try:
        for line in Path(path).read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                return parts[1]
    except OSError:
        pass
    return "127.0.0.1"


def split_server(server: str) -> tuple[str, int]:
    """host[:port] (an IPv6 address in brackets when it has a port) → (host, port), port 53 by default."""
    if server.startswith("["):
        host, _, rest = server[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else 53
    if server.count(":") == 1:
        host, port = server.split(":")
        return host, int(port)
    return server, 53


async def query(server: tuple[str, int], name: str, qtype: int, timeout_s: float) -> list[tuple[str, int, object]]:
    """The records answering ``name``/``qtype``; NXDOMAIN is an empty list, a failure a DNSError."""
    qid = random.randrange(1 << 16)
    msg = build_query(qid, name, qtype)
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(lambda: _UDP(qid), remote_addr=server)
    try:
        transport.sendto(msg)
        async with asyncio.timeout(timeout_s):
            data = await proto.answer
    except TimeoutError:
        raise DNSError(f"no answer from {server[0]}:{server[1]} within {timeout_s:g} s") from None
    except DNSError as exc:
        raise DNSError(f"DNS server {server[0]}:{server[1]}: {exc}") from None
    finally:
        transport.close()
    rcode, truncated, records = parse_response(data, qid)
    if truncated:  # a large Service: ask again over TCP (RFC 1035 4.2.2: 2-byte length prefix)
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(*server)
            try:
                writer.write(struct.pack(">H", len(msg)) + msg)
                size = struct.unpack(">H", await reader.readexactly(2))[0]
                rcode, _, records = parse_response(await reader.readexactly(size), qid)
            finally:
                writer.close()
    if rcode == NXDOMAIN:
        return []
    if rcode != 0:
        raise DNSError(f"{server[0]}:{server[1]} answered rcode {rcode} for {name}")
    return records


async def resolve(src: DNSSource) -> list[tuple[str, int]]:
    """(address, port) of every engine behind ``src`` right now, sorted."""
    server = split_server(src.nameserver or resolv_conf_nameserver())
    name = src.name.rstrip(".")
    if src.srv:
        records = await query(server, name, SRV, src.timeout_s)
        out: set[tuple[str, int]] = set()
        glue = {(o.lower(), t): v for o, t, v in records if t in (A, AAAA)}
        for _owner, rtype, value in records:
            if rtype != SRV:
                continue
            assert isinstance(value, tuple)
            port, target = int(value[2]), str(value[3])
            addrs = [str(v) for (o, t), v in glue.items() if o == target.lower()]
            if not addrs:
                addrs = [str(v) for _, t, v in await query(server, target, A, src.timeout_s) if t == A]
            out.update((a, port) for a in addrs)
        return sorted(out)
    assert src.port is not None  # checked by the config
    found = [str(v) for _, t, v in await query(server, name, A, src.timeout_s) if t == A]
    found += [str(v) for _, t, v in await query(server, name, AAAA, src.timeout_s) if t == AAAA]
    return sorted({(a, src.port) for a in found})


class DNSWatcher:
    """Resolves a DNS source every ``interval_s`` and publishes each answer as a snapshot; a failed
    resolution keeps the last one (``failed`` is told why)."""

    def __init__(self, src: DNSSource, publish: Callable[[list[Engine]], None], failed: Callable[[str], None],
                 label: str):
        self.src, self.publish, self.failed, self.label = src, publish, failed, label
        self.resolutions = 0

    async def once(self) -> None:
        """One resolution, published (or reported as failed)."""
        try:
            pairs = await resolve(self.src)
        except (DNSError, OSError, UnicodeError) as exc:
            log.warning("discovery %s: %s; keeping the last answer", self.label, exc)
            self.failed(str(exc))
            return
        self.resolutions += 1
        if not pairs:
            log.warning("discovery %s: %s has no records (a Service with no ready endpoints)", self.label,
                        self.src.name)
        self.publish([Engine(host_port(a, p), f"{self.src.scheme}://{host_port(a, p)}") for a, p in pairs])

    async def run(self) -> None:
        """Resolve until cancelled."""
        while True:
            await self.once()
            await asyncio.sleep(self.src.interval_s)
