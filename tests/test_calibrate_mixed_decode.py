"""A warm prefill joining a decoding batch (issue 21k): the calibration's probe against emulated engines
whose step model is known, the fitted ``c_prefill_mixed_s``, and the simulated engine's use of it
(calibrate/mixed_decode_probe.py, profile ``c_prefill_mixed_s``)."""

import asyncio

import aiohttp
import pytest
from test_calibrate import KNOWN, known_emulators

from kvroute.calibrate import Sweep
from kvroute.calibrate.measure import _Engine, _model_card
from kvroute.calibrate.mixed_decode_probe import fit_mixed_prefill, mixed_decode_points
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop


def _points(profile, extra_per_token: float, batch: int = 4, ctx: float = 1560.0, cached: int = 1536,
            new: int = 96) -> list:
    """What an engine that runs ``profile`` plus ``extra_per_token`` per prefill token beside decodes gives."""
    ends = [ctx] * batch + [cached + new]
    mix = profile.step_time(new, batch, batch * ctx, profile.attn_rows(new) * (cached + new / 2),
                            profile.heterogeneity(len(ends), sum(ends), sum(e * e for e in ends)))
    step = profile.step_time(decode=batch, decode_ctx=batch * ctx)
    return [(batch, ctx, cached, new, step, mix + profile.c_admit_s + extra_per_token * new, 0.1)] * 3


def test_the_fit_recovers_the_extra_cost_per_token_and_never_goes_below_zero():
    p = KNOWN.model_copy(update={"c_admit_s": 0.002, "h_cv": 0.3})
    got, report = fit_mixed_prefill(_points(p, 5e-5), p)
    assert got == pytest.approx(5e-5) and report["points"] == 3
    assert report["joined_step_s"] > report["model_joined_step_s"] and report["decode_step_s"] == pytest.approx(
        report["model_decode_step_s"])
    assert fit_mixed_prefill(_points(p, -5e-5), p)[0] == 0.0  # faster than the model: no negative cost
    # measured on engines sharing the cores: divided by the calibration's sharing first
    doubled = [(b, c, k, n, s * 2, j * 2, lat) for b, c, k, n, s, j, lat in _points(p, 5e-5)]
    assert fit_mixed_prefill(doubled, p, sharing=2.0)[0] == pytest.approx(5e-5)
    assert fit_mixed_prefill([], p) == (None, {})


def _step_seconds(extra: float, decoding: bool) -> float:
    """Seconds until a 96-token prompt's first token on an engine that, where ``decoding``, runs one long
    decode beside it."""
    p = KNOWN.model_copy(update={"c_prefill_mixed_s": extra, "h_cv": 0.0})
    loop = EventLoop()
    first: dict[str, float] = {}
    engine = Engine("e", p, loop, lambda s, t: first.setdefault(s.rid, t), lambda s, t: None)
    if decoding:
        engine.submit(Seq("d", 64, 1000, (1,), 16))
        loop.run(stop=lambda: "d" in first)
    start = loop.now
    engine.submit(Seq("w", 96, 1, (2,), 16))
    loop.run(stop=lambda: "w" in first)
    return first["w"] - start


def test_the_engine_adds_the_term_only_to_steps_that_also_decode():
    assert _step_seconds(1e-4, decoding=False) == _step_seconds(0.0, decoding=False)
    extra = _step_seconds(1e-4, decoding=True) - _step_seconds(0.0, decoding=True)
    assert extra == pytest.approx(96 * 1e-4, rel=0.01)  # one step of 96 prefill tokens


def test_the_probe_against_emulated_engines_finds_what_their_model_gives(tmp_path):
    """Two `kvroute emulate` processes of KNOWN (a step costs exactly its parts): the joined step is a
    prefill's worth longer than the decode steps around it, and the fitted excess per token stays small
    (the emulator's timers run a few ms late on a loaded machine: a wide band)."""
    sweep = Sweep(batch_sizes=(1, 2, 4), warm_contexts=(512, 1024), warm_lengths=(96, 256), decode_tokens=24,
                  mixed_decode_rounds=2, timeout_s=20)
    lines: list[str] = []

    async def run() -> list:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            model, limit = await _model_card(s, urls[0], None)
            engines = [_Engine(s, u, model, sweep, None) for u in urls]
            await asyncio.gather(*(e.facts(limit) for e in engines))
            return await mixed_decode_points(engines, sweep, lines.append)

    with known_emulators(tmp_path) as urls:
        points = asyncio.run(asyncio.wait_for(run(), 90))
    assert len(lines) == 2 and len(points) >= 3
    for batch, ctx, cached, new, step, joined, latency in points:
        # the emulator caches whole 64-token blocks: up to 63 of the base count as new
        assert batch == 4 and cached >= 900 and 60 <= new <= 96 + 64 + 16 and ctx > cached
        assert joined > step and latency > 0
    got, report = fit_mixed_prefill(points, KNOWN)
    # the model's joined step here is ~34 ms, the decode step ~18: the prefill's share of the joined step,
    # measured, is of the model's size (at load ~10 the emulator's timers ran 1.3-1.5x: a wide band)
    share = report["joined_step_s"] - report["decode_step_s"]
    model_share = report["model_joined_step_s"] - report["model_decode_step_s"]
    assert 0.5 < share / model_share < 2.5, (lines, report)
    assert got is not None and got >= 0.0
