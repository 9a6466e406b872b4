"""`kvroute bench kv-events`: routing on the engines' KV events vs on the approximate index, and
what consuming the events costs (issue 19).

**Routing.** Emulated replicas (the simulator's engine model in real time, vLLM's API) with a
small KV cache publish their cache's events; a gateway in front of them routes a multi-tenant,
multi-turn chat workload whose working set (every tenant's system prompt and conversation) is
larger than the replicas' KV capacity together, so caches evict all along. Each cache-aware
preset runs twice on the same seeded workload: with ``replicas[].kv_events`` (the exact table) and
without (the gateway's LRU estimate, bounded by the capacity the probes read). Per run: the share
of prompt tokens the engines report cached, TTFT p50/p99 at the client, and the share of
decisions whose predicted hit (``x-kvroute-prefix-hit``) differs from the cached tokens the engine
reports (the emulator, like vLLM, computes a prompt's last token: a whole-prompt prediction
counts as prompt − 1), split into over- and under-predictions. Fresh replicas per run.

**Consumer cost.** 64 publishers in another process (vLLM's wire format, map generation) send
pre-encoded batches as fast as they can; one consumer (this process, one event loop, as in the
gateway) applies them; ingest rate = stored + removed blocks over the time from the first to the
last batch applied. Meanwhile a 64-endpoint Router whose prefix index reads the consumer's live
tables decides every 2 ms; its decision time (route + on_finish, as ``bench routing``) during
ingest is compared with the same decisions before and after, in wall time and in the thread's CPU
time (which leaves out the moments another process had the core: on a machine with few cores the
publishers' process competes with the consumer's).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import random
import time
from typing import Any

from kvroute.stats import percentile_sorted

PRESETS = ("sglang_cache_aware", "skywalker", "lmetric")
BLOCK = 16  # tokens per block, emulator and gateway alike


# -- routing quality -------------------------------------------------------------------------------

def _conversations(seed: int, tenants: int, users: int, turns: int, system_tokens: int) -> list[list[str]]:
    """Per user, the user messages of its conversation; user u belongs to tenant u % tenants."""
    rng = random.Random(seed)
    words = ["route", "cache", "token", "prefix", "engine", "batch", "decode", "region", "model", "query"]
    return [[" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(turns)]
            for _ in range(users)]


def _system_prompt(tenant: int, tokens: int) -> str:
    base = f"Tenant {tenant} policy: answer precisely, cite the sources, keep it short. "
    text = base * (tokens * 4 // len(base) + 1)
    return text[: tokens * 4]  # 4 bytes per emulated token


async def _one_run(preset: str, events: bool, seed: int, replicas: int, kv_blocks: int, tenants: int, users: int,
                   turns: int, system_tokens: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    from kvroute.emulator.kv_events import KVEventsOptions
    from kvroute.emulator.server import start_emulator
    from kvroute.gateway.config import GatewayConfig
    from kvroute.gateway.server import Gateway
    from kvroute.live.embedded import event_source
    from kvroute.perf.loader import load_profile
    from kvroute.replicas import ReplicaConfig

    profile = load_profile("h100-llama3.2-3b").model_copy(update={"kv_blocks": kv_blocks, "block_size": BLOCK})
    opts = KVEventsOptions("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv", "map")
    emus = [await start_emulator("127.0.0.1", 0, profile, "vllm", kv_events=opts, block_tokens=BLOCK)
            for _ in range(replicas)]
    config = GatewayConfig(port=0, policy=preset, block_tokens=BLOCK, seed=seed, access_log=False,
                           replicas=[ReplicaConfig(url=f"http://127.0.0.1:{p}", id=f"r{i}", engine="vllm",
                                                   kv_events=event_source(emu) if events else None)
                                     for i, (_, emu, p) in enumerate(emus)])
    gw = Gateway(config)
    await gw.start()
    rt = gw.runtime
    try:
        if events:
            deadline = time.monotonic() + 20
            while not all(rt.kv_source(f"r{i}")["source"] == "events" for i in range(replicas)):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replicas' event streams did not come up in 20 s")
                await asyncio.sleep(0.05)
        convs = _conversations(seed, tenants, users, turns, system_tokens)
        order = list(range(users))
        random.Random(seed + 1).shuffle(order)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for u in order:
            queue.put_nowait(u)
        rows: list[tuple[float, int, int, int]] = []  # ttft, predicted, cached, prompt tokens
        url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"

        async def client(session: aiohttp.ClientSession) -> None:
            while not queue.empty():
                u = queue.get_nowait()
                history = [{"role": "system", "content": _system_prompt(u % tenants, system_tokens)}]
                for text in convs[u]:
                    history.append({"role": "user", "content": text})
                    t0 = time.perf_counter()
                    ttft = None
                    usage: dict[str, Any] = {}
                    answer = []
                    async with session.post(url, json={"model": "emulated", "messages": history, "stream": True,
                                                       "max_tokens": max_tokens}) as resp:
                        resp.raise_for_status()
                        predicted = int(resp.headers.get("x-kvroute-prefix-hit", "0"))
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            if ttft is None:
                                ttft = time.perf_counter() - t0
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                            for ch in chunk.get("choices", ()):
                                answer.append(ch.get("delta", {}).get("content") or "")
                    prompt = usage.get("prompt_tokens", 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    rows.append((ttft or 0.0, predicted, cached, prompt))
                    history.append({"role": "assistant", "content": "".join(answer)})

        t_start = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
        removed = sum(emu.events.evicted for _, emu, _ in emus if emu.events is not None)
    finally:
        await gw.stop()
        for runner, _, _ in emus:
            await runner.cleanup()
    ttfts = sorted(r[0] for r in rows)
    prompt_total = sum(r[3] for r in rows)
    over = sum(1 for _, p, c, n in rows if min(p, n - 1) > c)
    under = sum(1 for _, p, c, n in rows if min(p, n - 1) < c)
    return {"preset": preset, "index": "events" if events else "approximate", "requests": len(rows),
            "cached_share": round(sum(r[2] for r in rows) / prompt_total, 4) if prompt_total else 0.0,
            "ttft_p50_ms": round(percentile_sorted(ttfts, 0.5) * 1000, 1),
            "ttft_p99_ms": round(percentile_sorted(ttfts, 0.99) * 1000, 1),
            "wrong_share": round((over + under) / len(rows), 4) if rows else 0.0,
            "over_share": round(over / len(rows), 4) if rows else 0.0,
            "under_share": round(under / len(rows), 4) if rows else 0.0,
            "evicted_blocks": removed, "wall_s": round(wall, 2)}


def routing(presets: tuple[str, ...] = PRESETS, seed: int = 0, replicas: int = 4, kv_blocks: int = 192,
            tenants: int = 24, users: int = 48, turns: int = 4, system_tokens: int = 512, concurrency: int = 8,
            max_tokens: int = 16, progress: Any = None) -> dict[str, Any]:
    """Every preset with events and with the approximate index on one seeded workload."""
    working_set = tenants * system_tokens + users * turns * (40 * 6 // 4 + max_tokens)
    result: dict[str, Any] = {"replicas": replicas, "kv_tokens_per_replica": kv_blocks * BLOCK,
                              "working_set_tokens_estimate": working_set, "requests": users * turns, "runs": []}
    for preset in presets:
        for events in (True, False):
            run = asyncio.run(_one_run(preset, events, seed, replicas, kv_blocks, tenants, users, turns,
                                       system_tokens, concurrency, max_tokens))
            result["runs"].append(run)
            if progress:
                progress(f"{preset} / {run['index']}")
    return result


# -- consumer cost -------------------------------------------------------------------------------

def _publish(conn: Any, publishers: int, batches: int, chains_per_batch: int, chain_blocks: int) -> None:
    """Child process: ``publishers`` vLLM-compatible publishers; endpoints sent back, then on "go"
    every pre-encoded batch sent as fast as possible."""
    from kvroute.kvevents.publisher import EventPublisher

    async def main() -> None:
        pubs = [EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv", "map", buffer_steps=batches + 8)
                for _ in range(publishers)]
        for p in pubs:
            p.start()
        rng = random.Random(3)
        payloads: list[list[bytes]] = []
        for p in pubs:
            enc, out, live = p.encoder, [], []
            for _ in range(batches):
                events = []
                for _ in range(chains_per_batch):
                    hashes = [rng.getrandbits(64) for _ in range(chain_blocks)]
                    tokens = [rng.randrange(32000) for _ in range(chain_blocks * BLOCK)]
                    events.append(enc.stored(hashes, None, tokens, BLOCK))
                    live.append(hashes)
                if len(live) > 4 * chains_per_batch:  # evict the oldest: tables stay bounded
                    for _ in range(chains_per_batch):
                        events.append(enc.removed(live.pop(0)[::-1]))
                out.append(enc.batch(events, time.time()))
            payloads.append(out)
        conn.send([(p.bound_endpoint(), p.bound_endpoint(replay=True)) for p in pubs])
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # "go"
        for i in range(batches):
            for p, out in zip(pubs, payloads):
                p.send_payload(out[i])
            if i % 8 == 7:
                await asyncio.sleep(0)  # let replay requests through
        await loop.run_in_executor(None, conn.recv)  # "done"
        for p in pubs:
            await p.close()

    asyncio.run(main())


def ingest(publishers: int = 64, batches: int = 200, chains_per_batch: int = 4, chain_blocks: int = 8,
           decision_every_s: float = 0.002, seed: int = 0) -> dict[str, Any]:
    """Blocks per second one consumer applies from ``publishers`` publishing at once, and the
    decision time on the consumer's live tables before, during and after ingest."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_publish, args=(child, publishers, batches, chains_per_batch, chain_blocks),
                       daemon=True)
    proc.start()
    try:
        endpoints = parent.recv()
        return asyncio.run(_consume(parent, endpoints, batches, chains_per_batch, chain_blocks, decision_every_s,
                                    seed))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def _decide(router: Any, req: Any, wall: list[float], cpu: list[float]) -> None:
    """One route + on_finish (what ``bench routing`` times), in wall and in thread CPU microseconds:
    CPU time leaves out the moments the OS gave the core to another process."""
    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    router.route(req)
    router.on_finish(req.id)
    cpu.append((time.thread_time_ns() - c0) / 1000.0)
    wall.append((time.perf_counter_ns() - w0) / 1000.0)


