"""Adaptive routing mechanisms of the seed papers, as pure classes the presets wrap.

* :mod:`.es_tuner` — GORGO v2's (1+1)-ES that tunes cost weights on a window's p95 TTFT;
* :mod:`.ttft_fit` — GORGO v1's calibration: per-replica recursive least squares of TTFT;
* :mod:`.hotspot` — LMetric's two-phase KV-hotspot detector (§5.2) and its fallback;
* :mod:`.predictor` — llm-d's predicted-TTFT baseline on the simulator's step-time model.

None of them reads a clock or performs I/O: observations arrive as arguments (the Router's
lifecycle hooks), so the simulator and the gateway drive them identically.
"""
