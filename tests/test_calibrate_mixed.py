"""Two prompts in one engine step against one (issue 21j): the calibration's probe and the h_cv it
fits (calibrate/mixed_probe.py, profile ``h_cv``). Deterministic: fake engines, no timing asserted."""

import asyncio
import time

import pytest

from kvroute.calibrate import fit_profile
from kvroute.calibrate.measure import EngineFacts, Measurements, Sweep
from kvroute.calibrate.mixed_probe import _steps, fit_h_cv, mixed_points
from kvroute.perf.profile import HardwareProfile

# llama-server-like: 2,048 prompt tokens a step, 64-row attention tiles, attention about half a long prefill
PROF = HardwareProfile(name="unit", hardware="test", model="test", c0_s=1e-4, c_prefill_s=1e-4, c_decode_s=3e-4,
                       c_attn_s=5e-7, c_prefill_attn_s=1e-7, ttft_overhead_s=2e-3, kv_blocks=16384, block_size=1,
                       max_running=4, max_batched_tokens=2048, prefill_attn_tile=64)


def _points(h_cv: float, a: int = 1536, c: int = 448) -> list[tuple[int, float, int, int, float]]:
    """What an engine that runs the model with ``h_cv`` exactly gives the probe (alone, together)."""
    return [(a, _steps(PROF, h_cv, (a,)), a, c, _steps(PROF, h_cv, (a, c)))] * 3


def test_the_fit_recovers_the_h_cv_the_engine_ran_with():
    for true in (0.2, 0.8, 1.5):
        assert fit_h_cv(_points(true), PROF) == pytest.approx(true, abs=1e-6)


def test_a_step_no_slower_than_the_model_without_the_term_gives_zero():
    a, alone, a2, c, both = _points(0.0)[0]
    assert fit_h_cv([(a, alone, a2, c, both * 0.9)], PROF) == 0.0
    assert fit_h_cv([], PROF) is None


def test_the_two_prompts_share_one_step_within_the_budget_and_spill_beyond_it():
    one_step = _steps(PROF, 0.0, (1536, 448))
    q = PROF.model_copy(update={"h_cv": 0.0})
    assert one_step == pytest.approx(q.ttft_overhead_s + q.step_time(
        1984, prefill_attn=1536 * 768 + 448 * 224))
    # a 1,024-token budget: 1,024 of A, then A's last 512 and C's 448 (at most 512 + 448 = 960 tokens)
    small = PROF.model_copy(update={"max_batched_tokens": 1024, "h_cv": 0.0})
    assert _steps(small, 0.0, (1536, 448)) == pytest.approx(
        small.ttft_overhead_s + small.step_time(1024, prefill_attn=1024 * 512)
        + small.step_time(960, prefill_attn=512 * (1024 + 256) + 448 * 224))


def test_the_fitted_profile_carries_the_measured_h_cv_and_says_so():
    m = Measurements([EngineFacts("http://e0", 3.0)], "test")
    for n in (128, 512, 1024, 2048):
        m.prefill += [(n, n, PROF.prefill_time(n) + PROF.ttft_overhead_s)] * 3
    for bs in (1, 2, 4):
        for ctx in (128, 1024):
            m.decode += [(bs, ctx, ctx, PROF.step_time(decode=bs, decode_ctx=bs * ctx))] * 3
    default, report = fit_profile(m, "x", "test")
    assert default.h_cv == HardwareProfile.model_fields["h_cv"].default and report["h_cv_measured"] is None
    m.mixed = _points(0.0)
    measured, report = fit_profile(m, "x", "test")
    assert measured.h_cv == pytest.approx(0.0, abs=0.05) and report["mixed_probes"] == 3


class _Fake:
    """An engine whose prompts each take 1 ms x (tokens / 100), all at once (no step model)."""

    def __init__(self):
        self.n = 0

    def prompt(self, tokens: int) -> str:
        self.n += 1
        return f"p{self.n} " + "x " * tokens

    async def complete(self, prompt: str, max_tokens: int) -> tuple[float, int]:
        tokens = len(prompt.split()) - 1
        await asyncio.sleep(tokens / 1e5)
        return tokens / 1e5, tokens

    async def stream_times(self, prompt: str, max_tokens: int, on_first=None) -> list[float]:
        await asyncio.sleep((len(prompt.split()) - 1) / 1e5)
        if on_first is not None:
            on_first()
        return [time.perf_counter()]


def test_the_probe_times_one_and_two_prompts_behind_a_blocker_on_every_engine():
    sweep = Sweep(warm_contexts=(512, 1536), mixed_rounds=2)
    lines: list[str] = []
    points = asyncio.run(mixed_points([_Fake(), _Fake()], sweep, lines.append, lead_s=0.001))
    assert len(points) == 4 and len(lines) == 2
    for a, alone, a2, c, both in points:
        assert (a, a2, c) == (1536, 1536, 448) and isinstance(alone, float) and isinstance(both, float)
    assert asyncio.run(mixed_points([_Fake()], Sweep(), lines.append)) == []  # 0 rounds by default
