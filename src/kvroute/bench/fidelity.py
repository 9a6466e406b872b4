"""`kvroute bench fidelity`: one workload live through the gateway in front of real engines and in
`kvroute simulate` with a calibrated profile, side by side (issue 12).

The workload: ``users`` closed-loop users in ``groups`` groups; each group shares a system prompt
of about ``system_tokens`` engine tokens; each user holds a conversation of 4-6 turns with
``max_tokens`` output tokens per turn, streamed. Conversations are scripted in advance (the
assistant turns in the history are fixed text, not what the model said), so the live run and the
simulator replay exactly the same prompts: the simulator reads them as an OpenAI-messages trace.
Every policy gets fresh system prompts, so no run starts with another's cache.

One run of ~60 requests has a p99 that is nearly its maximum, so the comparison repeats: repeat
i (seed ``seed + i``: the conversations' shape, the users' order and start instants, and the
simulator's seed) runs every policy live, the policies interleaved so that drift of the shared
machine hits all alike, and replays each in the simulator. A metric is then the median over the
repeats with its min-max spread, sim/live is the ratio of the medians, and TTFT p99 is also
taken over all repeats' requests pooled (a p99 of N×60 requests).

Live, each request's TTFT (the first chunk with a delta: the first token) and E2E are timed by
the client, and the engines' own ``usage.prompt_tokens`` / ``cached_tokens`` give the cached-token share. The
gateway runs as its own process (`kvroute serve`), as in a deployment. The simulator counts
prompts with the token ratio the live run observed (engine tokens per bytes/4 estimate: what the
gateway learns online), so both count the engine's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import yaml

from kvroute.bench.fidelity_calibration import engine_facts, run_factors, speed_probe, speed_reference
from kvroute.bench.fidelity_cpu import CpuLedger, background
from kvroute.bench.fidelity_engines import describe, engine_side
from kvroute.bench.fidelity_engines import scrape as engine_metrics
from kvroute.calibrate.measure import WORDS
from kvroute.ports import free_port
from kvroute.prefix import chat_key, estimate_tokens
from kvroute.stats import percentile

POLICIES = ("round_robin", "sglang_cache_aware", "lmetric", "skywalker")
METRICS = (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("e2e_p50", "E2E p50"),
           ("throughput", "req/s"), ("cached_share", "cached"))


@dataclass
class Workload:
    """The fidelity workload's shape (issue 12's defaults)."""

    users: int = 12
    groups: int = 3
    system_tokens: int = 1500
    turns: tuple[int, int] = (4, 6)
    max_tokens: int = 16
    seed: int = 0


def conversations(w: Workload, bytes_per_token: float, salt: str) -> list[list[dict]]:
    """One scripted conversation per user, shaped by ``w.seed`` alone (so every policy of a repeat
    gets the same turns and order); ``salt`` opens the system prompts, so they are fresh."""
    rng = random.Random(f"conversations-{w.seed}")  # not the live start instants' stream

    def text(tokens: int) -> str:
        words, size = [], 0
        while size < tokens * bytes_per_token:
            word = rng.choice(WORDS)
            words.append(word)
            size += len(word) + 1
        return " ".join(words)

    systems = [f"group {g} {salt}. " + text(w.system_tokens) for g in range(w.groups)]
    # users in a random order of groups (the order they start in), not g0, g1, g2, g0, ...: a
    # group's users may start close together, as independent users do
    groups = [u % w.groups for u in range(w.users)]
    rng.shuffle(groups)
    out = []
    for u in range(w.users):
        messages: list[dict] = [{"role": "system", "content": systems[groups[u]]}]
        for t in range(rng.randint(*w.turns)):
            if t:
                messages.append({"role": "assistant", "content": text(w.max_tokens * 2)})
            messages.append({"role": "user", "content": f"user {u} turn {t}: " + text(rng.randint(20, 60))})
        out.append(messages)
    return out


@dataclass
class LiveRequest:
    """One live request as the client saw it."""

    ttft: float
    e2e: float
    sent: float
    done: float
    prompt_tokens: int
    cached_tokens: int
    estimated_tokens: int
    user: int = -1  # which conversation, and which of its turns (for pairing with the simulator)
    turn: int = -1
    replica: str = ""  # the gateway's x-kvroute-replica


@dataclass
class LiveRun:
    """All requests of one policy's live run."""

    requests: list[LiveRequest] = field(default_factory=list)
    errors: int = 0


