"""Probing engines: parse Prometheus text, map each engine's metric names to indicators.

| engine    | running                      | waiting (pending)          | KV usage                               |
|-----------|------------------------------|----------------------------|----------------------------------------|
| vLLM      | vllm:num_requests_running    | vllm:num_requests_waiting  | vllm:kv_cache_usage_perc (or gpu_...)  |
| SGLang    | sglang:num_running_reqs      | sglang:num_queue_reqs      | sglang:token_usage                     |
| llama.cpp | llamacpp:requests_processing | llamacpp:requests_deferred | llamacpp:kv_cache_usage_ratio (if any) |

The engine type can be configured or detected from which names a scrape contains.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 ("llamacpp:kv_cache_usage_ratio",)),
}


class ProbeError(Exception):
    """A scrape answered, but without usable load metrics."""


def parse_prometheus(text: str) -> dict[str, float]:
    """First sample of every metric in a Prometheus text exposition (labels ignored)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        if name in out:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            rest = rest[close + 1:]
        fields = rest.split()
        if not fields:
            continue
        try:
            out[name] = float(fields[0])
        except ValueError:
            continue
    return out


def detect_engine(samples: dict[str, float]) -> str | None:
    for engine, (running, waiting, _) in ENGINE_METRICS.items():
        if running in samples or waiting in samples:
            return engine
    return None


@dataclass(slots=True)
class Reading:
    engine: str
    running: int
    waiting: int
    kv_usage: float | None


def read_indicators(samples: dict[str, float], engine: str = "auto") -> Reading:
    if engine == "auto":
        detected = detect_engine(samples)
        if detected is None:
            raise ProbeError("no vLLM, SGLang or llama.cpp load metrics in /metrics")
        engine = detected
    running_name, waiting_name, kv_names = ENGINE_METRICS[engine]
    if running_name not in samples and waiting_name not in samples:
        raise ProbeError(f"/metrics has neither {running_name} nor {waiting_name}")
    kv = next((samples[n] for n in kv_names if n in samples), None)
    return Reading(engine, int(samples.get(running_name, 0)), int(samples.get(waiting_name, 0)), kv)