def _p(values: list[float], q: float) -> float:
    return round(percentile_sorted(sorted(values), q), 1)


async def _consume(conn: Any, endpoints: list[tuple[str, str]], batches: int, chains_per_batch: int,
                   chain_blocks: int, every_s: float, seed: int) -> dict[str, Any]:
    from kvroute.bench.routing import make_endpoints
    from kvroute.kvevents import EventSource, KVEventConsumer
    from kvroute.model import Request
    from kvroute.policy import Router, build_policy

    n = len(endpoints)
    consumer = KVEventConsumer(BLOCK, speculative_ttl_s=0)
    for i, (pub, replay) in enumerate(endpoints):
        consumer.add(f"replica-{i}", EventSource(pub, replay, "kv"))
    await consumer.start()
    rng = random.Random(seed)
    eps = make_endpoints(rng)[:n]
    router = Router(build_policy("sglang_cache_aware", seed=seed), eps)
    for ep in eps:
        router.use_cache_table(ep.id, consumer.replicas[ep.id].table.blocks)
    deadline = time.monotonic() + 60
    while not all(consumer.status(f"replica-{i}")["source"] == "events" for i in range(n)):
        if time.monotonic() > deadline:
            raise RuntimeError("publishers not followed within 60 s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # every SUB connection is up

    def applied() -> int:
        return sum(r["stored"] + r["removed"] for i in range(n) for r in consumer.status(f"replica-{i}")["ranks"])

    removals = max(0, batches - 4) * chains_per_batch * chain_blocks
    expected = n * (batches * chains_per_batch * chain_blocks + removals)
    counter = [0]

    def request() -> Any:
        counter[0] += 1
        return Request(id=f"d{counter[0]}", block_hashes=tuple(rng.getrandbits(64) for _ in range(128)),
                       block_tokens=64, prompt_tokens=8192)

    samples: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ("before", "ingest", "after")}
    for _ in range(300):
        _decide(router, request(), *samples["before"])
        await asyncio.sleep(every_s)
    conn.send("go")
    t_first = t_last = None
    base = applied()
    while True:
        _decide(router, request(), *samples["ingest"])
        await asyncio.sleep(every_s)
        now_applied = applied() - base
        if t_first is None and now_applied > 0:
            t_first = time.perf_counter()
        if now_applied >= expected:
            t_last = time.perf_counter()
            break
        if time.monotonic() > deadline + 120:
            break
    total = applied() - base
    for _ in range(300):
        _decide(router, request(), *samples["after"])
        await asyncio.sleep(every_s)
    conn.send("done")
    status = [consumer.status(f"replica-{i}") for i in range(n)]
    await consumer.stop()
    span = (t_last or time.perf_counter()) - (t_first or time.perf_counter())
    counters: dict[str, int] = {}
    for st in status:
        for k, v in st["counters"].items():
            counters[k] = counters.get(k, 0) + v
    out: dict[str, Any] = {"publishers": n, "blocks_applied": total, "blocks_expected": expected,
                           "seconds": round(span, 3), "blocks_per_s": round(total / span) if span > 0 else None,
                           "decisions_during_ingest": len(samples["ingest"][0]),
                           "table_blocks": sum(st["blocks"] for st in status), "consumer_counters": counters}
    for phase, (wall, cpu) in samples.items():
        out[f"decision_us_{phase}"] = {"wall_p50": _p(wall, 0.5), "wall_p99": _p(wall, 0.99),
                                       "cpu_p50": _p(cpu, 0.5), "cpu_p99": _p(cpu, 0.99)}
    return out


