"""A long-context open-loop workload for CascadeInfer's setting (004_131677394a4b07f8.txt §6.1).

The paper builds its workloads from ShareGPT conversation histories with Poisson arrivals, keeps
requests up to 128K tokens (Fig. 1), and describes the lengths only qualitatively: highly skewed,
"many short requests coexist with a small but increasingly common set of extremely long ones".
It publishes no quantiles, so the distribution here is assumed:

* prompt tokens: log-normal, median 1,500, σ 1.6 (p90 ≈ 12K, p99 ≈ 62K), at least 16, and
  prompt + output capped at 128K (131,072) — a whole conversation history resent each turn,
  with the long tail the paper's Fig. 1 shows;
* output tokens: log-normal, median 256, σ 0.9 (ShareGPT-like answers), 1 to 4,096;
* no shared prefixes (each history is distinct), so prefix caching neither helps nor hurts.

``length_sample`` draws the same distribution from its own generator: what CascadeInfer's offline
planning reads as "historical workload statistics" without disturbing the arrivals.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

from kvroute.model import Request
from kvroute.workload.arrivals import ArrivalClock, Bursts
from kvroute.workload.base import SimRequest, Workload

MAX_CONTEXT = 131_072


class LongContext(Workload):
    """Poisson arrivals at ``rate`` of heavy-tailed long-context requests (assumed lengths above)."""

    name = "long-context"

    def __init__(self, rate: float, regions: list[str], seed: int = 0, max_requests: int | None = None,
                 prompt_median: float = 1500.0, prompt_sigma: float = 1.6, output_median: float = 256.0,
                 output_sigma: float = 0.9, max_context: int = MAX_CONTEXT, bursts: Bursts | None = None):
        self.rate, self.bursts = rate, bursts
        self.regions = list(regions) or ["local"]
        self.seed = seed
        self.max_requests = max_requests
        self.prompt = (prompt_median, prompt_sigma)
        self.output = (output_median, output_sigma)
        self.max_context = max_context

    def _lengths(self, rng: random.Random) -> tuple[int, int]:
        out = int(min(4096, max(1, round(self.output[0] * math.exp(self.output[1] * rng.gauss(0, 1))))))
        prompt = int(round(self.prompt[0] * math.exp(self.prompt[1] * rng.gauss(0, 1))))
        return max(16, min(prompt, self.max_context - out)), out

    def length_sample(self, n: int, seed: int = 7) -> list[tuple[int, int]]:
        """``n`` (prompt, output) pairs from the same distribution, independent of the arrivals."""
        rng = random.Random(seed * 1_000_003 + self.seed)
        return [self._lengths(rng) for _ in range(n)]

    def arrivals(self) -> Iterator[SimRequest]:
        """Requests in arrival order (Poisson at ``rate``), regions taken in turn."""
        rng = random.Random(self.seed)
        clock = ArrivalClock(rng, self.rate, self.bursts)
        n = 0
        while self.max_requests is None or n < self.max_requests:
            t = clock.next()
            prompt, out = self._lengths(rng)
            n += 1
            req = Request(id=f"lc{n}", region=self.regions[n % len(self.regions)], prompt_tokens=prompt,
                          max_output_tokens=out, arrival_s=t)
            yield SimRequest(req, out)
