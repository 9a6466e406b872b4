"""Where a live fidelity request's time went inside llama-server, from its log
(bench/fidelity_llama_log.py): parsing the log's task lines and matching them to the requests."""

import pytest

from kvroute.bench.fidelity_llama_log import describe, parse, summarize


def _task(task: int, slot: int, launch_s: float, prompt_ms: float, new: int, eval_ms: float, n_tokens: int) -> str:
    """A task's lines as llama-server 0.3.36 logs them (minutes.seconds.ms.µs since start)."""
    def stamp(t: float) -> str:
        us = round(t * 1e6)
        return f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"
    end = launch_s + (prompt_ms + eval_ms) / 1000
    return "\n".join([
        f"{stamp(launch_s)} I slot get_availabl: id  {slot} | task -1 | selected slot by LCP similarity",
        f"{stamp(launch_s)} I slot launch_slot_: id  {slot} | task {task} | processing task, is_child = 0",
        f"{stamp(end)} I slot print_timing: id  {slot} | task {task} | prompt eval time =     {prompt_ms:.2f} ms /  "
        f"{new} tokens (    0.79 ms per token,  1263.92 tokens per second)",
        f"{stamp(end)} I slot print_timing: id  {slot} | task {task} |        eval time =     {eval_ms:.2f} ms /    16 "
        "tokens (   12.14 ms per token,    82.36 tokens per second)",
        f"{stamp(end)} I slot      release: id  {slot} | task {task} | stop processing: n_tokens = {n_tokens}, "
        "truncated = 0"])


def test_parse_reads_each_tasks_launch_first_token_and_counts():
    log = "\n".join([_task(7, 0, 64.1, 100.0, 138, 182.0, 2124), "0.00.001.000 I srv  noise: not a task line",
                     _task(8, 1, 64.2, 50.0, 20, 80.0, 999)])
    a, b = parse(log)
    assert a.launch == pytest.approx(64.1) and a.first == pytest.approx(64.2) and a.release == pytest.approx(64.382)
    assert (a.new_tokens, a.slot_tokens) == (138, 2124) and (b.new_tokens, b.slot_tokens) == (20, 999)


def test_summary_matches_requests_and_splits_their_ttft():
    # two policies whose repeat shares the conversations' shapes: the same counts recur (tasks 1
    # and 3, 2 and 4), and the launch time (the client's clock plus the offset each run's unique
    # match gives: tasks 6 and 5) tells them apart
    log = "\n".join([_task(1, 0, 10.0, 100.0, 1700, 100.0, 1815), _task(6, 2, 10.2, 10.0, 30, 150.0, 460),
                     _task(2, 1, 10.5, 40.0, 100, 150.0, 1915), _task(3, 0, 30.0, 300.0, 1700, 100.0, 1815),
                     _task(4, 1, 30.7, 60.0, 100, 150.0, 1915), _task(5, 2, 31.0, 20.0, 50, 150.0, 530)])
    # sent, TTFT, E2E, prompt, cached, user, turn, replica
    a = [[0.0, 0.12, 0.22, 1800, 100, 0, 0, "engine-0"], [0.5, 0.07, 0.22, 1900, 1800, 0, 1, "engine-0"],
         [0.2, 0.03, 0.18, 445, 415, 1, 0, "engine-0"]]
    b = [[0.0, 0.33, 0.43, 1800, 100, 0, 0, "engine-0"], [0.7, 0.07, 0.22, 1900, 1800, 0, 1, "engine-0"],
         [1.0, 0.05, 0.2, 515, 465, 1, 0, "engine-0"]]
    stored = {"workload": {"max_tokens": 16}, "policies": {"a": {"repeats": [{"live": {"per_request": a}}]},
                                                          "b": {"repeats": [{"live": {"per_request": b}}]}}}
    report = summarize(stored, [log])
    assert [report[k]["matched"] for k in ("a cold", "a warm", "b cold", "b warm")] == [1, 2, 1, 2]
    assert report["a cold"]["engine_launch_to_first_s"] == pytest.approx(0.1)  # task 1, not task 3
    assert report["a cold"]["outside_s"] == pytest.approx(0.02)  # 120 ms at the client, 100 in the engine
    assert report["b cold"]["engine_launch_to_first_s"] == pytest.approx(0.3)  # task 3, not task 1
    assert report["a warm"]["engine_launch_to_first_s"] == pytest.approx(0.025)  # tasks 2 and 6
    assert report["b warm"]["engine_launch_to_first_s"] == pytest.approx(0.04)  # tasks 4 and 5
    assert report["a warm"]["engine_decode_s"] == pytest.approx(0.15)
    assert report["a warm"]["client_decode_s"] == pytest.approx(0.15)
    assert any(line.startswith("a cold: 1 matched (0 not)") for line in describe(report))
    # a request no task fits is counted, not guessed
    a.append([2.0, 0.1, 0.2, 3000, 0, 2, 0, "engine-0"])
    assert summarize(stored, [log])["a cold"]["unmatched"] == 1
