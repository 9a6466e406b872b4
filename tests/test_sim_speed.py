"""`kvroute bench sim-speed`'s large run: it reports its memory per simulated request and stays
bounded (issue 22: a 1M-request run under 1 GB)."""

from conftest import needs_trace

from kvroute.bench.sim_speed import million, run


def test_the_large_run_reports_memory_per_request_and_stays_small():
    m = million(3000)
    assert m["requests"] == 3000
    assert m["peak_rss_mb"] >= m["start_rss_mb"] > 0
    grown = (m["peak_rss_mb"] - m["start_rss_mb"]) * 2**20
    assert abs(m["bytes_per_request"] * m["requests"] - grown) <= 2**20 * 0.1 + m["requests"]
    assert m["under_1gb"] and m["sim_requests_per_s"] > 0


@needs_trace
def test_the_speed_runs_name_their_build_and_summarise_repeats():
    """In the editable (pure) checkout only the pure build runs; each run is a child process."""
    r = run(progress=lambda _m: None, with_million=False, repeats=2, presets=("round_robin",))
    assert list(r["builds"]) == ["pure"] and r["build"] == "pure" and r["identical"] and "speedup" not in r
    pp = r["per_preset"]["round_robin"]
    assert pp["min"] <= pp["sim_requests_per_s"] <= pp["max"] and pp["requests"] > 10_000
    assert pp["build"].startswith("pure Python")