# -- the CLI ---------------------------------------------------------------------------------------

def command(args: Any) -> int:
    """`kvroute bench kv-events`: both parts, printed as tables (``--json`` keeps every number)."""
    from rich.table import Table

    from kvroute.policy import PRESETS as KNOWN
    from kvroute.report import console, err, error, write_json

    presets = tuple(p for p in args.presets.split(",") if p)
    unknown = [p for p in presets if p not in KNOWN]
    if unknown:
        return error(f"--presets: unknown {', '.join(unknown)}; allowed: {', '.join(KNOWN)}")
    from kvroute.replicas import events_extra_installed

    try:
        events_extra_installed()
    except ValueError as exc:
        return error(str(exc).replace("replicas[].kv_events", "bench kv-events"))
    result: dict[str, Any] = {}
    if not args.skip_routing:
        r = result["routing"] = routing(presets, seed=args.seed, progress=lambda s: err.print(f"[dim]{s}[/dim]"))
        table = Table(title=f"{r['replicas']} emulated replicas × {r['kv_tokens_per_replica']} KV tokens, working set "
                      f"≈ {r['working_set_tokens_estimate']} tokens, {r['requests']} requests per run")
        for col in ("preset", "index", "cached share", "TTFT p50 ms", "TTFT p99 ms", "wrong predicted hit",
                    "over / under", "evicted blocks"):
            table.add_column(col, justify="left" if col in ("preset", "index") else "right")
        for run in r["runs"]:
            table.add_row(run["preset"], run["index"], f"{run['cached_share']:.1%}", f"{run['ttft_p50_ms']:.1f}",
                          f"{run['ttft_p99_ms']:.1f}", f"{run['wrong_share']:.1%}",
                          f"{run['over_share']:.1%} / {run['under_share']:.1%}", str(run["evicted_blocks"]))
        console.print(table)
    if not args.skip_ingest:
        i = result["ingest"] = ingest(publishers=args.publishers, seed=args.seed)
        table = Table(title=f"consumer cost: {i['publishers']} publishers at once, one consumer: "
                      f"{i['blocks_applied']} blocks in {i['seconds']:.3f} s = {i['blocks_per_s']} blocks/s")
        for col in ("decision time, µs", "wall p50", "wall p99", "CPU p50", "CPU p99"):
            table.add_column(col, justify="left" if col.startswith("decision") else "right")
        for phase in ("before", "ingest", "after"):
            d = i[f"decision_us_{phase}"]
            table.add_row({"before": "idle, before", "ingest": "during ingest", "after": "idle, after"}[phase],
                          str(d["wall_p50"]), str(d["wall_p99"]), str(d["cpu_p50"]), str(d["cpu_p99"]))
        console.print(table)
    write_json(args.json, result)
    return 0
