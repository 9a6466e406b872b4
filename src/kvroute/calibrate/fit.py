"""Fit the simulator's step-time model (:mod:`kvroute.perf.profile`) to measured points, and write
the profile with the fit's error at every point.

Decode steps fit ``T = c0 + c_decode·B + c_attn·B·ctx`` (a uniform batch: heterogeneity 1), so
``c0`` is the step's fixed cost. A prefill of ``L`` tokens alone is one step plus what lies
outside the step loop: ``TTFT = ttft_overhead + c0 + c_prefill·L + c_prefill_attn·L²/2``; with
``c0`` from the decode fit, the prefill fit gives the overhead (HTTP, tokenizing, scheduling) and
the two prefill costs. ``c_attn_fixed`` is folded into ``c0``: both are paid once per decoding
step, and a sweep of decode steps cannot tell them apart.

Cold prefills alone pin ``c_prefill`` and ``c_prefill_attn`` poorly: over 128-2,048 tokens the
linear and the quadratic term trade off against each other, and the fit may split them in a way
that is right for cold prompts and wrong for what a multi-turn workload mostly runs, a short new
part over a long cached prefix. So the sweep also measures warm prefills (``n`` new tokens after
``ctx`` cached ones: ``TTFT = ttft_overhead + c0 + c_prefill·n + c_prefill_attn·n·(ctx + n/2)``),
and one least-squares fit takes cold and warm points together. Measured on three llama-servers
(2 cores, shared): ~100 new tokens after ~1,500 cached took 55-90 ms alone where a cold-only fit
predicted ~30-45 ms, and four such prefills batched together 200-355 ms (issue 21).

On llama-server the attention regressor counts query rows as its CPU kernel runs them: a chunk of
64 or more tokens in whole 64-row tiles (``prefill_attn_tile``, perf/profile.py), so 100 new
tokens cost 128 rows. Refitting the median points of issue 21's quiet calibration (20:11) so,
the RMS error over its 7 prefills of 64+ tokens went from 9.8 % to 7.7 %, while the one of 62
tokens (the row-by-row kernel, which the model lacks) went from -25 % to -35 %: hence the
sweep's warm lengths 96 and 256.

Each swept point is the median of its repeats on every engine; both fits are least squares on
relative error over those medians (every point counts the same whatever its size),
with coefficients kept ≥ 0 (a term whose best value is negative is dropped and the rest refitted:
the model's terms are physical costs, and a negative one would only fit noise).

Engines that share one machine's cores slow each other down while they step at once
(:class:`kvroute.sim.engine.Host`), and every point is measured on all engines at once. Given
``host_cores`` (the engines all run on one machine with that many cores), every measured time is
divided by ``max(1, engines / (host_cores - background))`` before the fit, where ``background``
is the other CPU the machine used over the sweep (calibrate/host_cpu.py: its busy CPU less the
engines' compute threads), so the profile describes an engine with the machine to itself and the
simulator adds the sharing back (scenario ``host_cores``, ``host_background_cores``) only while
engines actually step together. Without it the sharing stays folded into the constants: right
while every engine is busy, too slow while some are idle. The background term (issue 21f): two
vLLM CPU engines on 2 cores run an API server and a spinning engine-core process each beside the
worker; over a quiet calibration the workers' main threads ran 0.55-0.60 cores' worth and
waited for a core 0.38-0.43 (``/proc/.../schedstat``): 1.70x slower while both were runnable,
which engines / cores (1x) left in the constants while bench fidelity's host added the live
background on top — the simulated E2E p50 came out 1.35-1.48x the live one for three of four
policies. Three llama-servers in the same job: 1.57x measured where engines / cores assumed 1.5x.
"""

from __future__ import annotations

import datetime
import statistics
from collections import defaultdict
from pathlib import Path

import yaml

from kvroute.calibrate.measure import Measurements, Sweep
from kvroute.calibrate.mixed_decode_probe import fit_mixed_prefill
from kvroute.calibrate.mixed_probe import fit_h_cv
from kvroute.calibrate.newcomer_probe import factors as newcomer_factors
from kvroute.calibrate.noise import api_delay, step_sigma
from kvroute.calibrate.repeat_check import shifts
from kvroute.calibrate.slot_probe import per_token as slot_per_token
from kvroute.perf.profile import HardwareProfile, NewcomerPoint


