"""`kvroute bench hostile`: what each cheap, unauthenticated attack costs the gateway, beside what
it costs uvicorn and aiohttp serving the same routes.

Every attack runs from its own address (127.0.0.2) against a fresh server process, while a
prober opens a *new* connection from 127.0.0.1 every 20 ms for ``GET /health`` (so a connection
flood that locks new clients out shows as failed probes). For each the table reports the
server process's resident memory (peak during the attack and what is left 1 s after it, over the
level before) and CPU time, both from /proc, the probe latency and failures, and what the
attacker saw (bytes the server took before it stopped reading, answers, closes).

The reference servers are uvicorn (httptools, uvloop: what vLLM and SGLang serve with) and
aiohttp (the engine emulator's server) running a small app with the same routes: ``/health``,
``/metrics`` (a fixed text as long as the gateway's) and ``/v1/chat/completions`` (reads the body,
parses the JSON, answers at once; ``pad_bytes`` asks for an answer that long). The gateway's
upstreams answer the same way. The bound each attack is checked against (``--check``): RSS
growth ≤ 64 MB (what is left after an aborted-body attack, whose bodies are held while they
arrive by design, the peak for the rest), CPU ≤ 1 s, probe p99 ≤ 50 ms and no failed probe.
Every process started here is stopped by its PID; every attack is bounded in connections,
bytes and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from importlib.util import find_spec
from pathlib import Path

from kvroute.bench.attacks import (
    ATTACKER,
    aborted_bodies,
    idle,
    pipelined_answers,
    pipelined_bodies,
    pipelined_metrics,
    silent_flood,
    slow_headers,
    tiny_chunks,
    unterminated_trailer,
)
from kvroute.bench.gateway import UPSTREAM, _gateway, _proc_stats, _stop
from kvroute.ports import free_ports, wait_for_port

LIMITS = {"rss_mb": 64.0, "cpu_s": 1.0, "probe_p99_ms": 50.0}  # the bounds (issue 24)


@dataclass(frozen=True)
class AttackSpec:
    """One attack: its coroutine, and whether its bound is on what is left after it (``after``)
    or on the peak while it runs."""

    run: Callable[[int], Awaitable[dict]]
    bound_on: str = "peak"
    note: str = ""


ATTACKS: dict[str, AttackSpec] = {
    "aborted-bodies-10x16MiB-x3": AttackSpec(aborted_bodies, "after", "bodies are held while they arrive"),
    "pipelined-metrics-1.7MB-unread": AttackSpec(pipelined_metrics),
    "pipelined-200-answers-of-1MiB": AttackSpec(pipelined_answers),
    "unterminated-trailer-100MB": AttackSpec(unterminated_trailer),
    "silent-flood-4096": AttackSpec(silent_flood),
    "silent-flood-4096-from-4-addresses": AttackSpec(partial(silent_flood, addresses=4)),
    "idle-2000": AttackSpec(idle),
    "slow-headers-200": AttackSpec(slow_headers),
    "tiny-chunks-80057": AttackSpec(tiny_chunks),
    "pipelined-200x1MiB": AttackSpec(pipelined_bodies),
}

# -- probing and measuring -------------------------------------------------------------------------------

PROBER = r'''
import json, select, socket, sys, time
port, period = int(sys.argv[1]), float(sys.argv[2])
lat, failures = [], []
while not select.select([sys.stdin], [], [], 0)[0]:
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        ok = data[9:12] in (b"200", b"503") and b"too_many" not in data
        why = None if ok else (data[:12].decode("latin-1") or "closed")
    except OSError as exc:
        ok, why = False, type(exc).__name__
    dt = time.perf_counter() - t0
    if ok:
        lat.append(dt)
    else:
        failures.append(why)
    time.sleep(max(0.0, period - dt))
lat.sort()
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else None
print(json.dumps({"probes": len(lat) + len(failures), "p50_ms": q(0.5), "p99_ms": q(0.99),
                  "failed": len(failures), "failures": sorted(set(failures))[:4]}))
'''


class RSSPeak:
    """The peak resident memory of a process, sampled every 20 ms on a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, StopIteration):
                self.peak = max(self.peak, _proc_stats(self.pid)[0])

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(2)
        return self.peak


