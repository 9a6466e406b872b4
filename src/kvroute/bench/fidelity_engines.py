"""What the engines themselves measured during a live fidelity run, beside what the client saw
(issue 21): where a live request's time goes, for finding what the simulator lacks.

vLLM keeps histograms of every request's stages (``vllm:request_queue_time_seconds``: waiting
in the engine core's queue; ``..._prefill_time_seconds``: from first scheduled to first token;
``..._decode_time_seconds``: first to last token; ``vllm:time_to_first_token_seconds``: the API
server's arrival to first token, so it includes tokenizing and the hop to the engine core) and of
its steps (``vllm:iteration_tokens_total``: one sample per engine step, its tokens). The
differences of their sums and counts over a run give the run's means. llama-server exports no
such histograms: its engines give nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from kvroute.gateway.probes import parse_prometheus

STAGES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds",
          "e2e": "vllm:e2e_request_latency_seconds"}
STEPS = "vllm:iteration_tokens_total"
WANTED = tuple(f"{base}_{part}" for base in (*STAGES.values(), STEPS) for part in ("sum", "count"))


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        async with session.get(f"{url.rstrip('/')}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status == 200:
                return {k: sum(v) for k, v in parse_prometheus(await r.text(), WANTED).items()}
    return {}


async def scrape(urls: list[str]) -> dict[str, float]:
    """The stage histograms' sums and counts, added over the engines ({} where none has them)."""
    async with aiohttp.ClientSession() as session:
        got = await asyncio.gather(*(_scrape(session, u) for u in urls))
    total: dict[str, float] = {}
    for one in got:
        for k, v in one.items():
            total[k] = total.get(k, 0.0) + v
    return total


def engine_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Means over the run between two scrapes: per request each stage's seconds (``queue_s``,
    ``prefill_s``, ``decode_s``, ``ttft_s``, ``e2e_s``), and the engine steps with their mean
    tokens (``steps``, ``tokens_per_step``); {} when the engines export no stage histograms."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    out: dict[str, float] = {}
    for stage, base in STAGES.items():
        n = delta(f"{base}_count")
        if n > 0:
            out[f"{stage}_s"] = delta(f"{base}_sum") / n
            out["requests"] = n
    steps = delta(f"{STEPS}_count")
    if steps > 0:
        out["steps"] = steps
        out["tokens_per_step"] = delta(f"{STEPS}_sum") / steps
    return out


def describe(side: dict[str, float], client_ttft_s: float, client_e2e_s: float) -> str:
    """One line: the engine's stage means beside the client's TTFT and E2E means."""
    ms = {k: v * 1000 for k, v in side.items() if k.endswith("_s")}
    return (f"client TTFT {client_ttft_s * 1000:.0f} ms / E2E {client_e2e_s * 1000:.0f} ms; engine (vLLM /metrics): "
            f"API-server TTFT {ms.get('ttft_s', 0):.0f} ms = queue {ms.get('queue_s', 0):.0f} + prefill "
            f"{ms.get('prefill_s', 0):.0f} + rest; decode {ms.get('decode_s', 0):.0f} ms; "
            f"{side.get('steps', 0):.0f} steps of {side.get('tokens_per_step', 0):.1f} tokens")
