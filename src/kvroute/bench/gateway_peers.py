"""`kvroute bench gateway --peers`: kvroute beside the routers users would pick instead.

One paired, interleaved run per upstream delay: the same trivial upstreams (``bench/gateway.py``),
the same load client, and in every repeat first the load direct, then through each router in
turn — kvroute (one process per preset; its ``--compiled`` build and a ``--baseline-src`` build
when given), then each
installed peer (``bench/peers.py``) — with **one router alive at a time** (started, measured
non-stream and stream, stopped). Router CPU comes from /proc (the process and its descendants)
and is reported per 1,000 requests; throughput as a ratio to the direct run of the same repeat;
added latency per pair; medians with min–max spreads over the repeats.

A load during which other jobs took more than ``peers.BUSY_SHARE`` of the machine
(``MachineLoad``) makes the whole run unreportable: the result says ``refused`` with the loads
that were disturbed, and the command prints no table and exits 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvroute.bench import peers as peerlib
from kvroute.bench.gateway import UPSTREAM, _compare, _gateway, _load, _stop, build_of, upstream_arg
from kvroute.ports import free_ports, wait_for_port

RUST = ("sglang-router", "vllm-router")


def _measure(pid: int, own: list[int], port: int, n: int, conc: int, stream: bool, limit_s: float) -> dict:
    """One load through the router at ``port``; its CPU (``pid`` and descendants) per request and
    the share of the machine other jobs took meanwhile."""
    load = peerlib.MachineLoad([pid, *own])
    cpu0 = peerlib.tree_cpu_s(pid)
    out = _load([f"http://127.0.0.1:{port}"], n, conc, stream, limit_s)
    out["cpu_us_per_req"] = (peerlib.tree_cpu_s(pid) - cpu0) * 1e6 / max(1, out["ok"] + out["errors"])
    out["others_share"] = load.others_share()
    return out


def _variants(presets: tuple[str, ...], baseline_src: str | None, peers: tuple[str, ...],
              progress: Any, compiled_src: str | None = None,
              access_logs: tuple[bool, ...] = (False,)) -> tuple[list[tuple[str, Any]], list[str]]:
    """(name, how to start it) for every router to measure, and the skip lines of missing peers.
    Each kvroute build runs once per ``access_logs`` setting; a row with the access log on is named
    ``… +access_log``."""
    builds: list[tuple[str, str | None]] = [("kvroute", None)]
    if compiled_src:
        builds.append(("kvroute compiled", compiled_src))
    if baseline_src:
        builds.append(("baseline", baseline_src))
    out: list[tuple[str, Any]] = [(f"{label} {p}{' +access_log' if on else ''}", ("kvroute", p, src, on))
                                  for label, src in builds for on in access_logs for p in presets]
    skipped = []
    for name in peers:
        peer = peerlib.PEERS.get(name)
        if peer is None:
            raise ValueError(f"unknown peer {name!r}; peers: {', '.join(peerlib.PEERS)}")
        exe = peer.find()
        if exe is None:
            line = f"{name}: not installed, skipped; install: {peer.install}"
            skipped.append(line)
            progress(line)
            continue
        out.append((name, (peer, exe)))
    return out, skipped


def _start(spec: Any, upstreams: list[int], tmp: Path) -> tuple[subprocess.Popen, int]:
    port, metrics_port = free_ports(2)
    if spec[0] == "kvroute":
        _, preset, src, access_log = spec
        cfg = tmp / f"{preset}.yaml"
        # access_log off: like the peers, which write no line per request (bench/peers.py); on, the gateway
        # still runs at --log-level WARNING (bench/gateway.py), so it pays the request-id header and the
        # level check but writes no line
        cfg.write_text(json.dumps({"port": port, "policy": preset, "access_log": access_log,
                                   "replicas": [{"url": f"http://127.0.0.1:{p}", "engine": "vllm"}
                                                for p in upstreams]}))
        proc = _gateway(src, cfg)
    else:
        peer, exe = spec
        proc = peerlib.start(peer, exe, port, upstreams, tmp, metrics_port)
    try:
        wait_for_port(port, 60.0)
    except TimeoutError:
        _stop(proc)
        raise
    return proc, port


def run(requests: int = 2000, concurrency: int = 32, repeats: int = 3, limit_s: float = 60.0,
        presets: tuple[str, ...] = ("round_robin",), delays: tuple[float, ...] = (0.0, 20.0),
        peers: tuple[str, ...] = tuple(peerlib.PEERS), baseline_src: str | None = None,
        busy_share: float = peerlib.BUSY_SHARE, progress: Any = print, compiled_src: str | None = None,
        access_logs: tuple[bool, ...] = (False,), upstream_spread_ms: float = 0.0) -> dict:
    """Every router at every delay, non-stream and stream, interleaved with direct runs; with
    ``compiled_src`` (``make compiled``'s build/compiled) kvroute's compiled build as well; each
    kvroute build with its access log off (like the peers), on, or both (``access_logs``)."""
    variants, skipped = _variants(presets, baseline_src, peers, progress, compiled_src, access_logs)
    builds = {"kvroute": build_of(None)}
    if compiled_src:
        builds["kvroute compiled"] = build_of(compiled_src)
    if baseline_src:
        builds["baseline"] = build_of(baseline_src)
    for name, build in builds.items():
        progress(f"{name}: {build}")
    result: dict = {"requests": requests, "concurrency": concurrency, "repeats": repeats, "skipped": skipped,
                    "upstream_spread_ms": upstream_spread_ms,
                    "busy_share_limit": busy_share, "delays": {}, "disturbed": [], "builds": builds}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for delay in delays:
            ups = free_ports(2)
            upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, upstream_arg(delay, upstream_spread_ms),
                                         *map(str, ups)],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                for p in ups:
                    wait_for_port(p)
                direct_urls = [f"http://127.0.0.1:{p}" for p in ups]
                runs: dict[str, dict[str, list[dict]]] = {m: {"direct": []} for m in ("nonstream", "stream")}
                for rep in range(repeats):
                    for mode, stream in (("nonstream", False), ("stream", True)):
                        runs[mode]["direct"].append(_load(direct_urls, requests, concurrency, stream, limit_s))
                    for name, spec in variants:  # one router alive at a time
                        proc, port = _start(spec, ups, tmp)
                        try:
                            for mode, stream in (("nonstream", False), ("stream", True)):
                                r = _measure(proc.pid, [upstream.pid], port, requests, concurrency, stream, limit_s)
                                runs[mode].setdefault(name, []).append(r)
                                if r["others_share"] > busy_share:
                                    result["disturbed"].append(f"{delay:g} ms {mode} {name} repeat {rep + 1}: "
                                                               f"other jobs took {r['others_share']:.0%}")
                                progress(f"{delay:g} ms {mode} repeat {rep + 1} {name}: {r['rps']:.0f} req/s, "
                                         f"{r['cpu_us_per_req']:.0f} µs CPU/request, others "
                                         f"{r['others_share']:.0%}")
                        finally:
                            _stop(proc)
                rows: dict = {}
                for mode, by_name in runs.items():
                    direct = by_name.pop("direct")
                    rows[mode] = {}
                    for name, via in by_name.items():
                        row = _compare(direct, via)
                        row["cpu_s_per_1000"] = round(row["gateway_cpu_us_per_req"] / 1000, 4)
                        row["others_share_max"] = round(max(v["others_share"] for v in via), 3)
                        rows[mode][name] = row
                result["delays"][f"{delay:g}"] = rows
            finally:
                _stop(upstream)
    result["refused"] = bool(result["disturbed"])
    result["verdict"] = verdict(result, presets)
    return result


def verdict(result: dict, presets: tuple[str, ...]) -> list[str]:
    """The issue's targets per delay and mode: kvroute's CPU ≤ 0.8× the best Rust router's,
    its throughput ratio ≥ theirs, added p50 ≤ 2.5 ms non-stream, and the gap to nginx."""
    lines = []
    for delay, rows in result["delays"].items():
        for mode, row in rows.items():
            rust = {n: r for n, r in row.items() if n in RUST}
            for name, k in row.items():
                if not name.startswith("kvroute "):
                    continue
                parts = [f"{delay} ms {mode} {name}: {k['cpu_s_per_1000']:.3f} s CPU/1000"]
                if rust:
                    best = min(rust.values(), key=lambda r: r["cpu_s_per_1000"])
                    ratio = k["cpu_s_per_1000"] / best["cpu_s_per_1000"]
                    top = max(r["rps_ratio"] for r in rust.values())
                    parts.append(f"{ratio:.2f}x the best Rust router's CPU ({'met' if ratio <= 0.8 else 'missed'} "
                                 f"≤ 0.8x); throughput ratio {k['rps_ratio']:.2f} vs best Rust "
                                 f"{top:.2f} ({'met' if k['rps_ratio'] >= top else 'missed'})")
                if mode == "nonstream":
                    parts.append(f"added p50 {k['added_p50_ms']:.2f} ms "
                                 f"({'met' if k['added_p50_ms'] <= 2.5 else 'missed'} ≤ 2.5 ms)")
                if "nginx" in row:
                    parts.append(f"{k['cpu_s_per_1000'] / row['nginx']['cpu_s_per_1000']:.1f}x nginx's CPU")
                lines.append("; ".join(parts))
    return lines

