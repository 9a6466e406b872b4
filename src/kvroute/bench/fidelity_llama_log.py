"""Where a live fidelity request's time went inside llama-server, from the engine's own log
(issue 21): llama-server exports no stage histograms (bench/fidelity_engines.py has vLLM's), but
it logs every task: ``launch_slot_`` when a slot takes it, ``print_timing`` with its prompt eval
(prompt processing to the first token) and eval (first token to the end) times, and ``release``
with the slot's tokens — each line stamped ``minutes.seconds.ms.µs`` since the engine started
(common/log.cpp).

A live request (bench/fidelity.py's ``per_request``: prompt and cached tokens, replica
``engine-i``) is matched to the task of engine i's log with the same new prompt tokens and a
release count of its prompt plus output (± 2); where several tasks fit (a repeat's policies share
the conversations' shapes), the one launched when the run sent it, by the offset between the
client's and the log's clocks that the run's unique matches give; the rest are left out. Per policy and kind
(warm: over half the prompt cached; cold), medians of the client's TTFT, the engine's launch to
first token, their difference (``outside``: the client, the gateway, HTTP and tokenizing, and the
wait for a free slot), and the decode phase on both sides. Used on issue 21's runs: the client's
decode phase equalled the engine's, and a warm turn's time inside the engine was longer than the
simulator's whole warm TTFT.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass

LINE = re.compile(r"(\d+)\.(\d+)\.(\d+)\.(\d+) I slot\s+(\S+?): id\s+\d+ \| task (-?\d+) \| (.*)")
TIMES = re.compile(r"=\s+([\d.]+) ms /\s+(\d+) tokens")


@dataclass(frozen=True)
class Task:
    """One llama-server task: seconds since the engine started, and token counts."""

    launch: float
    first: float  # first token (release less the eval time)
    release: float
    new_tokens: int  # prompt tokens evaluated (the uncached part)
    slot_tokens: int  # tokens in the slot at release (prompt plus output)


def parse(text: str) -> list[Task]:
    """The tasks of a llama-server log that ran to release with both timings."""
    launch: dict[str, float] = {}
    prompt: dict[str, int] = {}
    evals: dict[str, float] = {}
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        mins, secs, ms, us, fn, task, msg = m.groups()
        t = int(mins) * 60 + int(secs) + int(ms) / 1e3 + int(us) / 1e6
        if fn.startswith("launch"):
            launch[task] = t
        elif fn == "print_timing" and "eval time" in msg and (x := TIMES.search(msg)):
            if "prompt eval" in msg:
                prompt[task] = int(x.group(2))
            else:
                evals[task] = float(x.group(1)) / 1e3
        elif fn == "release" and task in launch and task in prompt and task in evals:
            n = re.search(r"n_tokens = (\d+)", msg)
            if n:
                out.append(Task(launch.pop(task), t - evals.pop(task), t, prompt.pop(task), int(n.group(1))))
    return out


def summarize(stored: dict, logs: list[str]) -> dict:
    """Per policy and kind (``"lmetric warm"``): matched and unmatched counts and the medians in
    the module docstring, from a fidelity JSON's live side and the engines' logs (in URL order)."""
    out_tokens = int(stored["workload"]["max_tokens"])
    by_key: list[dict[tuple[int, int], list[Task]]] = []
    for text in logs:
        index: dict[tuple[int, int], list[Task]] = defaultdict(list)
        for task in parse(text):
            index[(task.new_tokens, task.slot_tokens)].append(task)
        by_key.append(index)
    rows: dict[str, list[tuple[float, float, float, float]]] = defaultdict(list)
    missed: dict[str, int] = defaultdict(int)
    for policy, row in stored["policies"].items():
        for rep in row["repeats"]:
            # (request, its candidate tasks) per engine; a repeat's policies share the
            # conversations' shapes, so a count pair may recur: the launch time decides
            cands: list[tuple[list, list[Task]]] = []
            offsets: dict[int, list[float]] = defaultdict(list)
            for req in rep["live"]["per_request"]:
                sent, _, _, prompt, cached, _, _, replica = req
                i = int(str(replica).rsplit("-", 1)[-1])
                index = by_key[i] if i < len(by_key) else {}
                hits = [t for d in (-2, -1, 0, 1, 2)
                        for t in index.get((prompt - cached, prompt + out_tokens - 1 + d), [])]
                cands.append((req, hits))
                if len(hits) == 1:
                    offsets[i].append(hits[0].launch - sent)
            for req, hits in cands:
                sent, ttft, e2e, prompt, cached, _, _, replica = req
                kind = f"{policy} {'warm' if cached > prompt / 2 else 'cold'}"
                i = int(str(replica).rsplit("-", 1)[-1])
                if len(hits) > 1 and offsets[i]:  # the one launched when this run sent it (±0.5 s)
                    at = sent + statistics.median(offsets[i])
                    hits = [t for t in hits if abs(t.launch - at) < 0.5]
                if len(hits) != 1:
                    missed[kind] += 1
                    continue
                task = hits[0]
                rows[kind].append((ttft, task.first - task.launch, e2e - ttft, task.release - task.first))
    report = {}
    for kind in sorted(set(rows) | set(missed)):
        got = rows.get(kind, [])
        cols = [[r[j] for r in got] for j in range(4)] + [[r[0] - r[1] for r in got]]
        med = [round(statistics.median(c), 4) if c else None for c in cols]
        report[kind] = {"matched": len(got), "unmatched": missed.get(kind, 0), "client_ttft_s": med[0],
                        "engine_launch_to_first_s": med[1], "outside_s": med[4], "client_decode_s": med[2],
                        "engine_decode_s": med[3]}
    return report


def describe(report: dict) -> list[str]:
    """One line per policy and kind."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"
    return [f"{k}: {v['matched']} matched ({v['unmatched']} not): client TTFT {ms(v['client_ttft_s'])} ms = "
            f"engine launch to first token {ms(v['engine_launch_to_first_s'])} + outside {ms(v['outside_s'])} "
            f"(medians); decode client {ms(v['client_decode_s'])} / engine {ms(v['engine_decode_s'])} ms"
            for k, v in report.items()]
