"""Hardware profiles and the step-time model.

One engine step runs P prefill tokens (chunked) and D decode sequences. Its time is

    T = c0 + c_prefill·P + c_decode·D + [D > 0]·c_attn_fixed
           + H·(c_attn·Σctx_decode + c_prefill_attn·Σ_chunks rows(p)·(ctx_before + p/2))

* c0: fixed per-step cost (weights read, launch, scheduling);
* c_attn_fixed: the decode attention kernels' fixed cost per step (launches, split-KV
  reduction, one pass per layer), paid whenever the step decodes at all;
* c_prefill, c_decode: the linear layers' cost per prefill token / per decode sequence;
* c_attn: decode attention per context token — each decode step reads every sequence's whole
  KV, so it is bandwidth-bound: KV bytes per token ÷ memory bandwidth;
* c_prefill_attn: prefill attention per (query, key) pair — compute-bound, quadratic in a
  chunk and linear in the context before it; rows(p) = p, or p rounded up to whole tiles of
  ``prefill_attn_tile`` query rows where the engine's kernel pads them (llama.cpp on CPU);
* H ≥ 1: batch heterogeneity. Attention over a batch of mixed lengths is slower than over a
  uniform batch with the same total tokens (CascadeInfer §2.2: 1.1–2.1×). We use
  H = min(h_max, 1 + h_cv · CV) where CV is the coefficient of variation of the lengths the
  step's attention runs over: every decode's context and, in a mixed step, every prefill chunk's
  end (ctx_before + p; chunked prefill and decodes share one varlen attention pass, so a long
  chunk beside short decodes is the same imbalance). The paper measured the decode pass; that the
  factor carries to mixed steps is kvroute's assumption. With the defaults (h_cv 0.8, h_max 2.1)
  CV 0.125 → 1.1× and CV ≥ 1.375 → 2.1×.

``ttft_overhead_s`` is a per-request latency outside the engine's step loop (HTTP, tokenizing,
scheduling); it adds to the first token's time without occupying the engine.

Profiles live in ``kvroute/profiles/*.yaml`` (package data) with every number annotated with its source;
:mod:`kvroute.perf.loader` reads them (this module does no I/O, so the policy layer can use it).

:meth:`HardwareProfile.step_time` is the one place the formula is written: the simulated engine
(``sim/engine.py``, per step and per decode jump), the llm_d predictor, calibration's fit, the
overload pre-flight and the QoE profiling all call it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvroute.schema import StrictModel


class NewcomerPoint(StrictModel):
    """How much slower than processor sharing a step runs whose engine starts stepping while
    ``others`` engines of its machine already step (sim/host.py ``newcomer_factor``), for a step of
    ``solo_s`` seconds alone; measured by `kvroute calibrate` (calibrate/newcomer_probe.py)."""

    model_config = ConfigDict(frozen=True)

    others: int = Field(ge=1)
    solo_s: float = Field(gt=0)
    factor: float = Field(ge=1)


class HardwareProfile(StrictModel):
    """One engine on one machine as the simulator models it: step-time constants (fixed, per prefill token,
    per decode, attention), KV capacity, batch limits, how prefixes are reused, and the published points it
    must reproduce."""

    model_config = ConfigDict(frozen=True)

    name: str
    hardware: str
    model: str
    c0_s: float = Field(ge=0)
    c_prefill_s: float = Field(ge=0)
    c_decode_s: float = Field(ge=0)
    c_attn_s: float = Field(ge=0)
    c_attn_fixed_s: float = Field(0.0, ge=0)
    c_prefill_attn_s: float = Field(0.0, ge=0)
    h_cv: float = Field(0.8, ge=0)
    h_max: float = Field(2.1, ge=1)
    ttft_overhead_s: float = Field(0.0, ge=0)
    # The per-request overhead (HTTP, tokenizing, the hop to the engine's scheduler, streaming the
    # first token back) while the engine is stepping, where it differs from an idle engine's
    # ttft_overhead_s: the API server and the engine's busy threads share the cores. Measured by
    # `kvroute calibrate` (a tiny prompt beside a decoding batch); None: ttft_overhead_s always.
    ttft_overhead_busy_s: float | None = Field(None, ge=0)
    # Extra time of a step in which a new sequence starts its prefill, which every sequence of the
    # batch waits for. Measured by `kvroute calibrate` (the decoding batch's longest token gap while
    # a tiny prompt joined it): llama-server 0.3.36 stalled three decoding slots for 13-24 ms where
    # the step model gave ~3 ms (issue 21); 0: none.
    c_admit_s: float = Field(0.0, ge=0)
    # Extra seconds per prefill token of a step that also decodes, beyond the step model (issue 21k):
    # measured by `kvroute calibrate` from a warm prefill (the sweep's shortest warm length after its
    # longest warm context) joining a decoding batch, its step against the model's time for that step
    # (calibrate/mixed_decode_probe.py); 0: a mixed step costs what its parts cost.
    c_prefill_mixed_s: float = Field(0.0, ge=0)
    # llama-server's host prompt cache (--cache-ram, 8 GiB by default; tools/server/
    # server-context.cpp): launching a request copies, on the loop every slot waits for, each idle
    # slot whose content is not yet cached into host memory (--cache-idle-slots, on by default) and,
    # when the request takes a slot by LRU, the best cached prompt back into it (prompt_save /
    # prompt_load, llama_state_seq_{get,set}_data). A copy costs slot_save_s_per_token per token of
    # the copied state, measured by `kvroute calibrate` (a tiny prompt after a slot of N fresh
    # tokens went idle, against one after a tiny slot did; sim/slot_cache.py). 0: no copies.
    slot_save_s_per_token: float = Field(0.0, ge=0)
    # Engines sharing a machine's cores (scenario host_cores): an engine that starts stepping while
    # others step runs its first step this much slower than processor sharing gives it (Linux
    # queues it on a busy core until its load balancing moves a thread; sim/host.py), per number of
    # others stepping and step length alone, interpolated. Measured by `kvroute calibrate --host-cores`
    # (calibrate/newcomer_probe.py: a warm and a cold prefill started beside busy engines); empty: none.
    newcomer_slowdown: list[NewcomerPoint] = Field(default_factory=list)
    # Query rows per prefill attention tile. llama.cpp's CPU flash attention (ggml-cpu/ops.cpp,
    # ggml_compute_forward_flash_attn_ext_tiled; GGML_FA_TILE_Q = 64 in ggml-cpu/common.h, the
    # source llama-cpp-python 0.3.36 vendors) runs a chunk of >= 64 query tokens of one sequence in
    # tiles of 64 rows, a part-filled tile padded to 64 and costing a full one; a shorter chunk goes
    # row by row. So a warm 100-token prefill costs 128 rows' attention. Set by `kvroute calibrate`
    # for llama-server (an engine fact, not a fitted number); 1: rows as they are (vLLM, GPUs).
    prefill_attn_tile: int = Field(1, gt=0)
    kv_bytes_per_token: int | None = Field(None, gt=0)  # KV cache bytes per token (migration transfers)
    kv_blocks: int = Field(gt=0)
    block_size: int = Field(16, gt=0)
    max_running: int = Field(256, gt=0)
    max_batched_tokens: int = Field(8192, gt=0)
    # How a cached prefix is reused. "shared": by any number of sequences at once (vLLM's and
    # SGLang's paged caches). "idle_slots": llama-server's -np slots each keep their last
    # sequence's KV, and a new request reuses a prefix only from a slot that serves no request
    # or from the host prompt cache, one request per copy; a slot taken over saves its old
    # content to the host cache (one more copy). Measured on llama-server 0.3.36: a request
    # sharing a 1,300-token prefix with one still decoding got 0 cached tokens, after it
    # finished 1,308; of three concurrent requests for a prefix held by one idle slot, two were
    # served from cache; held only in the host cache, one. Set by `kvroute calibrate`. Taking
    # the longest idle copy is llama-server's slot choice (--slot-prompt-similarity, 0.10 in
    # 0.3.36: the idle slot with the longest common prefix when it covers > 10 % of the prompt).
    prefix_reuse: Literal["shared", "idle_slots"] = "shared"
    # With "idle_slots", which copy a new request may reuse. "llama_server": only what the one
    # slot llama-server gives it holds after its host-cache load (sim/slot_cache.py: the idle slot
    # sharing > 10 % of the prompt, else the least recently used one, then prompt_load's pick;
    # server-context.cpp get_available_slot, server-task.cpp server_prompt_cache::load, the
    # llama.cpp that llama-cpp-python 0.3.36 vendors). "any_copy": the longest prefix any idle
    # slot or host copy holds (the model before issue 21h; it gave round_robin more cache hits
    # than llama-server's logs show).
    slot_choice: Literal["llama_server", "any_copy"] = "llama_server"
    # How the waiting queue is admitted. "vllm": whenever the uncached prompt fits, preempting
    # later when decoding runs out of memory (vLLM v1). "sglang": only if the prompt plus a
    # decaying share of every running request's future output fits (SGLang's new_token_ratio;
    # sim/sglang_admission.py), so requests wait before the replica overcommits.
    admission: Literal["vllm", "sglang"] = "vllm"
    # What a probe reads as the engine's waiting count. "live": the queue at the probe instant.
    # "sglang": SGLang's num_queue_reqs gauge, set only when a prefill batch is formed and every
    # 40th decode step (sim/queue_gauge.py). Off by default: with it, SkyWalker trails round robin
    # on issue 7's Mooncake check (the gate pushes into steps it cannot yet see); see issue-21d.
    # "llama_server": requests_deferred, the requests that found no free slot when the engine's loop
    # took them up between steps (sim/deferred_gauge.py; `kvroute calibrate` sets it for llama-server).
    # "vllm": num_requests_waiting/_running as the last finished step's schedule left them; an arrival
    # during a step is not counted (sim/step_gauge.py; `kvroute calibrate` sets it for vLLM).
    waiting_gauge: Literal["live", "sglang", "llama_server", "vllm"] = "live"
    # How noisy the engine is, measured by `kvroute calibrate` (calibrate/noise.py): the log-normal
    # sigma of a step's time and the mean extra per-request delay before the engine's queue. The
    # simulator uses them only where a scenario switches noise on (``engine_noise: profile``,
    # sim/noise.py); 0 = not measured.
    noise_step_sigma: float = Field(0.0, ge=0)
    noise_api_delay_s: float = Field(0.0, ge=0)
    # published points this profile must reproduce within 5% (checked by the tests), each one of
    # {prefill, expect_s} | {prefill, ttft_s} | {decode, ctx, expect_s} | {decode, ctx, attn_share}
    # | {heterogeneity_cv, expect_h}, with its source. ``independent: true`` marks an anchor
    # that no constant was fitted to (a check, not a calibration).
    points: list[dict[str, Any]] = Field(default_factory=list)
    # when no independent published anchor exists, why (the tests require one or the other)
    no_independent_anchor: str | None = None

    @property
    def kv_tokens(self) -> int:
        """KV-cache capacity in tokens (blocks × block size)."""
        return self.kv_blocks * self.block_size

    def heterogeneity(self, n: int, len_sum: float, len_sq_sum: float) -> float:
        """Attention slowdown H of a step whose attention runs over ``n`` lengths (decode contexts
        and prefill chunk ends) with sum ``len_sum`` and sum of squares ``len_sq_sum``:
        1 + h_cv × their coefficient of variation, at most h_max (1 below two lengths)."""
        if n < 2 or len_sum <= 0 or not self.h_cv:
            return 1.0
        mean = len_sum / n
        var = len_sq_sum / n - mean * mean
        if var <= 0:
            return 1.0
        h = 1.0 + self.h_cv * math.sqrt(var) / mean
        return self.h_max if h > self.h_max else h

    def step_time(self, prefill_tokens: int = 0, decode: int = 0, decode_ctx: float = 0.0,
                  prefill_attn: float = 0.0, h: float = 1.0) -> float:
        """Seconds for one step of ``prefill_tokens`` chunked-prefill tokens and ``decode``
        sequences whose contexts sum to ``decode_ctx``; ``prefill_attn`` = Σ chunk·(ctx_before +
        chunk/2); ``h``: :meth:`heterogeneity`. The terms are added in one fixed order so that
        every caller gets bit-identical times for the same step."""
        t = (self.c0_s + self.c_prefill_s * prefill_tokens + self.c_decode_s * decode
             + h * (self.c_attn_s * decode_ctx + self.c_prefill_attn_s * prefill_attn))
        if decode:
            t += self.c_attn_fixed_s
        return t

    def decode_growth(self, decode: int, h: float = 1.0) -> float:
        """How much longer each further decode-only step of ``decode`` sequences takes than the
        one before: every context grows by a token per step (the slope of :meth:`step_time` in
        ``decode_ctx`` times ``decode``)."""
        return h * self.c_attn_s * decode

    def attn_rows(self, chunk: int) -> int:
        """Query rows a prefill chunk of ``chunk`` tokens costs in attention: rounded up to whole
        tiles of ``prefill_attn_tile`` once the chunk fills one (see the field)."""
        tile = self.prefill_attn_tile
        if tile == 1 or chunk < tile:
            return chunk
        return -(-chunk // tile) * tile

    def prefill_time(self, tokens: int) -> float:
        """One prompt prefilled alone in a single step (no decodes in the batch)."""
        return self.step_time(tokens, prefill_attn=self.attn_rows(tokens) * tokens / 2)

    def attention_share(self, decode: int, ctx_each: int) -> float:
        """Share of one decode step spent in attention, for ``decode`` sequences of ``ctx_each`` tokens each."""
        attn = self.c_attn_fixed_s + self.c_attn_s * decode * ctx_each
        return attn / self.step_time(decode=decode, decode_ctx=decode * ctx_each)
