"""Calibrating and probing the engines of a fidelity run (issue 21): the model name and bytes per
token, the calibration sweep and `kvroute calibrate` run on them, and their speed now
(calibrate/speed_probe.py), which ``bench/fidelity.py`` takes around every live run."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time

import aiohttp

from kvroute.calibrate.measure import Sweep
from kvroute.calibrate.speed_probe import Speed, factors, predicted, speed_of
from kvroute.calibrate.speed_probe import probe as probe_speed


async def engine_facts(url: str) -> tuple[str, float]:
    """The engine's model name (llama-server takes any, vLLM only its own) and bytes per token."""
    from kvroute.calibrate.measure import _Engine, _model_card

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        model, limit = await _model_card(s, url, None)
        return model, (await _Engine(s, url, model, Sweep(), None).facts(limit)).bytes_per_token


def fidelity_sweep(props: object) -> Sweep:
    """The calibration sweep for engines whose ``/props`` answered ``props`` ({} where none).
    Decode contexts reach the workload's prompts (~1,800 tokens; the default stops at 1,024, and
    issue 21's simulated decode phase was half the live one with it). llama-server (it has slots)
    keeps the default batches. Engines without slots (vLLM) get decode batches up to 8 with 96
    tokens each, because with 24 tokens at batches 1-4 two vLLM CPU engines' API servers, waiting
    for cores, delivered a batch's tokens in bursts (one point 5 µs a step), which set the fit's
    c0 and c_decode to 0 and the simulated decode phase to ~10 ms where vLLM's own histograms said
    ~80 (issue 21); their longest context is 1,536, so that 8 fresh prompts and their output fit
    tests/vllm/fidelity.py's 16K-token cache without preemption. Both probe new steps beside busy ones and h_cv.
    Not the warm prefill joining a decoding batch (calibrate/mixed_decode_probe.py, ``Sweep.mixed_decode_rounds``):
    issue 21k's quiet runs found no excess on vLLM (44.8 ms joined against the model's 47.2), and on llama.cpp
    an excess (78.1 against 69.1 ms) that was mostly the decode model's own error (the decode step before it
    15.3 against 11.0 ms); with the term that run's replay gave 15 of 20 within 20 % (pooled 0 of 4), without
    it 16 (pooled 3 of 4)."""
    if isinstance(props, dict) and props.get("total_slots"):
        return Sweep(contexts=(128, 1024, 2048), newcomer_rounds=2, mixed_rounds=3)
    return Sweep(batch_sizes=(1, 2, 4, 8), decode_tokens=96, contexts=(128, 1024, 1536),
                 newcomer_rounds=2, mixed_rounds=3)


async def calibrate_engines(urls: list[str], host_cores: int | None, max_batched_tokens: int | None = None) -> str:
    """`kvroute calibrate` on these engines with :func:`fidelity_sweep` (the engines' shared cores
    divided out, see :mod:`kvroute.calibrate.fit`; ``max_batched_tokens``: their per-step token budget where
    they do not say it themselves); the path of the profile it wrote."""
    from kvroute.calibrate import fit_profile, measure, write_profile

    async with aiohttp.ClientSession() as s:
        try:
            async with s.get(f"{urls[0].rstrip('/')}/props", timeout=aiohttp.ClientTimeout(total=5)) as r:
                props = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
            props = {}
    sweep = fidelity_sweep(props)
    m = await measure(urls, sweep=sweep)
    profile, report = fit_profile(m, "fidelity", f"measured: {len(urls)} engine(s) loaded together",
                                  max_batched_tokens=max_batched_tokens, sweep=m.sweep, host_cores=host_cores)
    fd, path = tempfile.mkstemp(prefix="kvroute-fidelity-profile-", suffix=".yaml")
    os.close(fd)
    write_profile(path, profile, report)
    return path