def measure(pid: int, port: int, name: str, settle_s: float = 1.0, spec: AttackSpec | None = None) -> dict:
    """Run attack ``name`` (or ``spec``) on ``port`` while probing ``/health``; the server process
    ``pid``'s memory and CPU over it (RSS growth: over the level before the attack)."""
    spec = spec or ATTACKS[name]
    rss0, cpu0 = _proc_stats(pid)
    sampler = RSSPeak(pid)
    prober = subprocess.Popen([sys.executable, "-c", PROBER, str(port), "0.02"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    try:
        observed = asyncio.run(asyncio.wait_for(spec.run(port), 180))
    except Exception as exc:  # the attack's own failure is a finding, not a crash of the bench
        observed = {"attack_failed": repr(exc)[:200]}
    wall = time.perf_counter() - t0
    time.sleep(settle_s)
    assert prober.stdin is not None
    out, _ = prober.communicate("stop\n", timeout=30)
    peak = sampler.stop()
    rss1, cpu1 = _proc_stats(pid)
    probes = json.loads(out.strip().splitlines()[-1])
    peak = max(peak, rss1)
    row = {"rss_before_mb": round(rss0, 1), "rss_peak_growth_mb": round(peak - rss0, 1),
           "rss_after_growth_mb": round(rss1 - rss0, 1), "cpu_s": round(cpu1 - cpu0, 2),
           "attack_s": round(wall, 1), "probe": probes, "attack": observed, "bound_on": spec.bound_on}
    row["rss_growth_mb"] = row["rss_after_growth_mb"] if spec.bound_on == "after" else row["rss_peak_growth_mb"]
    row["within"] = within(row)
    return row


def within(row: dict) -> dict[str, bool]:
    """Which of the issue's bounds a measured row meets."""
    p99 = row["probe"]["p99_ms"]
    return {"rss": row["rss_growth_mb"] <= LIMITS["rss_mb"], "cpu": row["cpu_s"] <= LIMITS["cpu_s"],
            "probe_p99": p99 is not None and p99 <= LIMITS["probe_p99_ms"],
            "probes_served": row["probe"]["failed"] == 0}


# -- the servers ----------------------------------------------------------------------------------------

REFERENCE_APP = r'''
import json, sys
kind, port, metrics_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
line = b'kvroute_reference_series{replica="r"} 1\n'
METRICS = (line * (metrics_len // len(line) + 1))[:metrics_len]
OK = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                              "finish_reason": "stop"}]}).encode()
def answer(path, body):
    if path == "/health":
        return 200, b'{"status": "ok"}', "application/json"
    if path == "/metrics":
        return 200, METRICS, "text/plain"
    try:
        req = json.loads(body)
    except ValueError:
        return 400, b'{"error": "bad json"}', "application/json"
    pad = req.get("pad_bytes") if isinstance(req, dict) else None
    if pad:
        return 200, json.dumps({"choices": [{"message": {"content": "x" * int(pad)}}]}).encode(), "application/json"
    return 200, OK, "application/json"
if kind == "uvicorn":
    import uvicorn
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        parts, more = [], True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            parts.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        status, body, ctype = answer(scope["path"], b"".join(parts))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode())]})
        await send({"type": "http.response.body", "body": body})
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                loop="uvloop", http="httptools")
else:
    import uvloop
    from aiohttp import web
    async def handle(request):
        status, body, ctype = answer(request.path, await request.read())
        return web.Response(status=status, body=body, content_type=ctype)
    app = web.Application(client_max_size=32 << 20)
    app.router.add_get("/health", handle)
    app.router.add_get("/metrics", handle)
    app.router.add_post("/v1/chat/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop())
'''


def references() -> list[str]:
    """The reference servers installed here (uvicorn comes with the ``bench`` extra)."""
    return [name for name in ("uvicorn", "aiohttp") if find_spec(name) is not None]


def _metrics_len(port: int) -> int:
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    n = len(c.getresponse().read())
    c.close()
    return n


def run(attacks=tuple(ATTACKS), baseline_src: str | None = None, with_references: bool = True,
        progress=print) -> dict:
    """Each attack against a fresh gateway, then (with ``baseline_src``) a gateway from another
    source tree, then each reference server."""
    up_ports = free_ports(2)
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, "0", *map(str, up_ports)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    procs = [upstream]
    servers = ["gateway"] + (["baseline"] if baseline_src else []) + (references() if with_references else [])
    result: dict = {"limits": LIMITS, "attacker": ATTACKER, "servers": {s: {} for s in servers}}
    metrics_len = 8192
    try:
        for p in up_ports:
            wait_for_port(p)
        with tempfile.TemporaryDirectory() as tmp:
            for attack in attacks:
                for server in servers:  # interleaved: drift of the shared machine hits all alike
                    port = free_ports(1)[0]
                    if server in ("gateway", "baseline"):
                        cfg = Path(tmp) / f"{server}.yaml"
                        cfg.write_text(json.dumps({"port": port, "policy": "round_robin",
                                                   "replicas": [{"url": f"http://127.0.0.1:{p}", "engine": "vllm"}
                                                                for p in up_ports]}))
                        proc = _gateway(baseline_src if server == "baseline" else None, cfg)
                    else:
                        proc = subprocess.Popen([sys.executable, "-c", REFERENCE_APP, server, str(port),
                                                 str(metrics_len)], stderr=subprocess.DEVNULL)
                    procs.append(proc)
                    try:
                        wait_for_port(port)
                        if server == "gateway":
                            metrics_len = _metrics_len(port)
                        time.sleep(0.5)  # its start-up work (imports, probes) is not the attack's
                        row = result["servers"][server][attack] = measure(proc.pid, port, attack)
                        progress(f"{attack} on {server}: RSS +{row['rss_growth_mb']:.0f} MB ({row['bound_on']}), "
                                 f"CPU {row['cpu_s']:.2f} s, probe p99 {row['probe']['p99_ms'] or 0:.1f} ms, "
                                 f"{row['probe']['failed']} failed; {json.dumps(row['attack'])}")
                    finally:
                        _stop(proc)
                        procs.remove(proc)
    finally:
        for proc in procs:
            _stop(proc)
    return result