async def _one(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int,
               model: str = "default") -> LiveRequest:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage: dict = {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {(await r.text())[:200]}")
        replica = r.headers.get("x-kvroute-replica", "")
        async for line in r.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[5:])
            # the first chunk with a delta is the first token on both engines: llama-server sends
            # the role with the first token's text, vLLM the role when its first token is out (and
            # many of a random-weight model's tokens have empty text)
            if ttft is None and any("delta" in c for c in event.get("choices") or []):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    done = time.perf_counter()
    return LiveRequest(ttft if ttft is not None else done - t0, done - t0, t0, done,
                       int(usage.get("prompt_tokens", 0)),
                       int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                       estimate_tokens(chat_key(messages)), replica=replica)


async def _user(session: aiohttp.ClientSession, url: str, conv: list[dict], max_tokens: int, run: LiveRun,
                start_s: float, user: int = -1, model: str = "default") -> None:
    await asyncio.sleep(start_s)
    turn = 0
    for i, m in enumerate(conv):
        if m["role"] != "user":
            continue
        try:
            req = await _one(session, url, conv[:i + 1], max_tokens, model)
            req.user, req.turn = user, turn
            run.requests.append(req)
        except (aiohttp.ClientError, RuntimeError, TimeoutError):
            run.errors += 1
        turn += 1


