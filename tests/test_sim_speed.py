"""`kvroute bench sim-speed`'s large run: it reports its memory per simulated request and stays
bounded (issue 22: a 1M-request run under 1 GB)."""

from kvroute.bench.sim_speed import million


def test_the_large_run_reports_memory_per_request_and_stays_small():
    m = million(3000)
    assert m["requests"] == 3000
    assert m["peak_rss_mb"] >= m["start_rss_mb"] > 0
    grown = (m["peak_rss_mb"] - m["start_rss_mb"]) * 2**20
    assert abs(m["bytes_per_request"] * m["requests"] - grown) <= 2**20 * 0.1 + m["requests"]
    assert m["under_1gb"] and m["sim_requests_per_s"] > 0
