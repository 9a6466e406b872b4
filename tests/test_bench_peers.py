"""`kvroute bench gateway --peers` and `--gate`: the harness measures a real peer (HAProxy, which
`make test` installs) beside a real kvroute process on loopback, skips a missing one with how to
install it, and the gate fails a slower build."""

from __future__ import annotations

import json

from kvroute.bench import gateway, gateway_peers, peers
from kvroute.cli import main
from tests.fleet_harness import needs_haproxy


@needs_haproxy
def test_peers_run_measures_haproxy_beside_kvroute_and_skips_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVROUTE_PEERS_BIN", str(tmp_path))  # the Rust routers' venv, if any, is not looked in
    monkeypatch.setattr(peers, "PEERS_VENV", "no-such-venv")
    monkeypatch.setattr(peers.shutil, "which", lambda _p: None)  # haproxy is still found in /usr/sbin
    lines: list[str] = []
    result = gateway_peers.run(requests=200, repeats=1, delays=(0.0,), peers=("haproxy", "vllm-router"),
                               busy_share=1.0, progress=lines.append)  # a test machine is never quiet
    assert result["skipped"] == [f"vllm-router: not installed, skipped; install: {peers.PEERS['vllm-router'].install}"]
    for mode in ("nonstream", "stream"):
        rows = result["delays"]["0"][mode]
        assert set(rows) == {"kvroute round_robin", "haproxy"}
        for row in rows.values():
            assert row["errors"] == 0 and row["gateway_rps"] > 0
            assert 0 <= row["others_share_max"] <= 1
        assert rows["kvroute round_robin"]["cpu_s_per_1000"] > 0  # a Python gateway spends measurable CPU
    assert any("kvroute round_robin" in v and "nginx" not in v for v in result["verdict"])
    assert not result["refused"]


@needs_haproxy
def test_a_busy_run_is_refused_not_reported(capsys, monkeypatch):
    monkeypatch.setattr(peers.shutil, "which", lambda _p: None)
    code = main(["bench", "gateway", "--peers", "haproxy", "--requests", "100", "--repeats", "1", "--delays", "0",
                 "--busy-share", "-1"])  # any share of other jobs is too much: every load is disturbed
    out = capsys.readouterr()
    assert code == 3
    assert "refused: other jobs kept the machine busy" in out.err
    assert "routers vs direct" not in out.out  # no table of numbers that cannot be trusted


def test_gate_fails_a_slower_build_and_passes_within_tolerance():
    row = {"gateway_cpu_us_per_req": 100.0}
    base = {"nonstream": {"round_robin": {"gateway_cpu_us_per_req": 80.0}},
            "stream": {"round_robin": {"gateway_cpu_us_per_req": 200.0}}}
    lines, failed = gateway.gate({"nonstream": {"round_robin": row}, "stream": {"round_robin": {
        "gateway_cpu_us_per_req": 205.0}}}, base, 0.10)
    assert len(lines) == 2
    assert failed == [lines[0]] and "+25%" in failed[0]
    _, failed = gateway.gate({"nonstream": {"round_robin": row}}, base, 0.30)
    assert failed == []


def test_gate_pairs_repeats_of_one_run():
    """Measured in the same run, each repeat is judged against the baseline's repeat beside it and
    the median of those ratios decides: a drift that moved both builds alike cancels, where the
    ratio of the two medians (here +25 %, one slow baseline repeat against three fast ones) would
    have failed a build that was never dearer than its neighbour by more than 5 %."""
    now = {"gateway_cpu_us_per_req": 125.0, "gateway_cpu_us_per_req_runs": [105.0, 125.0, 210.0]}
    then = {"gateway_cpu_us_per_req": 100.0, "gateway_cpu_us_per_req_runs": [100.0, 120.0, 200.0]}
    ratio, pairs = gateway.cpu_ratio(now, then)
    assert pairs == [1.05, 125.0 / 120.0, 1.05] and ratio == 1.05
    lines, failed = gateway.gate({"nonstream": {"round_robin": now}}, {"nonstream": {"round_robin": then}}, 0.10)
    assert failed == [] and "+5%, median of 3 paired repeats, +4% to +5%" in lines[0]
    slower = dict(now, gateway_cpu_us_per_req_runs=[120.0, 140.0, 215.0])  # +20 %, +17 %, +8 %
    _, failed = gateway.gate({"nonstream": {"round_robin": slower}}, {"nonstream": {"round_robin": then}}, 0.10)
    assert len(failed) == 1 and "+17%" in failed[0]
    # a stored baseline (another run's repeats): nothing to pair, the medians decide
    assert gateway.cpu_ratio(now, then, paired=False) == (1.25, [])
    assert gateway.cpu_ratio(now, {"gateway_cpu_us_per_req": 100.0}) == (1.25, [])


