"""`kvroute bench fleet`: the planned workload is the same for every configuration, the summary
counts what the client saw, bad arguments are one-line errors, and a small run prints its table."""

from __future__ import annotations

import json

from kvroute.bench.fleet import Outcome, Workload, plan, summarize
from kvroute.cli import main
from tests.fleet_harness import needs_haproxy, needs_nats


def test_the_plan_is_fixed_by_the_seed():
    w = Workload(sessions=12, rate=5.0, groups=3, seed=7)
    a, b = plan(w), plan(w)
    assert [(s.start_s, s.system, s.questions, s.pauses) for s in a] == \
        [(s.start_s, s.system, s.questions, s.pauses) for s in b]
    assert len({s.system for s in a}) <= 3 and all(2 <= len(s.questions) <= 5 for s in a)
    assert plan(Workload(sessions=12, rate=5.0, groups=3, seed=8))[0].system != a[0].system or \
        plan(Workload(sessions=12, rate=5.0, groups=3, seed=8))[0].start_s != a[0].start_s


def test_summary_counts_what_the_client_saw():
    outs = [Outcome(0, 1, 0.05, "r0", 100, 80), Outcome(0, 1, 0.07, "r0", 100, 0), Outcome(0, 1, 0.06, "r1", 200, 100),
            Outcome(0, 1, error="502 gateway_instance_lost")]
    s = summarize(outs, replicas=2)
    assert (s["requests"], s["errors"]) == (4, 1)
    assert s["cached_share"] == 180 / 400
    assert s["max_over_fair"] == 2 / 1.5 and s["per_replica"] == {"r0": 2, "r1": 1}
    assert s["ttft_p99_s"] == 0.07


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["bench", "fleet", "--rate", "0"]) == 2
    assert "--rate must be positive" in capsys.readouterr().err
    assert main(["bench", "fleet", "--policy", "nope"]) == 2
    assert "--policy" in capsys.readouterr().err


@needs_nats
@needs_haproxy
def test_a_small_run_prints_its_table(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main(["bench", "fleet", "--replicas", "2", "--sessions", "4", "--rate", "8", "--repeats", "1",
                 "--max-tokens", "4", "--logs", str(tmp_path / "logs"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 instances, no sync" in text and "3 vs 1 instance: cached share" in text
    result = json.loads(out.read_text())
    for label in ("1 instance", "3 instances", "3 instances, no sync"):
        m = result["medians"][label]
        assert m["errors"] == 0 and m["requests"] >= 8  # every session's turns, every one served
        assert m["index_identical_runs"] == 1  # the instances' event-built indexes agree
