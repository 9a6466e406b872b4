"""The engines' speed around each live fidelity run against the calibration's (issue 21k,
calibrate/speed_probe.py): the probe against emulated engines slowed at run time, the profile's own
prediction of the probe (the factors' reference since issue 21o), the factors, the scaled profile, and a
stored run's probes used again by ``--replay``."""

import asyncio
import json

import aiohttp
import pytest
import yaml
from test_calibrate import KNOWN, known_emulators

from kvroute.bench.fidelity_calibration import speed_probe
from kvroute.calibrate.speed_probe import DECODE_TERMS, PREFILL_TERMS, Speed, factors, predicted, scaled
from kvroute.perf.profile import NewcomerPoint


def test_the_probe_sees_an_engine_slowed_twofold(tmp_path):
    """Two `kvroute emulate` processes of KNOWN (prefill of 1,024 tokens ~105 ms, a decode step ~7.5 ms):
    probed, then slowed to half speed through their fault endpoint and probed again; both factors
    come out near 2 (the emulator's timers are late by a few ms on a loaded machine, which the slowdown does
    not double: a wide band)."""
    async def run() -> tuple[Speed, Speed]:
        first = await speed_probe(urls, "test")
        async with aiohttp.ClientSession() as s:
            for u in urls:
                async with s.post(f"{u}/_fault", json={"slowdown": 2.0}) as r:
                    assert r.status == 200
        return first, await speed_probe(urls, "test")

    with known_emulators(tmp_path) as urls:
        reference, slow = asyncio.run(asyncio.wait_for(run(), 60))
    assert reference.points == slow.points == 6  # 3 rounds x 2 engines
    # the model's own times: a cold prefill of ~1,024 tokens and a batch-1 decode step at ~1,040
    assert 0.08 < reference.prefill_s < 0.25 and reference.decode_s is not None and 0.005 < reference.decode_s < 0.02
    f = factors(reference, slow)
    assert 1.4 < f["prefill"] < 2.6 and 1.4 < f["decode"] < 2.6
    # the profile the emulators run predicts the first probe: factors near 1 (late timers only make them > 1)
    f = factors(predicted(KNOWN, 2, None), reference)
    assert 0.85 < f["prefill"] < 1.6 and 0.85 < f["decode"] < 1.6


def test_predicted_probe_is_the_profiles_cold_prefill_and_decode_step():
    """The prediction by hand from KNOWN's terms; chunked by max_batched_tokens (the second chunk attends
    to the first); times the processor sharing of engines probed at once on fewer cores."""
    pre = KNOWN.c0_s + KNOWN.c_prefill_s * 1024 + KNOWN.c_prefill_attn_s * 1024 * 512
    step = KNOWN.c0_s + KNOWN.c_decode_s + KNOWN.c_attn_s * (1024 + 12)
    s = predicted(KNOWN, 2, None)
    assert s.prefill_s == pytest.approx(pre) and s.decode_s == pytest.approx(step)
    chunked = predicted(KNOWN.model_copy(update={"max_batched_tokens": 512, "ttft_overhead_s": 0.01}), 2, None)
    two = (0.01 + 2 * KNOWN.c0_s + KNOWN.c_prefill_s * 1024
           + KNOWN.c_prefill_attn_s * (512 * 256 + 512 * (512 + 256)))
    assert chunked.prefill_s == pytest.approx(two)
    shared = predicted(KNOWN, 3, 2)
    assert shared.prefill_s == pytest.approx(1.5 * pre) and shared.decode_s == pytest.approx(1.5 * step)
    assert predicted(KNOWN, 2, 4).prefill_s == pytest.approx(pre)  # fewer engines than cores: no sharing
    # other work on the cores (a live run's measured background) shares them too, as the simulator has it
    assert predicted(KNOWN, 2, 2, background=0.5).prefill_s == pytest.approx(pre * 2 / 1.5)


def test_factors_average_the_probes_around_a_run():
    ref = Speed(0.100, 0.010, 6)
    f = factors(ref, Speed(0.110, 0.012, 6), Speed(0.130, 0.014, 6))
    assert f == pytest.approx({"prefill": 1.2, "decode": 1.3})
    assert factors(ref, Speed(0.090, None, 6)) == pytest.approx({"prefill": 0.9, "decode": 0.9})  # no decode: prefill's


