"""Adaptive routing mechanisms of the seed papers: one package per mechanism, each with its pure
core, the plugins that wrap it, a README (what it is, its parameters, an example) and a
table-driven test (``tests/test_adaptive_<name>.py``).

* :mod:`.es_tuner` — GORGO v2's (1+1)-ES that tunes cost weights on a window's p95 TTFT (``es``);
* :mod:`.ttft_fit` — GORGO v1's calibration: per-replica recursive least squares of TTFT
  (``calibration``);
* :mod:`.hotspot` — LMetric's two-phase KV-hotspot detector (§5.2) and its fallback (``hotspot``);
* :mod:`.predictor` — llm-d's predicted TTFT on the simulator's step-time model (``predictor``);
* :mod:`.selector` — ``auto``'s online choice between two rules by measured TTFT
  (``ttft_selector``);
* :mod:`.replica_speed` — each replica's prefill and decode time learned from measured TTFTs and
  TPOTs, scaling LMetric's score on mixed hardware (``lmetric_speed``).

None of them reads a clock or performs I/O: observations arrive as arguments (the Router's
lifecycle hooks), so the simulator and the gateway drive them identically. Importing a package
registers its plugins (:mod:`kvroute.policy.builtin` imports all but the selector, ``auto`` the
selector).
"""
