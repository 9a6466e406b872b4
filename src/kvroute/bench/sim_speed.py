"""`kvroute bench sim-speed`: simulated requests per wall second, and a 1M-request run.

1. Capacity: the Mooncake conversation trace on 16 H20 / Qwen3-30B-A3B replicas, compressed
   (time_scale 0.02) until it saturates; its throughput is the deployment's capacity.
2. Speed: the trace re-timed to about 70% of that capacity, replayed under several presets;
   ``sim_requests_per_s`` is the median over presets of completed requests / wall seconds.
3. Scale: a synthetic open-loop chat workload of 1M requests on the same 16 replicas at 125
   req/s — about 70% of the ~180 req/s they sustain on it before preemption thrash (measured at
   rates 160–220) — run in a child process so its peak RSS is its own. It routes with LMetric:
   SkyWalker's load balancer, paced like the real one at one dispatch per 10 ms, cannot pass
   100 req/s, so at 125 req/s it would measure a growing queue rather than the simulator.

Builds: each speed run is a child process of its own, once per build available — pure Python
(``KVROUTE_PURE=1``) and, when this install has it, the mypyc-compiled build (kvroute/buildinfo.py)
— interleaved, ``repeats`` times, so both are measured in the same run on the same machine state.
Each child parses the trace before its clock starts (as one process replaying it several times
would) and reports a digest of its results: the builds must agree exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from kvroute import buildinfo
from kvroute.sim.scenario import parse_scenario
from kvroute.sim.simulation import Simulation

PRESETS = ("round_robin", "sglang_cache_aware", "skywalker", "lmetric")
TRACE = "mooncake/conversation_trace.jsonl"


def _mooncake(time_scale: float, preset: str) -> tuple[dict, float]:
    sc = parse_scenario({"replicas": [{"region": "us", "count": 16, "profile": "h20-qwen3-30b-a3b"}],
                         "workload": {"kind": "mooncake", "path": TRACE, "time_scale": time_scale},
                         "policies": [preset], "seed": 1})
    sim = Simulation(sc.setup(), preset, None, sc.make_workload())
    t0 = time.perf_counter()
    result = sim.run()
    return result, time.perf_counter() - t0


def _trace_rate() -> float:
    sc = parse_scenario({"workload": {"kind": "mooncake", "path": TRACE}})
    last, n = 0.0, 0
    for s in sc.make_workload().arrivals():
        last, n = s.req.arrival_s, n + 1
    return n / last


def million(requests: int = 1_000_000, replicas: int = 16, rate: float = 125.0) -> dict:
    """Simulate a million-request chat run; wall time, peak RSS and simulated requests per wall second."""
    sc = parse_scenario({"replicas": [{"region": "us", "count": replicas, "profile": "h20-qwen3-30b-a3b"}],
                         "workload": {"kind": "chat-poisson", "rate": rate, "clients": {"us": 1}},
                         "policies": ["lmetric"], "limits": {"max_requests": requests}, "seed": 1})
    sim = Simulation(sc.setup(), "lmetric", None, sc.make_workload())
    start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    result = sim.run()
    wall = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"requests": result["requests"], "wall_s": round(wall, 2), "peak_rss_mb": round(peak_kb / 1024, 1),
            "start_rss_mb": round(start_kb / 1024, 1),
            "bytes_per_request": round((peak_kb - start_kb) * 1024 / max(1, result["requests"])),
            "under_1gb": peak_kb < 1024 * 1024,
            "sim_requests_per_s": round(result["requests"] / wall), "ttft_p50_s": result["ttft_s"]["p50"],
            "throughput_rps": result["throughput_rps"], "replicas": replicas, "rate": rate}


def one(preset: str, time_scale: float) -> dict:
    """One speed run in this process (a child of :func:`run`): the trace parsed first, then the timed replay;
    which build ran and a digest of the results."""
    _trace_rate()  # parses and caches the trace: the clock below times the simulator alone
    result, wall = _mooncake(time_scale, preset)
    digest = hashlib.sha256(json.dumps(result, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"requests": result["requests"], "wall_s": wall, "build": buildinfo.describe(), "digest": digest,
            "ttft_mean_s": result["ttft_s"]["mean"]}


def _child(preset: str, time_scale: float, build: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != buildinfo.PURE_ENV}
    if build == "pure":
        env[buildinfo.PURE_ENV] = "1"
    proc = subprocess.run([sys.executable, "-c", "import json; from kvroute.bench.sim_speed import one; "
                           f"print(json.dumps(one({preset!r}, {time_scale!r})))"],
                          capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{build} run of {preset} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def builds_available() -> list[str]:
    """``pure``, and ``compiled`` when this install has the listed modules compiled."""
    return ["pure", "compiled"] if buildinfo.compiled_available() else ["pure"]


def run(progress=print, with_million: bool = True, million_requests: int = 1_000_000, repeats: int = 3,
        presets: tuple[str, ...] = PRESETS, builds: list[str] | None = None) -> dict:
    """Simulated requests per wall second on Mooncake under each preset, per build (pure and compiled,
    interleaved, ``repeats`` times each), then (optionally) the 1M run."""
    builds = builds or builds_available()
    saturated, _ = _mooncake(0.02, "round_robin")
    capacity = saturated["throughput_rps"]
    trace_rate = _trace_rate()
    scale = trace_rate / (0.7 * capacity)
    progress(f"capacity {capacity:.1f} req/s; trace {trace_rate:.2f} req/s → time_scale {scale:.3f}; "
             f"builds {', '.join(builds)}, {repeats} repeats each")
    runs: dict[str, dict[str, list[dict]]] = {b: {p: [] for p in presets} for b in builds}
    for rep in range(repeats):
        for preset in presets:
            # alternate which build goes first, so a drift of the machine's speed hits both alike
            for build in (builds if rep % 2 == 0 else builds[::-1]):
                r = _child(preset, scale, build)
                runs[build][preset].append(r)
                progress(f"{build:8} {preset}: {r['requests'] / r['wall_s']:,.0f} simulated requests/s "
                         f"(repeat {rep + 1}/{repeats})")
    per_build = {b: _summary(runs[b]) for b in builds}
    digests = {p: {r["digest"] for b in builds for r in runs[b][p]} for p in presets}
    out = {"builds": per_build, "identical": all(len(d) == 1 for d in digests.values()),
           "repeats": repeats, "replicas": 16, "profile": "h20-qwen3-30b-a3b",
           "capacity_rps": capacity, "time_scale": round(scale, 4), "target_load": 0.7}
    best = "compiled" if "compiled" in per_build else "pure"
    out["build"] = best  # the headline figures below are this build's
    out["sim_requests_per_s"] = per_build[best]["sim_requests_per_s"]
    out["per_preset"] = per_build[best]["per_preset"]
    if len(per_build) == 2:
        # paired: each repeat's compiled rate over the pure rate measured beside it
        ratios = [c["requests"] / c["wall_s"] / (p["requests"] / p["wall_s"])
                  for preset in presets for c, p in zip(runs["compiled"][preset], runs["pure"][preset])]
        out["speedup"] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                          "max": round(max(ratios), 3),
                          "of_medians": round(per_build["compiled"]["sim_requests_per_s"]
                                              / per_build["pure"]["sim_requests_per_s"], 3)}
    if with_million:
        progress(f"running {million_requests:,} synthetic requests in a child process ({best} build) ...")
        env = {k: v for k, v in os.environ.items() if k != buildinfo.PURE_ENV}
        if best == "pure":
            env[buildinfo.PURE_ENV] = "1"
        proc = subprocess.run([sys.executable, "-c",
                               "import json,sys; from kvroute.bench.sim_speed import million; "
                               f"print(json.dumps(million({million_requests})))"],
                              capture_output=True, text=True, timeout=900, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"1M run failed: {proc.stderr[-2000:]}")
        out["million"] = json.loads(proc.stdout.strip().splitlines()[-1])
        out["million"]["build"] = best
    return out


def _summary(by_preset: dict[str, list[dict]]) -> dict:
    """Per preset: the median rate over repeats and its spread; overall: the median of those medians."""
    per = {}
    for preset, rs in by_preset.items():
        rates = sorted(r["requests"] / r["wall_s"] for r in rs)
        per[preset] = {"sim_requests_per_s": round(statistics.median(rates)), "min": round(rates[0]),
                       "max": round(rates[-1]), "wall_s": round(statistics.median(r["wall_s"] for r in rs), 3),
                       "requests": rs[0]["requests"], "ttft_mean_s": rs[0]["ttft_mean_s"], "build": rs[0]["build"]}
    return {"sim_requests_per_s": round(statistics.median(v["sim_requests_per_s"] for v in per.values())),
            "per_preset": per}