async def live_run(gateway_url: str, convs: list[list[dict]], max_tokens: int, timeout_s: float = 300,
                   seed: int = 0, model: str = "default") -> LiveRun:
    """Every user's conversation, each turn after the previous answer (closed loop). Users start
    at uniformly random instants over the first second, as the simulator's closed-loop clients do
    (a thundering herd of first turns would be another workload), and conversation i is the i-th
    to start: the simulator hands a trace's conversations out in file order to clients as they
    start, so both sides see the groups arrive in the same order."""
    run = LiveRun()
    rng = random.Random(seed)
    starts = sorted(rng.random() for _ in convs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        await asyncio.gather(*(_user(session, gateway_url, c, max_tokens, run, t, u, model)
                               for u, (c, t) in enumerate(zip(convs, starts, strict=True))))
    return run


def breakdown(ttft: list[float], e2e: list[float], prompt: list[int], cached: list[int]) -> dict:
    """Where the time goes, for finding what a model lacks: TTFT of requests that found less than
    half their prompt cached (cold) and of the rest (warm), their shares, and the decode phase
    (E2E − TTFT)."""
    cold = [t for t, p, c in zip(ttft, prompt, cached, strict=True) if p and c < p / 2]
    warm = [t for t, p, c in zip(ttft, prompt, cached, strict=True) if p and c >= p / 2]
    return {"cold_requests": len(cold), "ttft_cold_p50": percentile(cold, 0.5), "ttft_warm_p50": percentile(warm, 0.5),
            "decode_p50": percentile([e - t for e, t in zip(e2e, ttft, strict=True)], 0.5),
            "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else 0.0}


def live_summary(run: LiveRun) -> dict:
    """The comparison's metrics from a live run (nearest-rank percentiles)."""
    r = run.requests
    span = max(x.done for x in r) - min(x.sent for x in r) if r else 0.0
    prompt = sum(x.prompt_tokens for x in r)
    t0 = min((x.sent for x in r), default=0.0)
    return {"requests": len(r), "errors": run.errors, "ttft_s": [x.ttft for x in r],
            "clock_t0": t0,  # the first request's time.perf_counter() (to align other records)
            # per request (for finding what the model lacks): sent (s from the first), TTFT, E2E,
            # prompt and cached tokens, conversation, turn, replica
            "per_request": [[round(x.sent - t0, 4), round(x.ttft, 4), round(x.e2e, 4), x.prompt_tokens,
                             x.cached_tokens, x.user, x.turn, x.replica] for x in r],
            "ttft_p50": percentile([x.ttft for x in r], 0.5), "ttft_p99": percentile([x.ttft for x in r], 0.99),
            "e2e_p50": percentile([x.e2e for x in r], 0.5), "throughput": len(r) / span if span else 0.0,
            "ttft_mean": statistics.fmean(x.ttft for x in r) if r else 0.0,
            "e2e_mean": statistics.fmean(x.e2e for x in r) if r else 0.0,
            "cached_share": sum(x.cached_tokens for x in r) / prompt if prompt else 0.0,
            "token_ratio": prompt / sum(x.estimated_tokens for x in r) if r else 1.0,
            **breakdown([x.ttft for x in r], [x.e2e for x in r], [x.prompt_tokens for x in r],
                        [x.cached_tokens for x in r])}


class GatewayProcess:
    """`kvroute serve` in its own process, stopped by its PID."""

    def __init__(self, urls: list[str], policy: str, folder: Path):
        self.config = folder / f"gateway-{policy}.yaml"
        self.port = free_port()
        self.config.write_text(yaml.safe_dump({
            "host": "127.0.0.1", "port": self.port, "policy": policy, "access_log": False,
            "replicas": [{"url": u, "id": f"engine-{i}"} for i, u in enumerate(urls)]}))
        self.log = folder / f"gateway-{policy}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The gateway's base URL on 127.0.0.1."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 20) -> None:
        """Start `kvroute serve` and return once /health reports a healthy replica; RuntimeError with the
        log's tail when it exits or times out."""
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvroute.cli", "serve", "--config", str(self.config),
                                          "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):  # not up yet
                    async with s.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200 and (await r.json()).get("healthy"):
                            return
                await asyncio.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the gateway did not become healthy; log: {self.log.read_text()[-800:]}")

    def cpu_s(self) -> float:
        """CPU seconds the gateway process has used so far (user + system, from /proc)."""
        assert self.proc is not None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM by PID (a graceful drain), SIGKILL if it has not exited 10 s later; nothing when it already
        ended."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def simulate(convs: list[list[dict]], policy: str, profile: str, replicas: int, token_ratio: float,
             max_tokens: int, folder: Path, seed: int = 0, host_cores: int | None = None,
             noise: bool = False, host_background: float = 0.0, speed: dict[str, float] | None = None) -> dict:
    """The same conversations through `kvroute simulate` (an OpenAI-messages trace); ``host_cores``:
    the replicas share one machine with that many cores (scenario ``host_cores``), where other work
    took ``host_background`` cores' worth (``host_background_cores``); ``noise``: the engines get
    the profile's measured timing noise and reordering (``engine_noise: profile``); ``speed``: the
    engines' speed around the live run against the calibration's (calibrate/speed_probe.py
    ``factors``), by which the profile's time terms are scaled (None: as calibrated)."""
    from kvroute.perf.loader import load_profile
    from kvroute.sim.runner import run_scenario
    from kvroute.sim.scenario import parse_scenario

    if speed is not None:
        from kvroute.calibrate.speed_probe import scaled

        path = folder / f"profile-{policy}-speed.yaml"
        path.write_text(yaml.safe_dump(scaled(load_profile(profile), speed).model_dump(), sort_keys=False))
        profile = str(path)
    trace = folder / f"conversations-{policy}.jsonl"
    trace.write_text("".join(json.dumps({"messages": c, "user": f"u{i}", "max_tokens": max_tokens}) + "\n"
                             for i, c in enumerate(convs)))
    # the live gateway is given the engines' URLs only, and no engine's /metrics says its batch limit
    # (replicas.py): its pending gate (SkyWalker's) assumes none, so the simulated balancers do too
    group = {"region": "local", "count": replicas, "profile": profile, "batch_limit_known": False}
    if host_cores:
        group["host_cores"] = host_cores
        if host_background:
            group["host_background_cores"] = host_background
    sc = parse_scenario({"replicas": [group],
                         # the engines cache prefixes in their own unit (calibrate reads it into the
                         # profile's block_size: vLLM's block size, llama-server 1), not the router's
                         "workload": {"kind": "openai", "path": str(trace), "clients": {"local": len(convs)},
                                      "token_ratio": token_ratio,
                                      "engine_block_tokens": load_profile(profile).block_size},
                         "policies": [policy], "seed": seed, **({"engine_noise": "profile"} if noise else {})})
    run = run_scenario(sc)[0]
    r, rec = run.result, run.recorder
    return {"requests": r["requests"], "errors": sum(r["failed"].values()), "ttft_s": list(rec.ttft),
            # per request: sent, TTFT, E2E, prompt and cached tokens, replica index
            "per_request": [[round(s, 4), round(t, 4), round(e, 4), p, c, i] for s, t, e, p, c, i in zip(
                rec.sent_at, rec.ttft, rec.e2e, rec.prompt_tokens, rec.cached_tokens, rec.replica, strict=True)],
            "ttft_p50": r["ttft_s"]["p50"], "ttft_p99": r["ttft_s"]["p99"], "e2e_p50": r["e2e_s"]["p50"],
            "ttft_mean": statistics.fmean(rec.ttft) if rec.ttft else 0.0,
            "e2e_mean": statistics.fmean(rec.e2e) if rec.e2e else 0.0,
            "throughput": r["throughput_rps"], "cached_share": r["prefix_hit_rate"],
            **breakdown(list(rec.ttft), list(rec.e2e), list(rec.prompt_tokens), list(rec.cached_tokens))}


