"""llm-d's predicted-TTFT routing: estimate each replica's TTFT for this request with a step-time
model, pick the minimum.

LMetric §4.6 (002_8c097f52e4fa5054.txt, Figure 14) describes the simulation-based baseline it
compared against (llm-d with a retrofitted, KV-cache-aware VIDUR): predict the TTFT of routing
the request to each instance from that instance's KV state and queue, route to the lowest.
Figures 15–16 show its weakness: a simulator tuned for another model/hardware predicts worse
and schedules worse.

kvroute predicts with its own simulator's step-time model (:class:`~kvroute.sim.profile.HardwareProfile`,
pure arithmetic) from what a router knows about a replica: the probed running batch, the
router's queued prefill tokens (dispatched, not yet past first token), the decode contexts
(prompt tokens in flight per request) and the request's uncached tokens. The engine model it
mirrors runs chunked prefill FCFS within a per-step token budget shared with decodes, so::

    steps = ⌈(queued + uncached) / (budget − decodes)⌉
    TTFT ≈ RTT + overhead + steps · (c0 + c_decode·D + c_attn_fixed + c_attn·D·ctx)
           + c_prefill · (queued + uncached) + c_prefill_attn · uncached · (cached + uncached/2)

Choices: the queue's own prefill attention is left out (the router does not know how the
queued tokens split into prompts); decodes are the probed running count capped at the
profile's max_running; a replica whose batch is full is not charged a wait for a free slot
(it cannot be predicted without output lengths) — the queued prefill still grows there.
"""

from __future__ import annotations

import math

from kvroute.model import Endpoint
from kvroute.sim.profile import HardwareProfile


class TTFTPredictor:
    """TTFT estimates on one hardware profile; :meth:`predict` is pure arithmetic."""

    def __init__(self, profile: HardwareProfile):
        self.profile = profile
        p = profile
        self._budget = p.max_batched_tokens
        self._c0, self._cd, self._cf = p.c0_s, p.c_decode_s, p.c_attn_fixed_s
        self._ca, self._cp, self._cpa = p.c_attn_s, p.c_prefill_s, p.c_prefill_attn_s

    def predict(self, ep: Endpoint, uncached: int, cached: int) -> float:
        """Seconds from dispatch to first token if the request went to ``ep``."""
        decodes = min(ep.running, self.profile.max_running)
        ctx = ep.inflight_tokens / ep.inflight if ep.inflight else 0.0
        work = ep.queued_prefill_tokens + max(1, uncached)  # a fully cached prompt still runs a step
        chunk = max(1, self._budget - decodes)
        steps = math.ceil(work / chunk)
        per_step = self._c0 + self._cd * decodes + (self._cf if decodes else 0.0) + self._ca * decodes * ctx
        own_attn = uncached * (cached + uncached / 2)
        return (ep.rtt_s + self.profile.ttft_overhead_s + steps * per_step + self._cp * work
                + self._cpa * own_attn)

    def predict_many(self, eps: list[Endpoint], prompt_tokens: int, block_tokens: int,
                     matches: dict[str, int]) -> list[float]:
        """:meth:`predict` for every endpoint of ``eps``, ``matches`` giving each one's cached
        blocks. The same arithmetic with the constants hoisted out of the loop: this runs per
        endpoint per decision (a test checks that both agree)."""
        budget, max_running = self._budget, self.profile.max_running
        c0, cd, cf, ca, cp, cpa = self._c0, self._cd, self._cf, self._ca, self._cp, self._cpa
        overhead, ceil, get = self.profile.ttft_overhead_s, math.ceil, matches.get
        out = []
        for e in eps:
            m = get(e.id)
            cached = 0 if m is None else min(prompt_tokens, block_tokens * m)
            uncached = prompt_tokens - cached
            decodes = e.running if e.running < max_running else max_running
            work = e.queued_prefill_tokens + (uncached if uncached > 1 else 1)
            chunk = budget - decodes if budget - decodes > 1 else 1
            if decodes:
                ctx = e.inflight_tokens / e.inflight if e.inflight else 0.0
                per_step = c0 + cd * decodes + cf + ca * decodes * ctx
            else:  # predict() adds only zeros to c0 here
                per_step = c0
            out.append(e.rtt_s + overhead + ceil(work / chunk) * per_step + cp * work
                       + cpa * (uncached * (cached + uncached / 2)))
        return out
