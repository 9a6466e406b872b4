"""A closed-loop chat load generator over real HTTP, for the demo (and anyone's smoke test).

``clients`` concurrent conversations; each sends a streaming chat request, reads it to the end,
appends the answer and a new question, and goes on, until ``max_requests`` or ``duration_s``.
Conversations share a few system prompts so prefix-aware routing has something to find.
Measures TTFT and end-to-end latency at the client, and reads the replica header and the
engine's cached-token count from each response.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from kvroute.stats import percentile

WORDS = ("replica", "cache", "prefix", "token", "batch", "latency", "region", "queue", "decode",
         "prefill", "router", "shard", "tensor", "kernel", "stream", "budget", "probe", "engine")


@dataclass
class LoadResult:
    """Client-side measurements of one load run: per-request TTFT and end-to-end latency, token counts,
    requests per replica, errors by kind."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replicas: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def summary(self) -> dict:
        """Requests, errors, p50/p99 TTFT and E2E (nearest rank, seconds), throughput, cached share and
        requests per replica."""
        pct = percentile
        n = len(self.e2e)
        return {"requests": n, "errors": sum(self.errors.values()),
                "ttft_p50_s": pct(self.ttft, 0.5), "ttft_p99_s": pct(self.ttft, 0.99),
                "e2e_p50_s": pct(self.e2e, 0.5), "e2e_p99_s": pct(self.e2e, 0.99),
                "throughput_rps": n / self.wall_s if self.wall_s else 0.0,
                "cached_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "replicas": dict(sorted(self.replicas.items()))}


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def run_chat_load(base_url: str, clients: int = 16, max_requests: int = 400, duration_s: float = 15.0,
                        seed: int = 0, max_tokens: int = 24, on_done: Callable[[int], None] | None = None
                        ) -> LoadResult:
    """Drive ``clients`` concurrent chat conversations against ``base_url`` until ``max_requests`` or
    ``duration_s``; ``on_done`` gets the number of requests finished so far after each one."""
    rng = random.Random(seed)
    systems = [f"You are assistant #{i}. " + _text(rng, 400) for i in range(4)]
    result = LoadResult()
    issued = 0
    start = time.perf_counter()
    deadline = start + duration_s
    url = f"{base_url}/v1/chat/completions"

    async def conversation(slot: int, session: aiohttp.ClientSession) -> None:
        nonlocal issued
        crng = random.Random(seed * 1000 + slot)
        while True:
            messages = [{"role": "system", "content": crng.choice(systems)}]
            user = f"user-{slot}-{crng.randrange(1 << 30)}"
            for _turn in range(crng.randint(2, 6)):
                if issued >= max_requests or time.perf_counter() >= deadline:
                    return
                issued += 1
                messages.append({"role": "user", "content": _text(crng, crng.randint(20, 120))})
                body = {"model": "emulated", "messages": messages, "max_tokens": max_tokens, "stream": True,
                        "stream_options": {"include_usage": True}, "user": user}
                t0 = time.perf_counter()
                first = None
                answer, usage = [], None
                try:
                    async with session.post(url, json=body) as resp:
                        if resp.status != 200:
                            result.errors[str(resp.status)] = result.errors.get(str(resp.status), 0) + 1
                            await resp.read()
                            continue
                        replica = resp.headers.get("x-kvroute-replica", "?")
                        async for line in resp.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            if first is None:
                                first = time.perf_counter()
                            event = json.loads(line[6:])
                            if "error" in event:
                                raise aiohttp.ClientPayloadError(event["error"]["message"])
                            for ch in event.get("choices", []):
                                answer.append(ch.get("delta", {}).get("content") or "")
                            usage = event.get("usage") or usage
                except (TimeoutError, aiohttp.ClientError) as exc:
                    key = exc.__class__.__name__
                    result.errors[key] = result.errors.get(key, 0) + 1
                    continue
                done = time.perf_counter()
                result.ttft.append((first or done) - t0)
                result.e2e.append(done - t0)
                result.replicas[replica] = result.replicas.get(replica, 0) + 1
                if usage:
                    result.prompt_tokens += usage.get("prompt_tokens", 0)
                    result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                messages.append({"role": "assistant", "content": "".join(answer)})
                if on_done:
                    on_done(len(result.e2e))

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(conversation(i, session) for i in range(clients)))
    result.wall_s = time.perf_counter() - start
    return result
