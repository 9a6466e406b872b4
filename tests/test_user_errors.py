"""Mistakes a user can act on (issue 11): one line naming the input and what to do, exit code 2,
no traceback, checked before any work; traces that are odd but usable only warn."""

import json
import subprocess
import sys

import pytest

import kvroute.commands.simulate
from kvroute.cli import main
from kvroute.sim import tracefiles


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def mooncake_line(ts: float, inp: object = 64, block: int = 1) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": 8, "hash_ids": [block]}) + "\n"


def test_an_unknown_workload_lists_the_kinds(capsys):
    assert main(["simulate", "--workload", "foo"]) == 2
    line = one_error(capsys)
    assert "--workload 'foo'" in line and "chat, tot, mixed, chat-poisson, mooncake, azure, openai" in line


def test_a_scenario_given_as_workload_says_how_to_run_it(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_text("replicas: [{count: 1}]\n")
    assert main(["simulate", "--workload", str(f)]) == 2
    assert f"a YAML file is a scenario, not a trace; run it as `kvroute simulate {f}`" in one_error(capsys)


def test_a_directory_as_workload_says_so(tmp_path, capsys):
    assert main(["simulate", "--workload", str(tmp_path)]) == 2
    assert f"{tmp_path}: is a directory" in one_error(capsys)


@pytest.mark.parametrize("name", ["trace.jsonl", "trace.csv", "trace"])
def test_a_binary_file_as_workload_names_it(tmp_path, capsys, name):
    f = tmp_path / name
    f.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)) * 4)
    assert main(["simulate", "--workload", str(f), "--max-requests", "5"]) == 2
    assert f"{f}:1: not UTF-8 text" in one_error(capsys)


def test_a_bad_line_after_the_first_names_file_line_and_field(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text(mooncake_line(0) + mooncake_line(10) + mooncake_line(20, inp="many"))
    assert main(["simulate", "--workload", str(f), "--policy", "round_robin"]) == 2
    line = one_error(capsys)
    assert f"{f}:3: field 'input_length'" in line and "--skip-bad" in line


@pytest.mark.parametrize("flag, target, says", [
    ("--json", "blocker/out.json", "blocker is a file, not a directory; choose another path"),
    ("--json", ".", "it is a directory; choose another path"),
    ("--plots", "blocker", "it is a file, not a directory; choose another folder"),
    ("--plots", "blocker/plots", "blocker is a file, not a directory; choose another folder"),
])
def test_unwritable_outputs_fail_before_running(tmp_path, capsys, monkeypatch, flag, target, says):
    (tmp_path / "blocker").write_text("a file where a folder should be")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvroute.commands.simulate, "run_simulation",
                        lambda *a: pytest.fail("ran before checking outputs"))
    assert main(["simulate", "--max-requests", "10", flag, target]) == 2
    assert f"{flag} {target}: cannot write there: {says}" in one_error(capsys)


