"""`kvroute bench routing`: decision cost of every preset, index memory, big-prompt latency.

Set-up (the issue's): 64 endpoints with varied indicators, a prefix index holding ~1M blocks
(64-token blocks, conversation-like chains spread over the endpoints), prompts of 8K and 32K
tokens of which half extend a cached chain. One measured decision is ``route`` (filters,
admission, scoring, pick, commit into the index and counters) plus the matching ``on_finish``
— what the gateway pays per request. Each preset decides on its own freshly built copy of the
same index, endpoints and requests, so no preset measures the churn another one caused.
Tokenization is excluded: requests arrive hashed, as the gateway hashes once on parse.
``chat_220kb_ms`` times the whole front half for a 220 KB chat body: JSON parse, canonical key,
block hashing, routing.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
import tracemalloc

from kvroute.model import Endpoint, Request
from kvroute.policy import PRESETS, Router, build_policy
from kvroute.prefix import BlockHasher, PrefixIndex, chat_key
from kvroute.stats import percentile_sorted

N_ENDPOINTS = 64
INDEX_BLOCKS = 1_000_000
BLOCK_TOKENS = 64
CHAIN_BLOCKS = 128  # 8K-token conversations populate the index


def _chain(rng: random.Random, n: int, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    return prefix + tuple(rng.getrandbits(64) for _ in range(n - len(prefix)))


def populate(index: PrefixIndex, endpoint_ids: list[str], blocks: int, rng: random.Random) -> list[tuple[int, ...]]:
    """Fill ``index`` with about ``blocks`` blocks; returns the chains inserted."""
    chains: list[tuple[int, ...]] = []
    total = 0
    while total < blocks:
        c = _chain(rng, CHAIN_BLOCKS)
        index.insert(endpoint_ids[len(chains) % len(endpoint_ids)], c)
        chains.append(c)
        total += len(c)
    return chains


def make_endpoints(rng: random.Random) -> list[Endpoint]:
    """64 endpoints across three regions with random but plausible probed state."""
    eps = []
    for i in range(N_ENDPOINTS):
        eps.append(Endpoint(
            id=f"replica-{i}", region=("us", "eu", "asia")[i % 3], kv_blocks=0,
            running=rng.randint(0, 40), waiting=rng.choice([0, 0, 0, 1, 3]),
            kv_usage=rng.random(), rtt_s=rng.choice([0.002, 0.08, 0.15]),
            inflight=rng.randint(0, 40), inflight_tokens=rng.randint(0, 200_000),
            queued_prefill_tokens=rng.randint(0, 20_000)))
    return eps


def index_bytes_per_block(seed: int = 0) -> float:
    """Bytes of Python heap per indexed block, measured with tracemalloc."""
    rng = random.Random(seed)
    ids = [f"replica-{i}" for i in range(N_ENDPOINTS)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(capacity_blocks=INDEX_BLOCKS // N_ENDPOINTS * 2)
    for i in ids:
        index.add_endpoint(i)
    chains = populate(index, ids, INDEX_BLOCKS, rng)
    del chains  # the index alone must hold its keys
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(index)


def _requests(rng: random.Random, chains: list[tuple[int, ...]], tokens: int, n: int) -> list[Request]:
    blocks = tokens // BLOCK_TOKENS
    out = []
    for i in range(n):
        if i % 2 == 0:  # extends a cached conversation
            base = rng.choice(chains)
            prefix = base[: min(len(base), blocks * 3 // 4)]
        else:
            prefix = ()
        out.append(Request(id=f"q{tokens}-{i}", block_hashes=_chain(rng, blocks, prefix),
                           block_tokens=BLOCK_TOKENS, prompt_tokens=tokens,
                           routing_key=f"user-{rng.randrange(1000)}", max_output_tokens=256))
    return out


def time_decisions(router: Router, reqs: list[Request], samples: list[float]) -> None:
    """Time ``route`` + ``on_finish`` per request, appending microseconds to ``samples``."""
    clock = time.perf_counter_ns
    for req in reqs:
        t0 = clock()
        d = router.route(req)
        router.on_finish(req.id)
        samples.append((clock() - t0) / 1000.0)
        assert d.kind.value != "none", d.reason


def _p50_p99(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return percentile_sorted(samples, 0.5), percentile_sorted(samples, 0.99)


def chat_220kb_ms(router: Router, repeats: int = 21) -> float:
    """Median ms to key, hash and route a 220 KB chat body (the largest prompts the gateway sees)."""
    rng = random.Random(7)
    words = ["alpha", "kv", "cache", "route", "token", "prefix", "region", "batch", "decode"]
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40}]
    while len(json.dumps(messages)) < 220_000:
        text = " ".join(rng.choice(words) for _ in range(900))
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text})
    body = json.dumps({"model": "m", "messages": messages}).encode()
    hasher = BlockHasher(BLOCK_TOKENS)
    samples = []
    for i in range(repeats):
        t0 = time.perf_counter()
        payload = json.loads(body)
        hashes, tokens = hasher(chat_key(payload["messages"]))
        req = Request(id=f"big-{i}", block_hashes=hashes, block_tokens=BLOCK_TOKENS, prompt_tokens=tokens)
        router.route(req)
        router.on_finish(req.id)
        samples.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(samples)


def _fixture(seed: int, decisions: int):
    """Endpoints, a ~1M-block index and requests, identical for every call with one seed."""
    rng = random.Random(seed)
    endpoints = make_endpoints(rng)
    index = PrefixIndex(capacity_blocks=INDEX_BLOCKS // N_ENDPOINTS + 4096)  # default max_blocks, as a Router
    for e in endpoints:
        index.add_endpoint(e.id)
    chains = populate(index, [e.id for e in endpoints], INDEX_BLOCKS, rng)
    return endpoints, index, _requests(rng, chains, 8192, decisions), _requests(rng, chains, 32768, decisions)


def run(decisions: int = 2000, seed: int = 0, progress=None) -> dict:
    """Decision cost percentiles per preset at 8K and 32K tokens over a 1M-block index, plus memory per block."""
    result: dict = {"presets": {}, "endpoints": N_ENDPOINTS, "block_tokens": BLOCK_TOKENS,
                    "decisions_per_size": decisions}
    for name in PRESETS:
        # every preset starts from the same freshly built index: no preset measures another's churn
        endpoints, index, reqs8, reqs32 = _fixture(seed, decisions)
        result["index_blocks"] = len(index)
        router = Router(build_policy(name, seed=seed), endpoints)
        router.prefix = router.view.prefix = index
        gc.collect()
        gc.freeze()  # long-lived state leaves the GC's scans, as a serving process would do
        s8: list[float] = []
        s32: list[float] = []
        time_decisions(router, reqs8, s8)
        time_decisions(router, reqs32, s32)
        gc.unfreeze()
        p50_8, p99_8 = _p50_p99(s8)
        p50_32, p99_32 = _p50_p99(s32)
        result["presets"][name] = {"p50_us_8k": round(p50_8, 2), "p99_us_8k": round(p99_8, 2),
                                   "p50_us_32k": round(p50_32, 2), "p99_us_32k": round(p99_32, 2)}
        if progress:
            progress(name)
        del endpoints, index, reqs8, reqs32, router
    endpoints, index, _, _ = _fixture(seed, 1)
    heaviest = Router(build_policy("sglang_cache_aware", seed=seed), endpoints)
    heaviest.prefix = heaviest.view.prefix = index
    result["chat_220kb_ms"] = round(chat_220kb_ms(heaviest), 3)
    del endpoints, index, heaviest
    result["index_bytes_per_block"] = round(index_bytes_per_block(seed), 1)
    return result