def _ratio(sim: float, live: float) -> float | None:
    return sim / live if live else None


def combine_repeats(repeats: list[dict]) -> dict:
    """One policy's repeats as the comparison reports them: per side the median of every number
    over the repeats (``live``, ``sim``) and its [min, max] (``live_range``, ``sim_range``), errors
    summed, sim/live as the ratio of the medians, and TTFT p99 over all repeats' requests pooled;
    ``repeats`` keeps every repeat's own numbers."""
    row: dict = {"repeats": repeats, "errors": {}, "ttft_p99_pooled": {}}
    for side in ("live", "sim"):
        numbers = [k for k, v in repeats[0][side].items() if isinstance(v, int | float) and k != "clock_t0"]
        row[side] = {k: statistics.median(r[side][k] for r in repeats) for k in numbers}
        row[f"{side}_range"] = {k: [min(r[side][k] for r in repeats), max(r[side][k] for r in repeats)]
                                for k in numbers}
        row["errors"][side] = sum(r[side]["errors"] for r in repeats)
        row["ttft_p99_pooled"][side] = percentile([t for r in repeats for t in r[side]["ttft_s"]], 0.99)
    row["sim_over_live"] = {k: _ratio(row["sim"][k], row["live"][k]) for k, _ in METRICS}
    pooled = row["ttft_p99_pooled"]
    pooled["sim_over_live"] = _ratio(pooled["sim"], pooled["live"])
    return row


async def run_fidelity(urls: list[str], profile: str, policies: tuple[str, ...] = POLICIES,
                       workload: Workload | None = None, log=None, host_cores: int | None = None,
                       repeats: int = 3, noise: bool = True, speed: bool = False) -> dict:
    """``repeats`` live and simulated runs of every policy (repeat i: seed ``workload.seed + i``,
    the policies interleaved within it); returns every repeat, the medians with their spread and
    the ratios of the medians. ``host_cores``: the cores the engines share (None: the simulator
    gives every engine a machine of its own). ``noise``: simulate with the profile's measured engine
    noise (a real engine has it; its p99 does not come from the mean model alone). ``speed``: the
    profile was calibrated just now; probe the engines' speed before and after every live run, and simulate
    each run with the profile scaled by its factors against the profile's own prediction of the probe
    (calibrate/speed_probe.py: the machine's speed drifts within minutes)."""
    w = workload or Workload()
    say = log or (lambda _msg: None)
    model, bpt = await engine_facts(urls[0])
    out: dict = {"workload": w.__dict__, "engines": urls, "profile": profile, "bytes_per_token": bpt,
                 "host_cores": host_cores, "repeats": repeats, "engine_noise": noise, "policies": {}}
    reference = await speed_reference(urls, model, profile, host_cores, out, say) if speed else None
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    with tempfile.TemporaryDirectory(prefix="kvroute-fidelity-") as tmp:
        folder = Path(tmp)
        for i in range(repeats):
            wi = replace(w, seed=w.seed + i)
            for policy in policies:
                salt = f"{policy}-{time.time_ns()}"
                convs = conversations(wi, bpt, salt=salt)
                before = await speed_probe(urls, model) if reference is not None else None
                gw = GatewayProcess(urls, policy, folder)
                await gw.start()
                try:
                    metrics0 = await engine_metrics(urls)
                    ledger = CpuLedger(urls)
                    cpu0, gw_cpu0, t0 = time.process_time(), gw.cpu_s(), time.perf_counter()
                    run = await live_run(gw.url, convs, w.max_tokens, seed=wi.seed, model=model)
                    wall = time.perf_counter() - t0
                    live = live_summary(run)
                    # the engines' own stage times over the run (vLLM's histograms; none from llama-server)
                    live["engine_side"] = engine_side(metrics0, await engine_metrics(urls))
                    # what the balancer, the clients and everything else cost the cores the engines share
                    live["host_cpu"] = ledger.stop(wall, gw.cpu_s() - gw_cpu0, time.process_time() - cpu0)
                    live["gateway_cpu_share"] = live["host_cpu"]["gateway"]
                    live["client_cpu_share"] = live["host_cpu"]["client"]
                    live["load_average"] = os.getloadavg()[0]
                finally:
                    gw.stop()
                factors = None
                if reference is not None and before is not None:
                    after = await speed_probe(urls, model)
                    factors = run_factors(profile, len(urls), host_cores, background(live, host_cores), before, after)
                    live["speed"] = {"before": before.as_dict(), "after": after.as_dict(), "factors": factors}
                sim = simulate(convs, policy, profile, len(urls), live["token_ratio"], w.max_tokens, folder,
                               wi.seed, host_cores, noise, background(live, host_cores), factors)
                ratio = {k: _ratio(sim[k], live[k]) for k, _ in METRICS}
                rec = {"seed": wi.seed, "salt": salt, "live": live, "sim": sim, "sim_over_live": ratio}
                if factors:  # the same without the speed factors, to say what they changed
                    rec["sim_as_calibrated"] = simulate(convs, policy, profile, len(urls), live["token_ratio"],
                                                        w.max_tokens, folder, wi.seed, host_cores, noise,
                                                        background(live, host_cores))
                runs[policy].append(rec)
                say(f"repeat {i + 1}/{repeats} {policy}: TTFT p99 live {live['ttft_p99'] * 1000:.0f} ms, "
                    f"sim {sim['ttft_p99'] * 1000:.0f} ms" + (
                        f" (engines' speed x{factors['prefill']:.2f} prefill, x{factors['decode']:.2f} decode)"
                        if factors else ""))
                if live["engine_side"]:
                    say(f"  {describe(live['engine_side'], live['ttft_mean'], live['e2e_mean'])}")
    return with_as_calibrated(summarize(out, runs), runs)