def test_writable_outputs_leave_no_scratch_file(tmp_path, monkeypatch):
    monkeypatch.setattr(kvroute.commands.simulate, "run_simulation", lambda *a: None)
    assert main(["simulate", "--max-requests", "10", "--json", str(tmp_path / "new" / "r.json"),
                 "--plots", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["new", "plots"]


def test_bench_sim_speed_without_traces_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tracefiles, "DATA_DIR", tmp_path)
    assert main(["bench", "sim-speed", "--skip-million"]) == 2
    line = one_error(capsys)
    assert str(tmp_path / "mooncake" / "conversation_trace.jsonl") in line
    assert "KVROUTE_TRACES" in line and "shared/data/traces" in line


def test_policies_into_a_closed_pipe_exits_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "kvroute", "policies", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and err == ""


def test_emulate_fail_rate_out_of_range(capsys):
    assert main(["emulate", "--fail-rate", "2"]) == 2
    assert "--fail-rate must be a number from 0 to 1, got 2.0" in one_error(capsys)


def test_clients_in_a_region_without_replicas(tmp_path, capsys):
    f = tmp_path / "s.yaml"
    f.write_text("replicas: [{region: us, count: 2}]\nworkload: {kind: chat, clients: {us: 4, EU: 4}}\n")
    assert main(["simulate", str(f)]) == 2
    line = one_error(capsys)
    assert "workload.clients.EU: no replicas" in line and "replica regions: us" in line


def warnings_of(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_unsorted_timestamps_warn_and_run(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text(mooncake_line(0) + mooncake_line(500) + mooncake_line(100, block=2) + mooncake_line(50, block=3)
                 + mooncake_line(900, block=4))
    assert main(["simulate", "--workload", str(f), "--policy", "round_robin"]) == 0
    line = next(w for w in warnings_of(capsys) if "not sorted" in w)
    assert f"{f}:3: timestamps are not sorted (2 of the 5 requests" in line and "100 ms after 500 ms" in line


def test_unsorted_azure_timestamps_warn(tmp_path, capsys):
    f = tmp_path / "a.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n"
                 "2023-11-16 18:15:46.0000000,100,10\n")
    assert main(["simulate", "--workload", str(f), "--policy", "round_robin"]) == 0
    assert any(f"{f}:3: timestamps are not sorted" in w for w in warnings_of(capsys))


def test_a_header_only_csv_warns_and_runs(tmp_path, capsys):
    f = tmp_path / "a.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert main(["simulate", "--workload", str(f), "--policy", "round_robin"]) == 0
    assert any(f"{f}: no requests in this trace (a header or blank lines only)" in w for w in warnings_of(capsys))


def test_a_missing_tokenizer_path_names_the_line(tmp_path, capsys):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("port: 0\ntokenizer_path: /nowhere/tokenizer.json\nreplicas: [{url: http://127.0.0.1:9}]\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    line = one_error(capsys)
    assert f"{cfg}:2: tokenizer_path: no such file or folder '/nowhere/tokenizer.json'" in line
    assert "never downloads" in line


@pytest.mark.parametrize("second, says", [
    ("{url: http://127.0.0.1:9}", "repeated: 127.0.0.1:9 (as in replicas[0]); the id defaults to host:port; "
                                  "if both are meant, give each an id:"),
    ("{url: http://127.0.0.1:10, id: a}", "repeated: a (as in replicas[0]); give each its own id:"),
])
def test_duplicate_replica_ids_name_the_line_and_suggest_id(tmp_path, capsys, second, says):
    cfg = tmp_path / "gw.yaml"
    first = "{url: http://127.0.0.1:9, id: a}" if "id: a" in second else "{url: http://127.0.0.1:9}"
    cfg.write_text(f"port: 0\nreplicas:\n  - {first}\n  - {second}\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    line = one_error(capsys)
    assert f"{cfg}:4: replicas.1: replica ids must be unique; {says}" in line and "(got" not in line


def _refused_by_argparse(argv, says, capsys):
    """argparse's one error line for the last flag and its value, exit 2, no traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(f"argument {argv[-2]}: '{argv[-1]}': {says}")


@pytest.mark.parametrize("argv", [
    ["bench", "auto", "--seeds", "0"],
    ["bench", "auto", "--requests", "-5"],
    ["bench", "plan", "--requests", "0"],
    ["bench", "gateway", "--repeats", "0"],  # was a StatisticsError traceback
    ["bench", "gateway", "--requests", "0"],  # was an empty table and exit 0
    ["bench", "gateway", "--concurrency", "0"],
    ["bench", "routing", "--decisions", "0"],
    ["bench", "sim-speed", "--repeats", "0"],
    ["bench", "kv-events", "--publishers", "0"],
    ["calibrate", "--url", "http://127.0.0.1:9", "--out", "p.yaml", "--repeats", "0"],
    ["demo", "--decisions", "0"],  # was the whole demo, its routing table empty
    ["demo", "--sim-requests", "-1"],  # was the walk-through and a benchmark before the error
    ["bench", "fidelity", "--url", "http://127.0.0.1:9", "--users", "0"],
])
def test_a_count_below_one_is_refused_before_any_work(argv, capsys):
    """Counts of runs, requests, seeds and repeats must be positive: argparse's error line, exit 2."""
    _refused_by_argparse(argv, "must be a positive integer", capsys)


@pytest.mark.parametrize("argv, says", [
    (["calibrate", "--url", "http://127.0.0.1:9", "--out", "p.yaml", "--noise-probes", "-1"],
     "must be 0 or a positive integer"),
    (["bench", "pd", "--threshold", "-5"], "must be 0 or a positive integer"),  # ran half the bench first
    (["bench", "gateway", "--upstream-delay-ms", "-5"], "must be a number of 0 or more"),  # ran with no delay
    (["bench", "gateway", "--gate", "nan"], "must be a finite number"),
    (["calibrate", "--url", "http://127.0.0.1:9", "--out", "p.yaml", "--timeout", "0"], "must be a number above 0"),
    (["demo", "--live-seconds", "-2"], "must be a number above 0"),
    (["plan", "skywalker-cost", "--requests", "10"], "must be an integer of 50 or more"),  # the file's floor; ran
])
def test_an_out_of_range_number_is_refused_before_any_work(argv, says, capsys):
    """Delays, tolerances, time limits and may-be-zero counts: argparse's error line naming the flag, exit 2."""
    _refused_by_argparse(argv, says, capsys)


def test_fidelity_turns_out_of_order_name_both_flags(capsys):
    """--min-turns above --max-turns is one line naming both, before any engine is touched."""
    assert main(["bench", "fidelity", "--url", "http://127.0.0.1:9", "--min-turns", "7", "--max-turns", "3"]) == 2
    assert "--min-turns 7 is above --max-turns 3" in capsys.readouterr().err