def test_gate_rows_keep_each_repeat_and_the_gateway_src_is_checked(tmp_path, capsys):
    direct = [{"rps": 100.0, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0}] * 2
    via = [{"rps": 90.0, "p50_ms": 1.5, "p99_ms": 2.5, "errors": 0, "cpu_us_per_req": c} for c in (210.0, 190.0)]
    row = gateway._compare(direct, via)
    assert row["gateway_cpu_us_per_req_runs"] == [210.0, 190.0] and row["gateway_cpu_us_per_req"] == 200.0
    assert main(["bench", "gateway", "--gateway-src", str(tmp_path)]) == 2
    assert "no kvroute package there" in capsys.readouterr().err


def test_gate_needs_a_baseline(capsys):
    assert main(["bench", "gateway", "--gate", "0.1"]) == 2
    assert "--gate needs a baseline" in capsys.readouterr().err
    assert main(["bench", "gateway", "--peers", "caddy"]) == 2


def test_each_kvroute_row_names_its_build_and_a_missing_compiled_build_is_refused(tmp_path, capsys):
    assert gateway.build_of(None).startswith("pure Python")  # the editable checkout: never compiled in place
    empty = tmp_path / "tree"
    empty.mkdir()
    (empty / "kvroute").mkdir()  # a tree without buildinfo (older than the compiled build) is pure
    (empty / "kvroute" / "__init__.py").write_text("")
    assert gateway.build_of(str(empty)) == "pure Python (a tree without kvroute.buildinfo)"
    variants, _ = gateway_peers._variants(("round_robin",), None, (), print, compiled_src="build/compiled")
    assert [name for name, _ in variants] == ["kvroute round_robin", "kvroute compiled round_robin"]
    assert main(["bench", "gateway", "--compiled", str(tmp_path / "nothing")]) == 2
    assert "build it with `make compiled`" in capsys.readouterr().err


def test_kvroute_runs_with_its_access_log_off_like_the_peers_or_on_as_asked(tmp_path):
    """``--access-log``: each kvroute build runs once per setting, and the setting is what the
    started gateway does: with it off no x-request-id is echoed (no per-request log work, like the
    peers), with it on the client's id comes back."""
    import subprocess
    import sys
    import urllib.request

    from kvroute.ports import free_ports, wait_for_port

    variants, _ = gateway_peers._variants(("round_robin",), None, (), print, compiled_src="build/compiled",
                                          access_logs=(False, True))
    assert [name for name, _ in variants] == [
        "kvroute round_robin", "kvroute round_robin +access_log",
        "kvroute compiled round_robin", "kvroute compiled round_robin +access_log"]
    ups = free_ports(2)
    upstream = subprocess.Popen([sys.executable, "-c", gateway.UPSTREAM, "0", *map(str, ups)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for p in ups:
            wait_for_port(p)
        for on in (False, True):
            proc, port = gateway_peers._start(("kvroute", "round_robin", None, on), ups, tmp_path)
            try:
                body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"content-type": "application/json", "x-request-id": "bench-1"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert r.status == 200 and json.loads(r.read())["choices"]
                    assert r.headers.get("x-request-id") == ("bench-1" if on else None)
            finally:
                gateway._stop(proc)
    finally:
        gateway._stop(upstream)


def test_the_fake_upstream_spreads_its_waits_only_when_asked():
    """``--upstream-spread-ms``: the fake engine waits its delay plus a seeded draw below the spread,
    so that requests sent together are answered apart; without it every wait is the delay."""
    import subprocess
    import sys
    import time
    import urllib.request

    from kvroute.ports import free_ports, wait_for_port

    assert gateway.upstream_arg(20) == "20" and gateway.upstream_arg(20, 8) == "20,8"
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    waits = {}
    for spread in (0, 40):
        port = free_ports(1)[0]
        upstream = subprocess.Popen([sys.executable, "-c", gateway.UPSTREAM, gateway.upstream_arg(10, spread),
                                     str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(port)
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as r:
                    assert r.status == 200 and json.loads(r.read())["choices"]
                times.append((time.perf_counter() - t0) * 1000)
            waits[spread] = times
        finally:
            gateway._stop(upstream)
    assert min(waits[0]) >= 9 and min(waits[40]) >= 9  # never shorter than the delay (ms timers: 1 ms slack)
    assert max(waits[40]) - min(waits[40]) > 15  # Random(0)'s first 12 draws x 40 ms span 10.4-36.3 ms
    assert sorted(waits[40])[6] > sorted(waits[0])[6] + 5  # median wait ~30 ms against ~10