def test_scaled_profile_moves_each_term_with_its_probe():
    p = KNOWN.model_copy(update={"ttft_overhead_s": 0.002, "c_admit_s": 0.001, "ttft_overhead_busy_s": None,
                                 "newcomer_slowdown": [NewcomerPoint(others=1, solo_s=0.1, factor=1.3)]})
    q = scaled(p, {"prefill": 1.5, "decode": 0.8})
    for name in PREFILL_TERMS:
        before = getattr(p, name)
        assert getattr(q, name) == (None if before is None else pytest.approx(before * 1.5))
    for name in DECODE_TERMS:
        assert getattr(q, name) == pytest.approx(getattr(p, name) * 0.8)
    assert q.newcomer_slowdown[0].solo_s == pytest.approx(0.15) and q.newcomer_slowdown[0].factor == 1.3
    assert q.h_cv == p.h_cv and q.kv_blocks == p.kv_blocks  # ratios and capacities stay


def test_replay_uses_a_stored_runs_speed_factors(tmp_path):
    """A stored run whose live side measured the engines 1.5x slower: replayed with its factors, the
    simulated TTFT and E2E grow against the profile as calibrated, which the JSON keeps beside them."""
    from kvroute.bench.fidelity import Workload, conversations, simulate
    from kvroute.bench.fidelity_replay import replay

    profile = tmp_path / "known.yaml"
    profile.write_text(yaml.safe_dump(KNOWN.model_dump(exclude_none=True)))
    w = Workload(users=4, groups=2, system_tokens=300, turns=(2, 3), max_tokens=8)
    convs = conversations(w, 4.0, salt="s")
    sim = simulate(convs, "round_robin", str(profile), 2, 1.0, 8, tmp_path)
    live = {**sim, "token_ratio": 1.0, "speed": {"factors": {"prefill": 1.5, "decode": 1.5}}}
    stored = {"workload": {**w.__dict__, "turns": list(w.turns)}, "engines": ["a", "b"], "bytes_per_token": 4.0,
              "host_cores": None, "repeats": 1, "engine_noise": False, "profile": str(profile),
              "policies": {"round_robin": {"repeats": [{"seed": 0, "salt": "s", "live": live}]}}}
    stored = json.loads(json.dumps(stored))
    out = replay(stored, str(profile), with_speed=True)
    rep = out["policies"]["round_robin"]["repeats"][0]
    assert rep["sim_as_calibrated"]["per_request"] == sim["per_request"]  # unscaled: the stored run itself
    assert rep["sim"]["ttft_p50"] > 1.3 * sim["ttft_p50"] and rep["sim"]["e2e_p50"] > 1.3 * sim["e2e_p50"]
    assert out["as_calibrated"]["within_10pct"] == out["as_calibrated"]["compared"] == 5  # sim == live without
    # a run that kept its probes: replayed, its factors come anew from them over the profile's prediction,
    # not from the stored ones (there 1: the reference was then a probe taken after the calibration)
    slow = predicted(KNOWN, 2, None)
    probe = {"prefill_s": 1.5 * slow.prefill_s, "decode_s": 1.5 * (slow.decode_s or 0), "points": 6}
    stored["policies"]["round_robin"]["repeats"][0]["live"]["speed"] = {
        "before": probe, "after": probe, "factors": {"prefill": 1.0, "decode": 1.0}}
    again = replay(stored, str(profile), with_speed=True)["policies"]["round_robin"]["repeats"][0]["sim"]
    assert again["per_request"] == rep["sim"]["per_request"]  # x1.5, as above
    plain = replay(stored, str(profile))  # by default as calibrated, as the CLI's --speed off
    assert "as_calibrated" not in plain and plain["policies"]["round_robin"]["repeats"][0]["sim"]["per_request"] \
        == sim["per_request"]