def with_as_calibrated(out: dict, runs: dict[str, list[dict]]) -> dict:
    """``out`` plus ``as_calibrated``: the counts the same runs give simulated with the profile as calibrated
    (no speed factors), where every repeat kept that simulation (``sim_as_calibrated``)."""
    if runs and all("sim_as_calibrated" in r for rs in runs.values() for r in rs):
        plain = {p: [{**r, "sim": r["sim_as_calibrated"],
                      "sim_over_live": {k: _ratio(r["sim_as_calibrated"][k], r["live"][k]) for k, _ in METRICS}}
                     for r in rs] for p, rs in runs.items()}
        got = summarize({"policies": {}}, plain)
        out["as_calibrated"] = {k: got[k] for k in ("within_20pct", "within_10pct", "compared",
                                                    "pooled_p99_within_20pct", "pooled_p99_compared")}
        out["as_calibrated"]["sim_over_live"] = {p: row["sim_over_live"] for p, row in got["policies"].items()}
    return out


def summarize(out: dict, runs: dict[str, list[dict]]) -> dict:
    """``out`` with every policy's repeats combined (:func:`combine_repeats`), the rankings and the
    counts of ratios within 20 % and 10 %."""
    rows = out["policies"] = {p: combine_repeats(r) for p, r in runs.items()}
    out["ranking_ttft_p99"] = {side: sorted(rows, key=lambda p: rows[p][side]["ttft_p99"]) for side in ("live", "sim")}
    out["ranking_ttft_p99_pooled"] = {side: sorted(rows, key=lambda p: rows[p]["ttft_p99_pooled"][side])
                                      for side in ("live", "sim")}
    ratios = [abs(r - 1) for p in rows.values() for r in p["sim_over_live"].values() if r is not None]
    out["within_20pct"] = sum(x <= 0.2 for x in ratios)
    out["within_10pct"] = sum(x <= 0.1 for x in ratios)
    out["compared"] = len(ratios)
    pooled = [abs(p["ttft_p99_pooled"]["sim_over_live"] - 1) for p in rows.values()
              if p["ttft_p99_pooled"]["sim_over_live"] is not None]
    out["pooled_p99_within_20pct"] = sum(x <= 0.2 for x in pooled)
    out["pooled_p99_compared"] = len(pooled)
    return out
