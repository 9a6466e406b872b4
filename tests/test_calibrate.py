"""`kvroute calibrate` against emulated engines whose step-time profile is known: the fit must
recover it. (tests/test_llamacpp.py calibrates real llama-servers.)"""

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from kvroute.calibrate import Sweep, fit_profile, measure, write_profile
from kvroute.calibrate.fit import nonneg_lstsq
from kvroute.calibrate.host_cpu import machine_busy_s
from kvroute.cli import main
from kvroute.emulator.server import Faults, start_emulator
from kvroute.perf.loader import load_profile
from kvroute.perf.profile import HardwareProfile
from kvroute.ports import free_ports, wait_for_http

# CPU-engine-like costs: steps of milliseconds, so the emulator's real-time clock resolves them
KNOWN = HardwareProfile(name="known", hardware="test", model="test", c0_s=0.004, c_prefill_s=8e-5,
                        c_decode_s=1.5e-3, c_attn_s=2e-6, c_prefill_attn_s=4e-8, kv_blocks=20000,
                        block_size=16, max_running=8)
# two repeats on two engines: every point is the median of four, so one stalled
# request on a loaded machine moves none (with one repeat a point was the mean of two: one stall
# put a point 48-56 % off its fit at load 4-6); no check-and-repeat (max_repeats: the counts stay known;
# tests/test_calibrate_repeats.py checks it)
SWEEP = Sweep(prefill_lengths=(256, 512, 1024, 2048), batch_sizes=(1, 2, 4), contexts=(128, 1024),
              decode_tokens=16, repeats=2, max_repeats=2, timeout_s=20)


def _calibrate(tmp_path):
    """The sweep against two emulators of KNOWN, each a `kvroute emulate` process of its own, as
    engines are: an emulated step ends on a timer, and in this process's event loop, shared with
    the other emulator and the measuring client, the timers fired 2.6-12.6 ms late on average at
    load 4-8 (fitted decode steps of 6-16 ms for the profile's 5.8; the test passed 4 of 9 runs
    at load 4-7 so, 12 of 15 with the emulators in processes of their own, 10 of 10 at load 3-5
    with two repeats as well). Returns the measurements and how late, on average, a request's
    path ran: :func:`_path_lateness`."""
    with known_emulators(tmp_path) as urls:
        m, client_lags = asyncio.run(_measure_with_lag(urls))
        reports = [_timers(u) for u in urls]
    return m, _path_lateness(reports, client_lags)


async def _measure_with_lag(urls):
    """``measure`` with a task beside it in the same event loop that sleeps 5 ms at a time and
    records how much later than asked it woke: the measuring client's own lateness."""
    lags: list[float] = []
    done = asyncio.Event()

    async def sleeper():
        while not done.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(max(0.0, time.monotonic() - t - 0.005))

    task = asyncio.create_task(sleeper())
    try:
        return await asyncio.wait_for(measure(urls, sweep=SWEEP), 60), lags
    finally:
        done.set()
        await task


