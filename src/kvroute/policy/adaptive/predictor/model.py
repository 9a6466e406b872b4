"""llm-d's predicted-TTFT routing: estimate each replica's TTFT for this request with a step-time
model, pick the minimum.

LMetric §4.6 (002_8c097f52e4fa5054.txt, Figure 14) describes the simulation-based baseline it
compared against (llm-d with a retrofitted, KV-cache-aware VIDUR): predict the TTFT of routing
the request to each instance from that instance's KV state and queue, route to the lowest.
Figures 15–16 show its weakness: a simulator tuned for another model/hardware predicts worse
and schedules worse.

kvroute predicts with its own simulator's step-time model (:class:`~kvroute.perf.profile.HardwareProfile`,
pure arithmetic) from what a router knows about a replica: the probed running batch, the
router's queued prefill tokens (dispatched, not yet past first token), the decode contexts
(prompt tokens in flight per request) and the request's uncached tokens. The engine model it
mirrors runs chunked prefill FCFS within a per-step token budget shared with decodes, so::

    steps = ⌈(queued + uncached) / (budget − decodes)⌉
    TTFT ≈ RTT + overhead + (steps − 1) · step(decode D, ctx D·c̄)
           + step(prefill queued + uncached, decode D, ctx D·c̄, attention uncached · (cached + uncached/2))

(c̄: mean prompt tokens per request in flight; step: the profile's ``step_time`` with H = 1).

Choices: the queue's own prefill attention is left out (the router does not know how the
queued tokens split into prompts); decodes are the probed running count capped at the
profile's max_running; a replica whose batch is full is not charged a wait for a free slot
(it cannot be predicted without output lengths) — the queued prefill still grows there.
"""

from __future__ import annotations

import math

from kvroute.model import Endpoint
from kvroute.perf.profile import HardwareProfile


class TTFTPredictor:
    """TTFT estimates on one resolved hardware profile; :meth:`predict` is pure arithmetic on the
    profile's :meth:`~kvroute.perf.profile.HardwareProfile.step_time`: the prefill of the queue
    and the request spreads over ``steps`` steps, each also decoding the running batch, so the
    estimate is ``steps − 1`` decode steps plus one step that carries the whole prefill."""

    def __init__(self, profile: HardwareProfile):
        self.profile = profile

    def predict(self, ep: Endpoint, uncached: int, cached: int) -> float:
        """Seconds from dispatch to first token if the request went to ``ep``."""
        p = self.profile
        decodes = min(ep.running, p.max_running)
        ctx = decodes * (ep.inflight_tokens / ep.inflight) if ep.inflight else 0.0
        work = ep.queued_prefill_tokens + max(1, uncached)  # a fully cached prompt still runs a step
        steps = math.ceil(work / max(1, p.max_batched_tokens - decodes))
        t = p.step_time(work, decodes, ctx, uncached * (cached + uncached / 2))
        if steps > 1:
            t += (steps - 1) * p.step_time(0, decodes, ctx)
        return ep.rtt_s + p.ttft_overhead_s + t

    def predict_many(self, eps: list[Endpoint], prompt_tokens: int, block_tokens: int,
                     matches: dict[str, int]) -> list[float]:
        """:meth:`predict` for every endpoint of ``eps``, ``matches`` giving each one's cached
        blocks. This runs per endpoint per decision, so :meth:`predict`'s two ``step_time``
        calls are written out here with the constants hoisted — the same terms added in the same
        order with H = 1, so the results are bit-identical (``tests/test_adaptive_predictor.py``
        checks); it halves ``llm_d``'s decision cost at 64 endpoints (``kvroute bench routing``)."""
        p = self.profile
        c0, cp, cd, cf = p.c0_s, p.c_prefill_s, p.c_decode_s, p.c_attn_fixed_s
        ca, cpa, budget, max_running = p.c_attn_s, p.c_prefill_attn_s, p.max_batched_tokens, p.max_running
        overhead, ceil, get = p.ttft_overhead_s, math.ceil, matches.get
        out = []
        for e in eps:
            m = get(e.id)
            cached = 0 if m is None else min(prompt_tokens, block_tokens * m)
            uncached = prompt_tokens - cached
            decodes = e.running if e.running < max_running else max_running
            ctx = decodes * (e.inflight_tokens / e.inflight) if e.inflight else 0.0
            work = e.queued_prefill_tokens + (uncached if uncached > 1 else 1)
            chunk = budget - decodes
            steps = ceil(work / (chunk if chunk > 1 else 1))
            attn = ca * ctx
            # step_time(work, decodes, ctx, uncached·(cached + uncached/2)), H = 1
            t = c0 + cp * work + cd * decodes + (attn + cpa * (uncached * (cached + uncached / 2)))
            if decodes:
                t += cf
            if steps > 1:  # + (steps − 1) · step_time(0, decodes, ctx)
                step = c0 + cd * decodes + attn
                if decodes:
                    step += cf
                t += (steps - 1) * step
            out.append(e.rtt_s + overhead + t)
        return out
