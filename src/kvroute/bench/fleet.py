"""``kvroute bench fleet``: one gateway instance against three behind HAProxy, at the same offered
load over the same emulated replicas — and three without the NATS sync, to see what it buys.

The workload is planned once from the seed and replayed identically for every configuration:
chat sessions arrive as a Poisson process (``rate`` per second); each picks one of ``groups``
shared system prompts and runs 2-5 streamed turns (the full history each time, so turn n+1's
prompt extends turn n's), with an exponential think time between a reply and the next question.
Sessions are open-loop (arrivals do not wait for answers); turns within a session are not.
Every response is read at the client: TTFT, the replica (``x-kvroute-replica``), the engine's
``prompt_tokens`` and ``cached_tokens``. Before each run the replicas' caches are emptied and the
front (NATS, instances, HAProxy) is started fresh; configurations are interleaved per repeat so
drift of a shared machine hits all alike, and the table shows medians over the repeats.

Criteria of issue 19, 3 synced instances vs 1: cached-token share within 2 points, TTFT p99
within 10 %, and no replica above 1.2x its fair share of requests.

``--faults`` adds two runs of three synced instances: one instance SIGKILLed a third of the way
in (the requests it held fail fast, with the error the client saw; every request sent a second
after the kill is served), and NATS SIGKILLed a third of the way in and restarted at two thirds
(each instance's ``/health`` is polled: it says ``local-view``, then ``synced`` again).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.fleet.deploy import DEFAULT_PROFILE, RegionFleet
from kvroute.fleet.services import nats_server
from kvroute.live.loadgen import WORDS
from kvroute.stats import percentile

CONFIGS = (("1 instance", 1, True), ("3 instances", 3, True), ("3 instances, no sync", 3, False))


@dataclass(frozen=True)
class Workload:
    """The offered load: sessions, their arrival rate, shared prompts, turns, think time, output."""

    sessions: int = 120
    rate: float = 8.0  # sessions per second: enough that the replicas are busy and balancing matters
    groups: int = 6  # distinct system prompts
    system_words: int = 60  # shorter than a first question: sessions spread by load, then follow their history
    min_turns: int = 2
    max_turns: int = 5
    think_s: float = 0.4  # mean pause between a reply and the next question
    max_tokens: int = 32
    seed: int = 0


@dataclass
class Session:
    """One planned conversation: when it starts, its system prompt, its questions and pauses."""

    start_s: float
    system: str
    questions: list[str]
    pauses: list[float]
    user: str


def plan(w: Workload) -> list[Session]:
    """The workload's sessions, identical for a given seed."""
    rng = random.Random(w.seed)
    systems = [f"You are assistant {g}. " + " ".join(rng.choice(WORDS) for _ in range(w.system_words))
               for g in range(w.groups)]
    out, t = [], 0.0
    for s in range(w.sessions):
        t += rng.expovariate(w.rate)
        turns = rng.randint(w.min_turns, w.max_turns)
        out.append(Session(t, rng.choice(systems),
                           [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) for _ in range(turns)],
                           [rng.expovariate(1 / w.think_s) for _ in range(turns)], f"user-{s}"))
    return out


@dataclass
class Outcome:
    """One request as the client saw it."""

    sent_s: float  # since the run began
    ended_s: float
    ttft_s: float | None = None
    replica: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def _turn(session: aiohttp.ClientSession, url: str, messages: list[dict], w: Workload, user: str,
                t0: float) -> tuple[Outcome, str]:
    body = {"model": "emulated", "messages": messages, "max_tokens": w.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "user": user}
    sent = time.monotonic()
    out = Outcome(sent - t0, 0.0)
    answer: list[str] = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                try:
                    err = json.loads(text)["error"]
                    out.error = f"{resp.status} {err.get('code')}"
                except (ValueError, KeyError, TypeError):
                    out.error = f"{resp.status}"
            else:
                out.replica = resp.headers.get("x-kvroute-replica")
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - sent
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = f"stream error: {event['error'].get('code')}"
                        break
                    for ch in event.get("choices") or []:
                        answer.append((ch.get("delta") or {}).get("content") or "")
                    usage = event.get("usage")
                    if usage:
                        out.prompt_tokens = usage.get("prompt_tokens", 0)
                        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:160]
    out.ended_s = time.monotonic() - t0
    return out, "".join(answer)


async def drive(url: str, sessions: list[Session], w: Workload, events: Callable[[float], Any] | None = None,
                key: str | None = None) -> list[Outcome]:
    """Replay ``sessions`` against ``url``; ``events(elapsed)`` is awaited in the background (faults)."""
    outcomes: list[Outcome] = []
    t0 = time.monotonic()

    async def run(s: Session, http: aiohttp.ClientSession) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - t0)))
        messages: list[dict] = [{"role": "system", "content": s.system}]
        for question, pause in zip(s.questions, s.pauses):
            messages.append({"role": "user", "content": question})
            out, answer = await _turn(http, url, messages, w, s.user, t0)
            outcomes.append(out)
            if out.error:
                return  # the conversation ends with its failed turn
            messages.append({"role": "assistant", "content": answer})
            await asyncio.sleep(pause)

    timeout = aiohttp.ClientTimeout(total=60)
    auth = {"Authorization": f"Bearer {key}"} if key else None
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0), headers=auth) as http:
        side = asyncio.create_task(events(t0)) if events is not None else None
        await asyncio.gather(*(run(s, http) for s in sessions))
        if side is not None:
            await side
    return outcomes


