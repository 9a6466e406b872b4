"""The adaptive presets in the live gateway: the tuner learns from TTFTs the gateway measures
(through the Router's hooks) and its state is exported in /metrics."""

from __future__ import annotations

import re
import urllib.request

import openai

from kvroute.policy import build_policy
from tests.gateway_harness import LiveDeployment


def _state(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in re.findall(r'kvroute_policy_state\{key="([^"]+)"\} (\S+)', text)}


def test_gateway_feeds_the_es_tuner_and_exports_its_state():
    dep = LiveDeployment(replicas=2, policy="round_robin")
    try:
        # a short window so that a dozen requests make steps; seeded like any policy
        dep.runtime.router.policy = build_policy("gorgo_tuned", {"window": 8, "hop": 2}, seed=1)
        c = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=20)
        for i in range(12):
            c.chat.completions.create(model="emulated", max_tokens=2,
                                      messages=[{"role": "user", "content": f"question {i}"}])
        assert dep.settle() == (0, 0, 0)
        st = {k.rsplit(".", 1)[-1]: v for k, v in _state(dep.url).items()}
        assert st["samples"] == 12.0  # one measured TTFT per request
        assert st["proposed"] >= 2 and 0 < st["window_p95_s"] < 20
        assert 0.05 <= st["w_queue"] <= 0.5 and 0.05 <= st["w_rtt"] <= 2.0
    finally:
        dep.close()