def test_spread_separates_the_models_bias_from_a_repeats_drift():
    """bench/fidelity_spread.py on repeats built with a known bias (sim 1.25x live on TTFT p50 in every
    run) and a known drift (repeat 1's live runs 2x slower on E2E for every policy, the others as simulated)."""
    from kvroute.bench.fidelity_spread import describe, spread

    def run(i: int) -> dict:
        live = {"ttft_p50": 0.2, "e2e_p50": 0.5 * (2.0 if i == 1 else 1.0), "throughput": 0.0}
        return {"live": live, "sim": {"ttft_p50": 0.25, "e2e_p50": 0.5, "throughput": 3.0}}

    policies = {p: {"repeats": [run(i) for i in range(3)]} for p in ("a", "b")}
    s = spread(policies, ("ttft_p50", "e2e_p50", "throughput"))
    assert "throughput" not in s  # live 0: no ratio
    assert s["ttft_p50"]["bias"] == pytest.approx(1.25) and s["ttft_p50"]["spread"] == pytest.approx(0.0)
    assert s["ttft_p50"]["runs"] == 6 and s["ttft_p50"]["by_policy"] == pytest.approx({"a": 1.25, "b": 1.25})
    assert s["e2e_p50"]["by_repeat"] == pytest.approx([1.0, 0.5, 1.0])
    assert s["e2e_p50"]["bias"] == pytest.approx(0.5 ** (1 / 3)) and s["e2e_p50"]["spread"] > 0.3
    lines = describe(s, {"ttft_p50": "TTFT p50"})
    assert lines[0].startswith("TTFT p50: sim/live per run ×1.25") and "×1.00 ×0.50 ×1.00" in lines[1]


def test_a_probed_run_takes_its_factors_against_the_profiles_prediction(tmp_path):
    """bench fidelity's live loop with the speed probe (run_fidelity, ``speed=True``) against two `kvroute
    emulate` processes of KNOWN: the reference is the profile's prediction, the probe after the calibration is
    kept beside it, and every run's factors come out near 1 (the emulators run the profile itself)."""
    from kvroute.bench.fidelity import Workload, run_fidelity

    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(KNOWN.model_dump(exclude_none=True)))
    w = Workload(users=4, groups=2, system_tokens=300, turns=(2, 2), max_tokens=8)
    with known_emulators(tmp_path) as urls:
        out = asyncio.run(asyncio.wait_for(run_fidelity(urls, str(profile), ("round_robin",), w, repeats=1,
                                                        noise=False, speed=True), 120))
    assert out["speed_reference"] == predicted(KNOWN, 2, None).as_dict()
    assert out["speed_after_calibration"]["points"] == 6
    live = out["policies"]["round_robin"]["repeats"][0]["live"]
    assert 0.85 < live["speed"]["factors"]["prefill"] < 1.6 and 0.85 < live["speed"]["factors"]["decode"] < 1.6
    assert "as_calibrated" in out and out["as_calibrated"]["compared"] == 5


def test_convoys_count_requests_sharing_a_first_token_step():
    """bench/fidelity_spread.py: three requests of one engine whose first tokens came 1 ms apart are a convoy of 3,
    a lone one 1, another engine's request apart; the sim/live ratio of the convoys follows the runs' TTFT p50."""
    from kvroute.bench.fidelity_spread import convoy_size, convoys

    live = [[0.0, 0.200, 0, 0, 0, 0, 0, "engine-0"], [0.05, 0.151, 0, 0, 0, 0, 0, "engine-0"],
            [0.1, 0.102, 0, 0, 0, 0, 0, "engine-0"], [0.5, 0.1, 0, 0, 0, 0, 0, "engine-0"],
            [0.0, 0.2, 0, 0, 0, 0, 0, "engine-1"]]
    assert convoy_size(live, 7) == pytest.approx((3 * 3 + 1 + 1) / 5)
    sim = [[r[0], r[1], 0, 0, 0, int(r[7][-1])] for r in live]
    apart = [[0.3 * i, 0.1, 0, 0, 0, 0] for i in range(5)]  # one engine, every first token on its own
    runs = [{"live": {"per_request": live, "ttft_p50": 0.2}, "sim": {"per_request": s, "ttft_p50": t}}
            for s, t in ((sim, 0.2), (apart, 0.1), (sim, 0.22))]
    c = convoys({"p": {"repeats": runs}})
    assert c is not None and c["runs"] == 3 and c["corr_ttft_p50"] > 0.9
    assert c["ratio"] == pytest.approx((1 / 2.2) ** (1 / 3))
    assert convoys({"p": {"repeats": [{"live": {}, "sim": {}}]}}) is None