def same_index(views: list[dict[str, Any]]) -> bool:
    """Whether every instance reports the same event-built index (blocks and digest per replica)."""
    return bool(views) and all(v.get("event_index") == views[0].get("event_index") for v in views) \
        and bool(views[0].get("event_index"))


def summarize(outcomes: list[Outcome], replicas: int) -> dict[str, Any]:
    """Requests, errors, TTFT p50/p99, cached-token share and the busiest replica's share of requests
    over its fair share."""
    ok = [o for o in outcomes if o.error is None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    per: dict[str, int] = {}
    for o in ok:
        per[o.replica or "?"] = per.get(o.replica or "?", 0) + 1
    prompt = sum(o.prompt_tokens for o in ok)
    fair = len(ok) / replicas if replicas else 0
    return {"requests": len(outcomes), "errors": len(outcomes) - len(ok),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "cached_share": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
            "max_over_fair": max(per.values()) / fair if per and fair else 0.0,
            "per_replica": dict(sorted(per.items()))}


async def _run_config(region: RegionFleet, instances: int, sync: bool, sessions: list[Session], w: Workload,
                      events: Callable[[RegionFleet, float], Any] | None = None) -> list[Outcome]:
    await region.reset()
    await region.start_front(instances, sync)
    try:
        outcomes = await drive(region.url, sessions, w, (lambda t0: events(region, t0)) if events else None,
                               key=region.client_key)
        if region.kv_events:
            await asyncio.sleep(0.5)  # the last events in flight
            region.last_views = await region.fleet_views()
        return outcomes
    finally:
        await region.stop_front()


async def _kill_instance(region: RegionFleet, t0: float, at_s: float, record: dict[str, Any]) -> None:
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    record["killed_at_s"] = time.monotonic() - t0
    await region.kill_instance(1)


async def _kill_nats(region: RegionFleet, t0: float, at_s: float, back_s: float, record: dict[str, Any]) -> None:
    states: list[tuple[float, list[str]]] = []
    stop = asyncio.Event()

    async def poll() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as http:
            while not stop.is_set():
                seen = []
                for child in region.instances:
                    try:
                        async with http.get(f"{child.url}/health") as r:
                            seen.append((await r.json(content_type=None)).get("fleet", "?"))
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        seen.append("down")
                states.append((time.monotonic() - t0, seen))
                await asyncio.sleep(0.1)

    poller = asyncio.create_task(poll())
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    assert region.nats is not None
    port = region.nats.port
    record["nats_killed_at_s"] = time.monotonic() - t0
    await asyncio.to_thread(region.nats.kill)
    await asyncio.sleep(max(0.0, back_s - (time.monotonic() - t0)))
    region.nats = nats_server(region.folder, port)
    await asyncio.to_thread(region.nats.start)
    record["nats_back_at_s"] = time.monotonic() - t0
    await asyncio.sleep(3.0)
    stop.set()
    await poller
    killed, back = record["nats_killed_at_s"], record["nats_back_at_s"]
    local = [t for t, s in states if killed <= t < back and all(x == "local-view" for x in s)]
    synced = [t for t, s in states if t >= back and all(x == "synced" for x in s)]
    record["all_local_view_after_s"] = round(local[0] - killed, 3) if local else None
    record["all_synced_after_s"] = round(synced[0] - back, 3) if synced else None


def _fault_rows(outcomes: list[Outcome], record: dict[str, Any], replicas: int) -> dict[str, Any]:
    row = summarize(outcomes, replicas) | record
    if "killed_at_s" in record:
        k = record["killed_at_s"]
        failed = [o for o in outcomes if o.error is not None]
        row["failed_in_flight"] = sum(1 for o in failed if o.sent_s < k)
        row["failed_max_after_kill_s"] = round(max((o.ended_s - k for o in failed), default=0.0), 3)
        row["errors_seen"] = sorted({(o.error or "").split(":")[0] for o in failed})
        later = [o for o in outcomes if o.sent_s >= k + 1.0]
        row["later_requests"] = len(later)
        row["later_failed"] = sum(1 for o in later if o.error is not None)
    return row


def run(workload: Workload, replicas: int = 4, profile: str = DEFAULT_PROFILE, policy: str = "skywalker",
        repeats: int = 3, kv_events: bool = True,
        faults: bool = False, folder: Path | None = None, progress: Callable[[str], None] = lambda m: None
        ) -> dict[str, Any]:
    """Every configuration ``repeats`` times, interleaved; medians per configuration; fault runs."""
    sessions = plan(workload)
    work = folder or Path(tempfile.mkdtemp(prefix="kvroute-bench-fleet-"))

    async def main() -> dict[str, Any]:
        region = RegionFleet(work, replicas=replicas, profile=profile, policy=policy, seed=workload.seed,
                             kv_events=kv_events)
        per: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in CONFIGS}
        out: dict[str, Any] = {"workload": workload.__dict__, "replicas": replicas, "profile": profile,
                               "policy": policy, "kv_events": kv_events, "repeats": repeats, "logs": str(work)}
        try:
            await region.start_replicas()
            for rep in range(repeats):
                for label, n, sync in CONFIGS:
                    progress(f"repeat {rep + 1}/{repeats}: {label}")
                    row = summarize(await _run_config(region, n, sync, sessions, workload), replicas)
                    row["index_identical"] = same_index(region.last_views) if region.kv_events else None
                    per[label].append(row)
            out["runs"] = per
            out["medians"] = {label: _medians(rows) for label, rows in per.items()}
            base, three = out["medians"]["1 instance"], out["medians"]["3 instances"]
            out["criteria"] = {
                "cached_share_points": round(100 * (three["cached_share"] - base["cached_share"]), 2),
                "ttft_p99_change": (three["ttft_p99_s"] / base["ttft_p99_s"] - 1) if base["ttft_p99_s"] else None,
                "max_over_fair": three["max_over_fair"]}
            c = out["criteria"]
            c["met"] = bool(abs(c["cached_share_points"]) <= 2 and c["ttft_p99_change"] is not None
                            and c["ttft_p99_change"] <= 0.10 and c["max_over_fair"] <= 1.2)
            if faults:
                span = sessions[-1].start_s
                rec: dict[str, Any] = {}
                progress("faults: one of 3 instances SIGKILLed")
                outs = await _run_config(region, 3, True, sessions, workload,
                                         lambda reg, t0: _kill_instance(reg, t0, span / 3, rec))
                out["kill_instance"] = _fault_rows(outs, rec, replicas)
                rec = {}
                progress("faults: NATS SIGKILLed, then restarted")
                outs = await _run_config(region, 3, True, sessions, workload,
                                         lambda reg, t0: _kill_nats(reg, t0, span / 3, 2 * span / 3, rec))
                out["kill_nats"] = _fault_rows(outs, rec, replicas)
        finally:
            await region.stop()
        return out

    return asyncio.run(main())


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("requests", "errors", "ttft_p50_s", "ttft_p99_s", "cached_share", "max_over_fair")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in keys}
    out.update({f"{k}_range": (min(r[k] for r in rows), max(r[k] for r in rows)) for k in keys[2:]})
    out["index_identical_runs"] = sum(1 for r in rows if r.get("index_identical"))
    out["runs"] = len(rows)
    return out


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """The comparison as rows: configuration, requests, errors, TTFT p50 / p99, cached share, busiest replica,
    runs after which every instance's event-built index was the same."""
    rows = []
    for label, m in result["medians"].items():
        lo, hi = m["ttft_p99_s_range"]
        clo, chi = m["cached_share_range"]
        rows.append([label, f"{m['requests']:.0f}", f"{m['errors']:.0f}", f"{1000 * m['ttft_p50_s']:.0f}",
                     f"{1000 * m['ttft_p99_s']:.0f} ({1000 * lo:.0f}–{1000 * hi:.0f})",
                     f"{100 * m['cached_share']:.1f} ({100 * clo:.1f}–{100 * chi:.1f})",
                     f"{m['max_over_fair']:.2f}",
                     f"{m['index_identical_runs']}/{m['runs']}" if result.get("kv_events", True) else "n/a"])
    return rows