def _timers(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/_timers", timeout=10) as r:
        return json.loads(r.read())


def _path_lateness(reports: list[dict], client_lags: list[float]) -> float:
    """The mean lateness, measured, of one request's time to first token on a loaded machine: the
    emulator's first token (its own work and its step's timer: GET /_timers ``first_tokens``), its
    wake-up to read the request (its timers' mean wake-up lateness, ``wakeups``: a socket's wake-up
    is the same event loop's), and the client's wake-up to read the token (``client_lags``). Means,
    as the fit's least squares average its points. Near 0 on an idle machine."""
    emulator = statistics.mean(r["first_tokens"]["mean_s"] + r["wakeups"]["mean_s"] for r in reports)
    return emulator + (statistics.mean(client_lags) if client_lags else 0.0)


@contextlib.contextmanager
def known_emulators(tmp_path, n: int = 2):
    """``n`` `kvroute emulate` processes of KNOWN (llama.cpp-flavoured), listening; yields their
    URLs and stops them by PID afterwards."""
    profile = tmp_path / "known.yaml"
    profile.write_text(yaml.safe_dump(KNOWN.model_dump(exclude_none=True)))
    ports = free_ports(n)
    procs = [subprocess.Popen([sys.executable, "-m", "kvroute.cli", "emulate", "--port", str(p), "--profile",
                               str(profile), "--engine", "llamacpp"], stderr=subprocess.DEVNULL) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u in urls:
            wait_for_http(f"{u}/health", 30)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def test_fit_recovers_the_emulators_known_profile(tmp_path):
    m, late = _calibrate(tmp_path)
    assert len(m.prefill) == 16 and len(m.decode) == 24  # every point on both engines, twice
    # the engines listen on this machine: the sweep measured the other CPU here meanwhile (host_cpu.py)
    assert (m.background_cores or 0.0) >= 0 and (m.background_cores is not None or machine_busy_s() is None)
    fitted, report = fit_profile(m, "mine", "emulated", sweep=SWEEP)
    # The emulator steps in real time, so on a loaded machine its steps run late and single
    # coefficients trade off against each other (linear vs quadratic prefill, c0 vs c_decode);
    # what the simulator uses is the times they predict, checked over the swept range. On an
    # idle machine these agree within 2-4 %; the bound allows a shared, busy one, where each
    # emulated step's sleep also wakes a millisecond or two late whatever its length (7.9 vs
    # 5.8 ms seen at load average ~6): an absolute slack of 3 ms beside the relative one.
    for b in (1, 2, 4):
        for ctx in (150, 600, 1000):
            assert fitted.step_time(decode=b, decode_ctx=b * ctx) == pytest.approx(
                KNOWN.step_time(decode=b, decode_ctx=b * ctx), rel=0.25, abs=0.003), (b, ctx)
    # a request's real-time emulation runs late by a few ms on a loaded machine, whatever its
    # size: an absolute slack of 10 ms beside the relative one, plus the lateness measured on the
    # requests' path in this run (_path_lateness; about 0 when idle). ci17 (session 17, busy): at
    # load ~7 n=300's error was 4.4-8.8 ms with 2.9-6.3 ms measured; beside two CPU hogs 12.3 and
    # 22.4 ms with 8.1 and 17.9 ms measured, where the fixed 10 ms alone failed both
    slack = 0.01 + late
    for n in (300, 1000, 2000):
        assert fitted.ttft_overhead_s + fitted.prefill_time(n) == pytest.approx(KNOWN.prefill_time(n), rel=0.25,
                                                                                abs=slack), (n, late)
    # warm prefills (new tokens over a cached prefix) are predicted too, not only cold ones
    assert len(m.warm) == 16 and all(cached > 0 for _, _, cached, _, _ in m.warm)
    for n, ctx in ((64, 1500), (256, 500)):
        assert fitted.ttft_overhead_s + fitted.step_time(n, prefill_attn=n * (ctx + n / 2)) == pytest.approx(
            KNOWN.step_time(n, prefill_attn=n * (ctx + n / 2)), rel=0.25, abs=slack), (n, ctx, late)
    assert report["max_error"] < 0.25 and len(report["points"]) == 14  # 4 cold, 4 warm, 6 decode
    # the overhead beside a decoding batch: the emulator's is the same as when idle
    assert len(m.busy) == 2 * len(SWEEP.contexts) * SWEEP.busy_rounds and fitted.ttft_overhead_busy_s is not None
    assert fitted.ttft_overhead_busy_s == pytest.approx(KNOWN.ttft_overhead_s, abs=slack), late
    assert fitted.c_admit_s == pytest.approx(0.0, abs=0.005)  # the emulator's loop takes no extra time
    assert m.slot_saves == [] and fitted.slot_save_s_per_token == 0  # no slots: no llama-server copies
    # the noise measurement: a spread of step times and a per-request delay, both measured
    assert report["noise"]["probes"] == 2 * SWEEP.noise_probes and fitted.noise_api_delay_s >= 0
    assert report["noise"]["step_points"] > 0 and fitted.noise_step_sigma >= 0
    out = tmp_path / "mine.yaml"
    write_profile(out, fitted, report)
    loaded = load_profile(str(out))  # a profile `simulate --profile PATH` takes as it is
    assert loaded.c_prefill_s == fitted.c_prefill_s and loaded.model == "emulated"
    # the emulator has no /props and no vLLM cache_config_info: its cache unit is not known
    assert [f.cache_block for f in m.engines] == [None, None] and loaded.block_size == 16
    assert loaded.prefill_attn_tile == 1  # no slots: not llama-server, query rows as they are
    assert all("error" in pt and "fit_s" in pt and pt["source"] for pt in loaded.points)
    assert out.read_text().startswith("# Calibrated ")


def test_a_stream_delivered_in_one_burst_gives_no_step_time():
    from kvroute.calibrate.stream_steps import _step_time

    steady = [0.0, 0.01, 0.02, 0.03, 0.04]
    assert _step_time([steady, [x + 0.001 for x in steady]]) == pytest.approx(0.01)
    burst = [0.02] * 5  # every token in one write: no step time in it (was 0.0 s)
    assert _step_time([burst]) is None
    assert _step_time([[0.0, *burst[1:]], steady]) == pytest.approx((0.02 / 4 + 0.01) / 2)  # a real span counts


def test_nonnegative_fit_drops_a_term_that_would_fit_noise():
    rows = [[1.0, x] for x in (1, 2, 3, 4)]
    assert nonneg_lstsq(rows, [3.0, 5.0, 7.0, 9.0]) == pytest.approx([1.0, 2.0])
    c, slope = nonneg_lstsq(rows, [5.0, 4.9, 5.1, 4.8])  # a falling line: no negative cost
    assert slope == 0.0 and c == pytest.approx(4.95, rel=0.02)


def test_calibrate_errors_are_one_line(tmp_path, capsys):
    assert main(["calibrate", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.yaml")]) == 2
    msg = capsys.readouterr().err
    assert "http://127.0.0.1:9" in msg and "Traceback" not in msg
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--url", "http://x", "--out", str(tmp_path / "p.yaml"), "--batch-sizes", "1,zero"])
    assert exc.value.code == 2


def test_calibrate_reads_the_context_limit_and_hits_its_targets():
    """Against engines like the real vLLM of issue 26 — a 1,024-token context limit in
    /v1/models, 1.25 bytes per token — the first requests fit, the default lengths are cut to
    what the limit holds, and every point lands within 2 % of its target."""
    async def run():
        emus = [await start_emulator("127.0.0.1", 0, KNOWN, "vllm", Faults(), bytes_per_token=1.25,
                                     max_model_len=1024) for _ in range(2)]
        notes: list[str] = []
        try:
            sweep = Sweep(decode_tokens=16, repeats=1, timeout_s=20)  # the default lengths, up to 2,048
            m = await measure([f"http://127.0.0.1:{port}" for _, _, port in emus], sweep=sweep, log=notes.append)
        finally:
            for runner, _, _ in emus:
                await runner.cleanup()
        return m, notes

    m, notes = asyncio.run(asyncio.wait_for(run(), 60))
    assert m.sweep is not None and max(m.sweep.prefill_lengths) + 1 <= 1024
    assert max(m.sweep.contexts) + 16 <= 1024
    assert any("max_model_len is 1024" in n for n in notes)
    assert [f.max_model_len for f in m.engines] == [1024, 1024]
    assert [f.cache_block for f in m.engines] == [16, 16]  # vLLM's cache_config_info block_size
    for target, tokens, _ in m.prefill:
        assert abs(tokens - target) <= max(2, 0.02 * target), (target, tokens)
    assert len(m.decode) == 2 * len(m.sweep.contexts) * len(m.sweep.batch_sizes)


def test_the_token_line_learns_a_fixed_cost_per_prompt():
    from kvroute.calibrate.measure import token_line

    assert token_line([(1000, 850), (2000, 1650)]) == pytest.approx((50.0, 1.25))
    assert token_line([(1000, 800)]) is None  # one size: no line
    overhead, bpt = token_line([(1000, 240), (2000, 500)])  # a line below the origin: no negative cost
    assert overhead == 0.0 and bpt == pytest.approx(3000 / 740)


def test_llama_server_fit_counts_attention_rows_in_64_row_tiles():
    """Points made by a llama-server-like profile (tile 64): the fit, told the engines have slots,
    recovers the attention cost and writes the tile; 100 new tokens cost 128 rows."""
    from kvroute.calibrate.measure import EngineFacts

    true = KNOWN.model_copy(update={"prefill_attn_tile": 64, "c_prefill_attn_s": 2e-7, "c0_s": 0.0005})
    fitted, report = fit_profile(_points(true, EngineFacts("http://a", 3.0, slots=4)), "llama", "synthetic")
    assert fitted.prefill_attn_tile == 64 and report["max_error"] < 1e-6
    assert fitted.c_prefill_attn_s == pytest.approx(2e-7, rel=1e-6)
    assert fitted.attn_rows(100) == 128 and fitted.attn_rows(62) == 62 and fitted.attn_rows(512) == 512
    assert KNOWN.attn_rows(100) == 100  # tile 1: rows as they are


def test_an_engine_that_does_not_say_its_step_budget_takes_the_one_given():
    """vLLM publishes no per-step token budget (its default depends on the device: 2048 on CPU, 8192 on an
    H100's API server): the fit falls back to 8192 unless told, and `bench fidelity` passes the value on."""
    from kvroute.calibrate.measure import EngineFacts

    vllm_like = EngineFacts("http://a", 3.0, cache_block=16)
    assert fit_profile(_points(KNOWN, vllm_like), "v", "synthetic")[0].max_batched_tokens == 8192
    told = fit_profile(_points(KNOWN, vllm_like), "v", "synthetic", max_batched_tokens=2048)[0]
    assert told.max_batched_tokens == 2048 and told.waiting_gauge == "vllm"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "fidelity", "--url", "http://127.0.0.1:9", "--max-batched-tokens", "0"])
    assert exc.value.code == 2


def _points(true, facts):
    """Measurements of one engine with ``facts`` whose every point is ``true``'s exact time."""
    from kvroute.calibrate.measure import Measurements

    m = Measurements(engines=[facts])
    for n in (128, 512, 1024, 2048):
        m.prefill.append((n, n, true.ttft_overhead_s + true.prefill_time(n)))
    for ctx in (512, 1536):
        for n in (96, 256):
            pairs = true.attn_rows(n) * (ctx + n / 2)
            m.warm.append((ctx, n, ctx, n, true.ttft_overhead_s + true.step_time(n, prefill_attn=pairs)))
    for b in (1, 2, 4):
        for ctx in (128, 1024):
            m.decode.append((b, ctx, ctx, true.step_time(decode=b, decode_ctx=b * ctx)))
    return m