async def speed_probe(urls: list[str], model: str) -> Speed:
    """The engines' speed now (calibrate/speed_probe.py ``probe``), all at once, each engine's prompts sized
    by its own tokenizer."""
    from kvroute.calibrate.measure import _Engine, _model_card

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        limits = [limit for _, limit in await asyncio.gather(*(_model_card(s, u, model) for u in urls))]
        engines = [_Engine(s, u, model, Sweep(), None) for u in urls]
        await asyncio.gather(*(e.facts(limit) for e, limit in zip(engines, limits, strict=True)))
        return await probe_speed(engines)


async def speed_reference(urls: list[str], model: str, profile: str, host_cores: int | None, out: dict,
                          say=None) -> Speed:
    """The reference of a run's speed factors: the profile's own prediction of the speed probe
    (calibrate/speed_probe.py ``predicted``), kept in ``out`` as ``speed_reference``; the probe taken now,
    right after the calibration, is kept beside it (``speed_after_calibration``) to show how far the
    engines had already moved from their profile, with the profile's prediction for the other CPU the
    machine used during that probe (``speed_after_calibration_expected``, ``..._background``: calibrate/host_cpu.py).
    That prediction is what the probe is to be compared with: the calibration divided its times by the sharing
    its own background implied, and the reference, without background, puts it back only for the engines'
    count — on two vLLM engines (0.5 background cores, 2 cores) the reference is 1.34x faster than what the
    calibration measured, which issue 21q read as a calibration ×1.46 fast (issue 21w)."""
    from kvroute.calibrate.host_cpu import CpuLedger
    from kvroute.perf.loader import load_profile

    loaded = load_profile(profile)
    reference = predicted(loaded, len(urls), host_cores)
    out["speed_reference"] = reference.as_dict()
    ledger, cpu0, t0 = CpuLedger(urls), time.process_time(), time.perf_counter()
    out["speed_after_calibration"] = (await speed_probe(urls, model)).as_dict()
    bg = ledger.background(time.perf_counter() - t0, time.process_time() - cpu0) if host_cores else None
    if bg is not None and host_cores:
        bg = min(bg, 0.9 * host_cores)
        out["speed_after_calibration_background"] = bg
        out["speed_after_calibration_expected"] = predicted(loaded, len(urls), host_cores, background=bg).as_dict()
    if say is not None:
        now, expected = out["speed_after_calibration"], out.get("speed_after_calibration_expected")
        say(f"speed probe after the calibration: cold prefill {now['prefill_s'] * 1000:.0f} ms, decode step "
            f"{(now['decode_s'] or 0) * 1000:.2f} ms; the profile's (reference): {reference.prefill_s * 1000:.0f} ms, "
            f"{(reference.decode_s or 0) * 1000:.2f} ms" + ("" if expected is None else (
                f"; with the {bg:.2f} cores of other CPU measured meanwhile {expected['prefill_s'] * 1000:.0f} ms, "
                f"{(expected['decode_s'] or 0) * 1000:.2f} ms")))
    return reference


def run_factors(profile: str, engines: int, host_cores: int | None, background: float, before: Speed,
                after: Speed | None) -> dict[str, float]:
    """A live run's speed factors: its probes over ``profile``'s prediction of the probe on the host as that run
    measured it (``background`` cores of other work, as its simulation has them)."""
    from kvroute.perf.loader import load_profile

    return factors(predicted(load_profile(profile), engines, host_cores, background=background), before, after)


def replay_factors(live: dict, profile: str, engines: int, host_cores: int | None,
                   background: float = 0.0) -> dict[str, float] | None:
    """A stored live run's speed factors against ``profile``'s prediction of the probe, from the probes it
    took before and after (its stored factors where it kept no probes; None where it has neither): a
    replay with another profile, or of a run stored while the reference was a probe taken after the
    calibration, gets the factors that profile's own speed implies."""
    from kvroute.perf.loader import load_profile

    speed = live.get("speed") or {}
    if "before" not in speed:
        return speed.get("factors")
    reference = predicted(load_profile(profile), engines, host_cores, background=background)
    return factors(reference, Speed(**speed["before"]), speed_of(speed.get("after")))