def criteria_line(result: dict[str, Any]) -> str:
    """Issue 19's three criteria for 3 synced instances against 1, measured."""
    c = result["criteria"]
    change = c["ttft_p99_change"]
    return (f"3 vs 1 instance: cached share {c['cached_share_points']:+.1f} points (≤ ±2), TTFT p99 "
            f"{'n/a' if change is None else f'{100 * change:+.1f} %'} (≤ +10 %), busiest replica "
            f"{c['max_over_fair']:.2f}× its fair share (≤ 1.2) — {'met' if c['met'] else 'NOT met'}")


def fault_lines(result: dict[str, Any]) -> list[str]:
    """What the fault runs showed, one line each."""
    lines = []
    k = result.get("kill_instance")
    if k:
        lines.append(f"instance killed at {k['killed_at_s']:.1f} s: {k['failed_in_flight']} request(s) in flight "
                     f"failed, the last {k['failed_max_after_kill_s']:.2f} s after the kill "
                     f"({', '.join(k['errors_seen']) or 'none'}); {k['later_requests'] - k['later_failed']} of "
                     f"{k['later_requests']} requests sent from 1 s after the kill served")
    n = result.get("kill_nats")
    if n:
        lines.append(f"NATS killed at {n['nats_killed_at_s']:.1f} s, back at {n['nats_back_at_s']:.1f} s: "
                     f"{n['requests'] - n['errors']} of {n['requests']} requests served; every instance said "
                     f"local-view {n['all_local_view_after_s']} s after the kill and synced "
                     f"{n['all_synced_after_s']} s after NATS returned; cached share "
                     f"{100 * n['cached_share']:.1f} %")
    return lines