def nonneg_lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares on relative error with non-negative coefficients (small active set)."""
    import numpy as np

    a = np.array(rows, dtype=float) / np.array(y, dtype=float)[:, None]
    b = np.ones(len(y))
    active = list(range(a.shape[1]))
    while active:
        x, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (x >= 0).all():
            out = [0.0] * a.shape[1]
            for i, v in zip(active, x, strict=True):
                out[i] = float(v)
            return out
        active.pop(int(np.argmin(x)))
    return [0.0] * a.shape[1]


def _medians(points: dict[tuple, list[tuple[float, ...]]]) -> list[tuple[tuple, tuple[float, ...]]]:
    return [(k, tuple(statistics.median(col) for col in zip(*v, strict=True))) for k, v in sorted(points.items())]


def fit_profile(m: Measurements, name: str, hardware: str, max_batched_tokens: int | None = None,
                block_size: int = 16, kv_tokens: int | None = None, max_running: int | None = None,
                sweep: Sweep | None = None, host_cores: int | None = None) -> tuple[HardwareProfile, dict]:
    """The fitted profile and a report (per-point errors, RMS error, what was measured);
    ``host_cores``: see the module docstring."""
    if len(m.decode) < 3 or len(m.prefill) < 3:
        raise ValueError(f"too few points to fit ({len(m.prefill)} prefill, {len(m.decode)} decode; "
                         "need 3 of each): widen the sweep")
    # the other CPU on the machine during the sweep (m.background_cores) shares the cores too, as
    # the simulator's host has it (sim/host.py); kept below the cores as bench fidelity keeps a live run's
    background = min(m.background_cores or 0.0, 0.9 * host_cores) if host_cores else 0.0
    sharing = max(1.0, len(m.engines) / (host_cores - background)) if host_cores else 1.0
    # llama-server's CPU attention pads a prefill's query rows to whole 64-row tiles (perf/profile.py
    # prefill_attn_tile: ggml's source, an engine fact); the fit's attention regressor counts them so
    facts = m.engines
    tile = 64 if any(f.slots for f in facts) else 1

    def rows(t: float) -> float:
        return t if tile == 1 or t < tile else -(-int(t) // tile) * tile

    by_len: dict[tuple, list[tuple[float, ...]]] = defaultdict(list)
    for n, tokens, s in m.prefill:
        by_len[(n,)].append((tokens, rows(tokens) * tokens / 2, s / sharing))
    prefill = [v for _, v in _medians(by_len)]  # (tokens, attention pairs, seconds) per swept length
    by_warm: dict[tuple, list[tuple[float, ...]]] = defaultdict(list)
    for ctx, n, cached, new, s in m.warm:
        by_warm[(ctx, n)].append((cached, new, rows(new) * (cached + new / 2), s / sharing))
    warm = [v for _, v in _medians(by_warm)]  # (cached, new tokens, attention pairs, seconds) per swept point
    by_step: dict[tuple, list[tuple[float, ...]]] = defaultdict(list)
    for b, ctx, mean_ctx, s in m.decode:
        by_step[(b, ctx)].append((mean_ctx, s / sharing))
    decode = [(k[0], *v) for k, v in _medians(by_step)]  # (batch, mean context, step s) per swept point
    # medians per point, then the fit: on a shared machine single requests stall now and then, and
    # a fit on relative error over raw points would chase those stalls
    c0, c_decode, c_attn = nonneg_lstsq([[1.0, b, b * ctx] for b, ctx, _ in decode], [s for *_, s in decode])
    rest = [s - c0 for *_, s in prefill] + [s - c0 for *_, s in warm]
    if min(rest) <= 0:
        raise ValueError("prefill took less than one decode step: the measurements are inconsistent "
                         "(is something else loading the engines?)")
    overhead, c_prefill, c_pattn = nonneg_lstsq(
        [[1.0, t, a] for t, a, _ in prefill] + [[1.0, n, a] for _, n, a, _ in warm], rest)
    sigma, sigma_points = step_sigma(m.prefill)
    delay = api_delay(m.probes)
    # the engines' own prefix-cache unit where they all say the same (vLLM: its block size;
    # llama-server: 1, token by token), else the argument
    blocks = {f.cache_block for f in facts}
    if len(blocks) == 1 and None not in blocks:
        block_size = blocks.pop() or block_size
    kv = kv_tokens or min((f.kv_tokens for f in facts if f.kv_tokens), default=None) or 65536
    running = max_running or min((f.slots for f in facts if f.slots), default=None) or 256
    batch = max_batched_tokens or min((f.batch_tokens for f in facts if f.batch_tokens), default=None) or 8192
    busy, admit = _busy_overhead(m, sharing, c0, c_decode, c_attn, c_prefill, c_pattn)
    profile = HardwareProfile(
        name=name, hardware=hardware, model=m.model, c0_s=c0, c_prefill_s=c_prefill, c_decode_s=c_decode,
        c_attn_s=c_attn, c_prefill_attn_s=c_pattn, ttft_overhead_s=overhead, kv_blocks=max(1, kv // block_size),
        block_size=block_size, max_running=running, max_batched_tokens=batch,
        # llama-server (it has slots) lends a cached prefix only from a slot serving no request
        prefix_reuse="idle_slots" if any(f.slots for f in facts) else "shared",
        waiting_gauge=_waiting_gauge(facts),
        noise_step_sigma=sigma, noise_api_delay_s=delay["api_delay_s"], ttft_overhead_busy_s=busy,
        c_admit_s=admit, prefill_attn_tile=tile, slot_save_s_per_token=slot_per_token(m.slot_saves, sharing),
        # the per-core transient beyond processor sharing: only where the cores are shared (sim/host.py)
        newcomer_slowdown=[NewcomerPoint(others=k, solo_s=t, factor=f) for k, t, f in
                           newcomer_factors(m.newcomer, host_cores, background)] if host_cores else [])
    # the batch-heterogeneity coefficient, where two prompts in one step were timed against one (mixed_probe.py);
    # else the default (CascadeInfer §2.2, a GPU decode pass)
    h_cv = fit_h_cv(m.mixed, profile)
    if h_cv is not None:
        profile = profile.model_copy(update={"h_cv": h_cv})
    # a warm prefill joining a decoding batch, against the model's time for that step (mixed_decode_probe.py)
    mixed, mixed_report = fit_mixed_prefill(m.mixed_decode, profile, sharing)
    if mixed is not None:
        profile = profile.model_copy(update={"c_prefill_mixed_s": mixed})
    source = f"measured by kvroute calibrate, {len(facts)} engine(s) loaded together"
    if sharing > 1:
        source += f", divided by {sharing:.3g} for {host_cores} shared cores"
    points, errors = [], []
    for length, pairs, s in prefill:
        got = profile.ttft_overhead_s + profile.step_time(round(length), prefill_attn=pairs)
        errors.append(got / s - 1)
        points.append({"prefill": round(length), "ttft_s": round(s, 6), "fit_s": round(got, 6),
                       "error": round(got / s - 1, 4), "source": source})
    for cached_mid, new_mid, pairs, s in warm:
        got = profile.ttft_overhead_s + profile.step_time(round(new_mid), prefill_attn=pairs)
        errors.append(got / s - 1)
        points.append({"prefill": round(new_mid), "cached": round(cached_mid), "ttft_s": round(s, 6),
                       "fit_s": round(got, 6),
                       "error": round(got / s - 1, 4), "source": source})
    for b, mean_ctx, s in decode:
        got = profile.step_time(decode=b, decode_ctx=b * mean_ctx)
        errors.append(got / s - 1)
        points.append({"decode": b, "ctx": round(mean_ctx), "expect_s": round(s, 6), "fit_s": round(got, 6),
                       "error": round(got / s - 1, 4), "source": source})
    rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
    profile = profile.model_copy(update={
        "points": points,
        "no_independent_anchor": "a calibration fits every point it measures; re-run it to check a profile"})
    report = {"rms_error": rms, "max_error": max(abs(e) for e in errors), "points": points,
              "engines": [f.__dict__ for f in facts], "wall_s": m.wall_s, "host_cores": host_cores,
              "sharing": sharing, "background_cores": background,
              "sweep": (sweep or Sweep()).__dict__, "raw_prefill": len(m.prefill), "raw_decode": len(m.decode),
              # how many repeats the sweep ran, and how far leaving one out moves each kind of point (repeat_check.py)
              "repeats": len(m.repeat_ends) or None, "repeat_shifts": shifts(m),
              "raw_warm": len(m.warm), "busy_probes": len(m.busy), "slot_probes": len(m.slot_saves),
              "newcomer_probes": len(m.newcomer), "mixed_probes": len(m.mixed), "h_cv_measured": h_cv,
              "mixed_decode": mixed_report,
              "noise": {"step_sigma": sigma, "step_points": sigma_points, **delay}}
    return profile, report


def _waiting_gauge(facts: list) -> str:
    """What the engines export as waiting: llama-server (it has slots) ``requests_deferred``
    (sim/deferred_gauge.py); vLLM (its /metrics gives ``cache_config_info``'s block size) the last
    finished step's ``num_requests_waiting`` (sim/step_gauge.py); anything else the live queue."""
    if any(f.slots for f in facts):
        return "llama_server"
    return "vllm" if facts and all(f.cache_block for f in facts) else "live"


def _busy_overhead(m: Measurements, sharing: float, c0: float, c_decode: float, c_attn: float, c_prefill: float,
                   c_pattn: float) -> tuple[float | None, float]:
    """What a request costs an engine that is stepping, beyond the step model (None, 0: not
    measured), from each tiny prompt sent beside a decoding batch: ``c_admit_s``, the extra time of
    the step it joined (the batch's longest token gap meanwhile, less that step as the model has
    it: time the engine's loop spends on a new request, which every running sequence waits for),
    and ``ttft_overhead_busy_s``, the rest of its latency past half a step waiting for the running
    one and the step it joined (time outside the loop: HTTP, an API server). Medians over engines
    and contexts, at least 0."""
    admit, outside = [], []
    for b, ctx, tokens, s, gap in m.busy:
        step = c0 + c_decode * b + c_attn * b * ctx
        joined = step + c_prefill * tokens + c_pattn * tokens * tokens / 2
        stall = max(0.0, gap / sharing - joined)
        admit.append(stall)
        outside.append(s / sharing - step / 2 - joined - stall)
    if not admit:
        return None, 0.0
    return max(0.0, statistics.median(outside)), max(0.0, statistics.median(admit))


def write_profile(path: str | Path, profile: HardwareProfile, report: dict) -> None:
    """A profile YAML that ``--profile PATH`` loads, with a header saying how it was measured."""
    facts = report["engines"]
    sweep = report["sweep"]
    header = [
        f"# Calibrated {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')} by `kvroute calibrate` "
        f"in {report['wall_s']:.0f} s against {len(facts)} engine(s), all loaded together:",
        *(f"#   {f['url']} ({f['bytes_per_token']:.2f} bytes/token, KV tokens {f['kv_tokens']}, slots {f['slots']})"
          for f in facts),
        f"# sweep: prefill {list(sweep['prefill_lengths'])} x{sweep['repeats']}, decode batches "
        f"{list(sweep['batch_sizes'])} at contexts {list(sweep['contexts'])}, {sweep['decode_tokens']} tokens each; "
        f"warm prefills {list(sweep.get('warm_lengths', ()))} new tokens after {list(sweep.get('warm_contexts', ()))}"
        + ("" if not report.get("repeats") else f"; {report['repeats']} repeats of all three, leaving one out moves "
           + ", ".join(f"{k} {v:.1%}" for k, v in report["repeat_shifts"].items()) + " (calibrate/repeat_check.py)"),
        "# Step time T = c0 + c_prefill*P + c_decode*D + c_attn*sum(ctx) + c_prefill_attn*sum(p*(ctx+p/2));",
        "# decode steps fit c0, c_decode, c_attn; cold and warm prefills fit ttft_overhead, c_prefill, c_prefill_attn",
        "# (least squares on relative error, coefficients >= 0). c_attn_fixed is folded into c0.",
        f"# fit error over {len(report['points'])} points: RMS {report['rms_error']:.1%}, "
        f"max {report['max_error']:.1%} (per point below: fit_s, error = fit/measured - 1).",
        "# kv_blocks, max_running: from the engines (/props, /metrics) or the command line; "
        "max_batched_tokens: llama-server's n_batch (2048, assumed), the command line, else 8192 (vLLM's "
        "API server on an H100/H200; 2048 on CPU);",
        "# prefix_reuse: idle_slots for llama-server (a prefix is reused only from an idle slot), else shared;",
        "# waiting_gauge: llama_server for llama-server (requests_deferred: no free slot; sim/deferred_gauge.py), "
        "vllm for vLLM (the last finished step's counts; sim/step_gauge.py), else live;",
        "# prefill_attn_tile: 64 for llama-server (ggml's CPU flash attention pads query rows to 64-row tiles), "
        "else 1;",
        "# block_size: the engines' prefix-cache unit (vLLM's cache_config_info block_size; llama-server: 1).",
    ]
    noise = report.get("noise")
    if profile.ttft_overhead_busy_s is not None:
        header.append(f"# c_admit_s, ttft_overhead_busy_s: from {report['busy_probes']} tiny prompts sent beside a "
                      "decoding batch: the step they joined beyond the model (the batch's longest token gap), and "
                      "the rest of their latency past the steps they waited for and joined (fit.py);")
        header.append("# ttft_overhead_s (the prefill fit's intercept) holds for an idle engine")
    if profile.slot_save_s_per_token:
        header.append(f"# slot_save_s_per_token: from {report.get('slot_probes', 0)} tiny prompts sent after a slot "
                      "of N fresh tokens (the sweep's slot_sizes) went idle, against the next tiny prompt "
                      "(llama-server copies idle slots to its host prompt cache; calibrate/slot_probe.py)")
    if profile.newcomer_slowdown:
        header.append(f"# newcomer_slowdown: from {report.get('newcomer_probes', 0)} warm and cold prefills sent "
                      "beside 1..N-1 engines each running a long prefill, against the same alone: the median of "
                      "beside / (alone x max(1, (others + 1) / (cores - background))) (calibrate/newcomer_probe.py)")
    if report.get("h_cv_measured") is not None:
        header.append(f"# h_cv: from {report['mixed_probes']} waits for two prompts started in one step against one "
                      "(a 1,536-token prompt with a 448-token one, behind a blocker): the h_cv at which the model's "
                      "ratio of the two is the measured median (calibrate/mixed_probe.py)")
    mixed = report.get("mixed_decode")
    if mixed:
        header.append(f"# c_prefill_mixed_s: from {mixed['points']} warm prefills ({mixed['new_tokens']:.0f} new "
                      f"after {mixed['cached_tokens']:.0f} cached) joining a decoding batch of {mixed['batch']:.0f}: "
                      "the joined "
                      f"step {mixed['joined_step_s'] * 1000:.2f} ms (median) where the model without the term gives "
                      f"{mixed['model_joined_step_s'] * 1000:.2f} ms, the excess per new token "
                      "(calibrate/mixed_decode_probe.py); the decode step before it "
                      f"{mixed['decode_step_s'] * 1000:.2f} ms, modelled {mixed['model_decode_step_s'] * 1000:.2f} ms")
    if noise:
        header.append(f"# engine noise (used only where a scenario says `engine_noise: profile`): step time "
                      f"log-sigma {noise['step_sigma']:.3f} from {noise['step_points']} prefill repeats; extra "
                      f"per-request delay mean {noise['api_delay_s'] * 1000:.2f} ms from {noise['probes']} "
                      "tiny-prompt probes (calibrate/noise.py)")
    if report.get("sharing", 1.0) > 1:
        header.append(f"# the engines share {report['host_cores']} cores: every measured time was divided by "
                      f"{report['sharing']:.3g} (engines / (cores - {report.get('background_cores', 0.0):.2f} cores "
                      "of other CPU measured meanwhile, calibrate/host_cpu.py)); simulate them with `host_cores: "
                      f"{report['host_cores']}` in the scenario's replica group")
    data = profile.model_dump(exclude_defaults=False)
    body = yaml.safe_dump(data, sort_keys=False, width=120)
    Path(path).write_text("\n".join(header) + "\n" + body)
