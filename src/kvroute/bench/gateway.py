"""`kvroute bench gateway`: what the gateway costs, measured against going direct, in one run.

Trivial upstreams (answer at once, or after ``--upstream-delay-ms`` like an engine's time to first
token, plus with ``--upstream-spread-ms`` a seeded uniform draw up to that many ms, so that requests
sent together are not answered together every time; ``/metrics`` in vLLM's names so probes pass) run in their own
process; the load generator in another (keep-alive, fixed concurrency, on the gateway's own lean
HTTP/1.1 client so that the client is not what saturates the two cores); each gateway under test
in a third. For every preset and for both non-stream and stream (16 SSE chunks) it
runs the same bounded load direct (client-side round robin over the upstreams) and through the
gateway, alternating, and reports the ratio of requests/s and the added p50/p99 latency as
medians over the paired repeats with their spread; an overhead below the noise is reported as
such, never as a negative number.
Every process started here is stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvroute.ports import free_ports, wait_for_port

PRESETS = ("round_robin", "sglang_cache_aware", "skywalker", "lmetric")

UPSTREAM = r'''
import asyncio, json, random, sys
from aiohttp import web
base, _, spread = sys.argv[1].partition(",")  # "20" or "20,2": 20 ms, plus a uniform draw from [0, 2) ms
delay, spread = float(base) / 1000, float(spread or 0) / 1000
draw = random.Random(0).random  # seeded: every run draws the same sequence
ports = [int(p) for p in sys.argv[2:]]
BODY = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}).encode()
CHUNK = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"t"}}]}\n\n'
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"
async def chat(request):
    body = await request.json()
    if delay or spread:
        await asyncio.sleep(delay + spread * draw())  # an engine's time to first token
    if not body.get("stream"):
        if body.get("pad_bytes"):  # an answer this long (bench hostile: answers a client never reads)
            text = "x" * int(body["pad_bytes"])
            padded = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "stop"}]}
            return web.Response(body=json.dumps(padded).encode(), content_type="application/json")
        return web.Response(body=BODY, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(16):
        await resp.write(CHUNK)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
async def metrics(request):
    return web.Response(body=METRICS, content_type="text/plain")
async def health(request):  # the Rust routers (bench gateway --peers) check their workers here
    return web.json_response({"status": "ok"})
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})
async def main():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    for path in ("/health", "/health_generate", "/get_server_info", "/get_model_info"):
        app.router.add_get(path, health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for p in ports:
        await web.TCPSite(runner, "127.0.0.1", p).start()
    print("ready", flush=True)
    await asyncio.Event().wait()
import uvloop; uvloop.run(main())
'''

CLIENT = r'''
import asyncio, contextlib, itertools, json, sys, time
from kvroute.gateway.upstream import UpstreamError, UpstreamPool
from kvroute.stats import percentile_sorted
urls, n, conc = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
stream, limit_s = sys.argv[4] == "1", float(sys.argv[5])
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say ok. " * 8}], "max_tokens": 16,
                   "stream": stream}).encode()
headers = [("Content-Type", "application/json")]
async def main():
    pools = [UpstreamPool(u, max_idle=conc) for u in urls]
    rr = itertools.cycle(pools)
    lat, errors, remaining = [], 0, n
    async def one(pool):
        r = await pool.post("/v1/chat/completions", body, headers, connect_s=5, first_byte_s=30, idle_s=30)
        try:
            await r.read()
            return r.status == 200
        finally:
            r.release()
    for _ in range(50):  # warm the connections; a failure here shows in the measured run
        with contextlib.suppress(UpstreamError):
            await one(pools[0])
    deadline = time.perf_counter() + limit_s
    async def worker():
        nonlocal remaining, errors
        while remaining > 0 and time.perf_counter() < deadline:
            remaining -= 1
            t0 = time.perf_counter()
            try:
                ok = await one(next(rr))
            except UpstreamError:
                ok = False
            if ok:
                lat.append(time.perf_counter() - t0)
            else:
                errors += 1
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - start
    lat.sort()
    q = lambda p: percentile_sorted(lat, p) * 1000
    print(json.dumps({"rps": len(lat) / wall, "p50_ms": q(0.5), "p99_ms": q(0.99), "ok": len(lat), "errors": errors}))
import uvloop; uvloop.run(main())
'''


def upstream_arg(delay_ms: float, spread_ms: float = 0.0) -> str:
    """The fake upstream's first argument: its delay in ms, and ``,spread`` when answers are spread."""
    return f"{delay_ms:g},{spread_ms:g}" if spread_ms else f"{delay_ms:g}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _load(urls: list[str], n: int, conc: int, stream: bool, limit_s: float) -> dict:
    out = subprocess.run([sys.executable, "-c", CLIENT, ",".join(urls), str(n), str(conc), "1" if stream else "0",
                          str(limit_s)], capture_output=True, text=True, timeout=limit_s + 60)
    if out.returncode != 0:
        raise RuntimeError(f"load client failed: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _proc_stats(pid: int) -> tuple[float, float]:
    """(resident MB, CPU seconds) of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


def _load_via(pid: int, port: int, n: int, conc: int, stream: bool, limit_s: float) -> dict:
    """A load through one gateway, with the gateway process's CPU time per completed request:
    unlike throughput, that does not depend on what else the shared cores are doing."""
    cpu0 = _proc_stats(pid)[1]
    out = _load([f"http://127.0.0.1:{port}"], n, conc, stream, limit_s)
    out["cpu_us_per_req"] = (_proc_stats(pid)[1] - cpu0) * 1e6 / max(1, out["ok"] + out["errors"])
    return out


def _compare(direct: list[dict], via: list[dict]) -> dict:
    """Gateway vs direct from paired repeats (repeat i of each ran back to back).

    Added latency is taken per pair and summarised as the median with its min–max spread. A
    proxy hop cannot make requests faster, so a median at or below zero means the overhead is
    smaller than the run-to-run noise: it is reported as 0 with ``*_resolved: false`` and the
    spread, never as a negative number.
    """
    med = statistics.median
    row = {"gateway_rps": round(med(r["rps"] for r in via), 1),
           "direct_rps": round(med(r["rps"] for r in direct), 1),
           "errors": sum(r["errors"] for r in via)}
    cpu = [r["cpu_us_per_req"] for r in via if "cpu_us_per_req" in r]
    if cpu:
        row["gateway_cpu_us_per_req"] = round(med(cpu), 1)
        row["gateway_cpu_us_per_req_spread"] = [round(min(cpu), 1), round(max(cpu), 1)]
        row["gateway_cpu_us_per_req_runs"] = [round(c, 1) for c in cpu]  # repeat by repeat: the gate pairs them
    ratios = [v["rps"] / d["rps"] for d, v in zip(direct, via) if d["rps"] > 0]
    row["rps_ratio"] = round(med(ratios), 3) if ratios else 0.0
    row["rps_ratio_spread"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else [0.0, 0.0]
    for q in ("p50", "p99"):
        added = [v[f"{q}_ms"] - d[f"{q}_ms"] for d, v in zip(direct, via)]
        m = med(added)
        row[f"added_{q}_ms"] = round(max(0.0, m), 3)
        row[f"added_{q}_ms_spread"] = [round(min(added), 3), round(max(added), 3)]
        row[f"added_{q}_resolved"] = m > 0 and min(added) > 0
    return row


def added_text(row: dict, q: str) -> str:
    """``0.42 ms (0.31–0.55)``, or ``< noise (−0.10–0.20)`` when the overhead is not resolved."""
    lo, hi = row[f"added_{q}_ms_spread"]
    spread = f"({lo:.2f}–{hi:.2f})"
    if not row[f"added_{q}_resolved"]:
        return f"< noise {spread}"
    return f"{row[f'added_{q}_ms']:.2f} ms {spread}"


def _env(src: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def _gateway(src: str | None, cfg: Path) -> subprocess.Popen:
    """A gateway process; ``src`` puts another source tree (e.g. a worktree of an older commit, or
    ``make compiled``'s build/compiled) first on its import path, for an A/B comparison against
    the same load client and upstreams."""
    return subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(cfg),
                             "--log-level", "WARNING"], stderr=subprocess.DEVNULL, env=_env(src))


def build_of(src: str | None) -> str:
    """Which build a gateway started with ``src`` first on its path runs: pure Python or
    compiled by mypyc (``kvroute.buildinfo``; a tree older than it is pure)."""
    out = subprocess.run([sys.executable, "-c", "from kvroute.buildinfo import describe; print(describe())"],
                         env=_env(src), capture_output=True, text=True, timeout=120)
    return out.stdout.strip() if out.returncode == 0 else "pure Python (a tree without kvroute.buildinfo)"


def run(requests: int = 20000, concurrency: int = 32, repeats: int = 3, limit_s: float = 30.0,
        presets=PRESETS, upstream_delay_ms: float = 0.0, baseline_src: str | None = None,
        compiled_src: str | None = None, progress=print, gateway_src: str | None = None,
        upstream_spread_ms: float = 0.0) -> dict:
    """Every preset, non-stream and stream: direct, via this gateway (``gateway_src``: imported from
    that tree instead of this install, e.g. a compiled build), (with ``baseline_src``) via a
    baseline gateway and (with ``compiled_src``, e.g. build/compiled) via this gateway's compiled
    build, repeated and interleaved so drift hits all of them alike; the gateways' order flips
    from one repeat to the next, so that no variant always runs first after the direct load, and
    each gateway first takes an unmeasured load per mode (up to 1,000 requests): ``auto``'s first
    load cost it 1,140–1,655 µs of CPU per request against ~250 for later ones (quiet,
    docs/hot-path.md, thirteenth round), which made repeat 1 an outlier."""
    up_ports = free_ports(2)
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM, upstream_arg(upstream_delay_ms, upstream_spread_ms),
                                 *map(str, up_ports)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    procs = [upstream]
    result: dict = {"nonstream": {}, "stream": {}, "requests": requests, "concurrency": concurrency,
                    "repeats": repeats, "upstream_delay_ms": upstream_delay_ms,
                    "upstream_spread_ms": upstream_spread_ms}
    if baseline_src:
        result.update(baseline_src=baseline_src, baseline={"nonstream": {}, "stream": {}})
    if compiled_src:
        result.update(compiled_src=compiled_src, compiled={"nonstream": {}, "stream": {}})
    srcs = {"gateway": gateway_src, "baseline": baseline_src, "compiled": compiled_src}
    result["builds"] = builds = {name: build_of(src) for name, src in srcs.items() if name == "gateway" or src}
    for name, build in builds.items():
        progress(f"{name}: {build}")
    try:
        for p in up_ports:
            wait_for_port(p)
        direct_urls = [f"http://127.0.0.1:{p}" for p in up_ports]
        with tempfile.TemporaryDirectory() as tmp:
            for preset in presets:
                gateways = {}
                for name, src in srcs.items():
                    if name != "gateway" and not src:
                        continue
                    port = free_ports(1)[0]
                    cfg = Path(tmp) / f"{preset}-{name}.yaml"
                    cfg.write_text(json.dumps({"port": port, "policy": preset, "replica_header": True,
                                               "replicas": [{"url": u, "engine": "vllm"} for u in direct_urls]}))
                    proc = _gateway(src, cfg)
                    procs.append(proc)
                    gateways[name] = (proc, port)
                try:
                    for _, port in gateways.values():
                        wait_for_port(port)
                    for mode, stream in (("nonstream", False), ("stream", True)):
                        direct: list[dict] = []
                        via: dict[str, list[dict]] = {name: [] for name in gateways}
                        order = list(gateways.items())
                        for _, (_, port) in order:  # unmeasured: one-time costs (a preset's first fit) out of repeat 1
                            _load([f"http://127.0.0.1:{port}"], min(requests, 1000), concurrency, stream, limit_s)
                        for _ in range(repeats):  # interleaved so drift hits every variant alike
                            direct.append(_load(direct_urls, requests, concurrency, stream, limit_s))
                            for name, (proc, port) in order:
                                via[name].append(_load_via(proc.pid, port, requests, concurrency, stream, limit_s))
                            order.reverse()
                        for name, runs in via.items():
                            row = _compare(direct, runs)
                            (result if name == "gateway" else result[name])[mode][preset] = row
                            progress(f"{preset} {mode} ({name}): {row['gateway_rps']:.0f} vs "
                                     f"{row['direct_rps']:.0f} req/s ({row['rps_ratio']:.2f}x), "
                                     f"{row['gateway_cpu_us_per_req']:.0f} µs CPU/request, added p50 "
                                     f"{added_text(row, 'p50')}, p99 {added_text(row, 'p99')}")
                finally:
                    for proc, _ in gateways.values():
                        _stop(proc)
                        procs.remove(proc)
    finally:
        for proc in procs:
            _stop(proc)
    return result


def cpu_ratio(row: dict, base: dict, paired: bool = True) -> tuple[float, list[float]]:
    """This row's CPU per request over the baseline's: with ``paired`` (both measured in the same
    run, repeat i of each back to back, so drift and the machine's state cancel pair by pair) the
    median of the per-repeat ratios, else the ratio of the medians (a stored baseline, or a row
    without its repeats). Returns (the ratio, the per-repeat ratios; empty when unpaired)."""
    now, then = row.get("gateway_cpu_us_per_req_runs"), base.get("gateway_cpu_us_per_req_runs")
    if paired and now and then and len(now) == len(then) and all(then):
        pairs = [a / b for a, b in zip(now, then)]
        return statistics.median(pairs), pairs
    med_now, med_then = row["gateway_cpu_us_per_req"], base["gateway_cpu_us_per_req"]
    return (med_now / med_then if med_then else float("inf")), []


def gate(rows: dict, baseline: dict, tolerance: float, paired: bool = True) -> tuple[list[str], list[str]]:
    """The regression gate: for every preset and mode in both, this gateway's CPU per request
    against the baseline's (a ``--baseline-src`` build measured in the same run: the median of the
    paired per-repeat ratios, :func:`cpu_ratio`; or, ``paired`` false, a stored ``--json`` result
    from the same machine: the ratio of the medians). Returns (every comparison, the failures: slower than the
    baseline by more than ``tolerance``, e.g. 0.10 = 10 %)."""
    lines, failed = [], []
    for mode in ("nonstream", "stream"):
        for preset, row in rows.get(mode, {}).items():
            base = baseline.get(mode, {}).get(preset)
            if base is None or "gateway_cpu_us_per_req" not in base:
                continue
            now, then = row["gateway_cpu_us_per_req"], base["gateway_cpu_us_per_req"]
            ratio, pairs = cpu_ratio(row, base, paired)
            how = (f"median of {len(pairs)} paired repeats, {min(pairs) - 1:+.0%} to {max(pairs) - 1:+.0%}"
                   if pairs else "ratio of medians")
            line = (f"{preset} {mode}: {now * 1000 / 1e6:.3f} s CPU per 1,000 requests vs baseline "
                    f"{then * 1000 / 1e6:.3f} s ({ratio - 1:+.0%}, {how}; allowed +{tolerance:.0%})")
            lines.append(line)
            if ratio > 1 + tolerance:
                failed.append(line)
    return lines, failed


def export_ref(ref: str, dest: str) -> str:
    """The ``src/`` of git revision ``ref`` of the current repository, unpacked under ``dest``
    (a baseline build for ``--baseline-src``); returns its path."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    archive = subprocess.run(["git", "-C", root.stdout.strip(), "archive", ref, "src"], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return str(Path(dest) / "src")
