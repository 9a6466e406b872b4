"""`kvroute bench hostile`: does the gateway keep serving normal clients while hostile ones
hold connections, drip headers, send pathological bodies or pipeline without reading?

For each attack a normal closed-loop client (the same lean load client as ``bench gateway``, in
its own process) runs the same bounded load while the attack is in progress; the table compares
its latency with a quiet run and reports the gateway process's resident memory and CPU time
(from /proc) over the attack. With ``--baseline-src`` the same attacks run against a gateway
imported from another source tree, in the same run. Every process started here is stopped by
its PID; every attack is bounded in connections and time.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvroute.bench.gateway import UPSTREAM, _gateway, _load, _proc_stats, _stop
from kvroute.ports import free_ports, wait_for_port

ATTACKS = ("idle-2000", "slow-headers-200", "tiny-chunks-80057", "pipelined-200x1MiB")
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


def _chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()


class Attack:
    """One attack on a background event loop: ``start`` opens it, ``stop`` ends it and returns
    what it observed."""

    def __init__(self, name: str, port: int):
        self.name, self.port = name, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task] = []
        self.observed: dict = {}

    def start(self) -> None:
        """Start the attack's event-loop thread and open its connections."""
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self.loop).result(60)

    def stop(self) -> dict:
        """Close the attack's connections, stop its thread and return what it observed."""
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return self.observed

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers.append(w)
        return r, w

    async def _open(self) -> None:
        name = self.name
        if name == "idle-2000":
            for _ in range(2000):
                await self._connect()
        elif name == "slow-headers-200":
            for _ in range(200):
                _, w = await self._connect()
                w.write(HEAD)
                self.tasks.append(asyncio.create_task(self._drip(w)))
        elif name == "tiny-chunks-80057":
            self.tasks.append(asyncio.create_task(self._tiny_chunks()))
        elif name == "pipelined-200x1MiB":
            self.tasks.append(asyncio.create_task(self._pipelined()))
        await asyncio.sleep(0.5)  # let it take hold before the measured load starts

    async def _drip(self, w: asyncio.StreamWriter) -> None:
        i = 0
        while True:  # one header line a second, never the blank line
            await asyncio.sleep(1.0)
            w.write(b"X-Drip-%d: 1\r\n" % i)
            i += 1

    async def _tiny_chunks(self) -> None:
        r, w = await self._connect()
        body = _chat("x" * 80_000)
        w.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        t0 = time.perf_counter()
        w.write(b"".join(b"1\r\n%c\r\n" % b for b in body) + b"0\r\n\r\n")
        self.observed["chunks"] = len(body)
        status = await asyncio.wait_for(r.readline(), 120)
        self.observed["answered"] = status.decode("latin-1").strip()
        self.observed["answer_s"] = round(time.perf_counter() - t0, 3)

    async def _pipelined(self) -> None:
        _, w = await self._connect()
        body = _chat("y" * (1 << 20))
        one = HEAD + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        sent = 0
        for _ in range(200):  # never read a response: a well-behaved server stops reading too
            w.write(one)
            try:
                await asyncio.wait_for(w.drain(), 2.0)
            except TimeoutError:
                break
            sent += 1
        self.observed["requests_sent"] = sent

    async def _close(self) -> None:
        for t in self.tasks:
            if self.name == "tiny-chunks-80057" and not t.done():
                try:
                    await asyncio.wait_for(asyncio.shield(t), 120)  # its answer is the result
                except (TimeoutError, ConnectionError):
                    self.observed.setdefault("answered", "no answer within 120 s")
            t.cancel()
        if self.name == "tiny-chunks-80057" and self.tasks and self.tasks[0].done() \
                and not self.tasks[0].cancelled() and self.tasks[0].exception() is not None:
            self.observed["answered"] = f"connection failed: {self.tasks[0].exception()!r}"
        for w in self.writers:
            w.close()


def _measure(pid: int, port: int, requests: int, concurrency: int, limit_s: float, attack: str | None) -> dict:
    rss0, cpu0 = _proc_stats(pid)
    handle = Attack(attack, port) if attack else None
    if handle is not None:
        handle.start()
    t0 = time.perf_counter()
    load = _load([f"http://127.0.0.1:{port}"], requests, concurrency, False, limit_s)
    rss1, cpu1 = _proc_stats(pid)
    observed = handle.stop() if handle is not None else {}
    return {"rps": round(load["rps"], 1), "p50_ms": round(load["p50_ms"], 3), "p99_ms": round(load["p99_ms"], 3),
            "ok": load["ok"], "errors": load["errors"], "wall_s": round(time.perf_counter() - t0, 2),
            "gateway_rss_mb": round(rss1, 1), "gateway_rss_growth_mb": round(rss1 - rss0, 1),
            "gateway_cpu_s": round(cpu1 - cpu0, 2), "attack": observed}


def run(requests: int = 2000, concurrency: int = 8, limit_s: float = 60.0, attacks=ATTACKS,
        baseline_src: str | None = None, progress=print) -> dict:
    """Quiet run, then each attack, for this gateway and optionally a baseline one."""
    up_ports = free_ports(2)
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, "0", *map(str, up_ports)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    procs = [upstream]
    result: dict = {"requests": requests, "concurrency": concurrency, "variants": {}}
    try:
        for p in up_ports:
            wait_for_port(p)
        with tempfile.TemporaryDirectory() as tmp:
            for name, src in (("gateway", None), ("baseline", baseline_src)):
                if name == "baseline" and not src:
                    continue
                rows = result["variants"][name] = {}
                for attack in (None, *attacks):  # a fresh gateway per attack: no leftovers between them
                    port = free_ports(1)[0]
                    cfg = Path(tmp) / f"{name}.yaml"
                    cfg.write_text(json.dumps({"port": port, "policy": "round_robin", "max_body_bytes": 2 << 20,
                                               "replicas": [{"url": f"http://127.0.0.1:{p}", "engine": "vllm"}
                                                            for p in up_ports]}))
                    gw = _gateway(src, cfg)
                    procs.append(gw)
                    try:
                        wait_for_port(port)
                        row = rows[attack or "quiet"] = _measure(gw.pid, port, requests, concurrency, limit_s, attack)
                        progress(f"{name} {attack or 'quiet'}: p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, "
                                 f"{row['errors']} errors, RSS {row['gateway_rss_mb']:.0f} MB, "
                                 f"CPU {row['gateway_cpu_s']:.1f} s {row['attack'] or ''}")
                    finally:
                        _stop(gw)
                        procs.remove(gw)
    finally:
        for proc in procs:
            _stop(proc)
    return result
