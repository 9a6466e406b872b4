"""Issue 26 item 7, measured: does `lmetric` keep a conversation on its engine once the prefix
index is exact (built from vLLM's KV events with the engine's tokenizer), compared with the
tokenizer-less approximate index and with round robin?

Two real vLLM CPU engines (tests/vllm/engine.py), 12 users in 3 groups sharing a system prompt,
10 turns each (108 follow-up turns), 4 users at a time, 16 tokens per answer. For every
configuration the engines' caches are reset first (``POST /reset_prefix_cache``) and a fresh
gateway is started. Printed per configuration: follow-up turns served by the engine of the
previous turn, the gateway's predicted cached share, the cached share vLLM reports, and the
requests whose predicted hit differed from vLLM's.

    .venv/bin/python -m tests.vllm.stickiness [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvroute.ports import free_ports
from tests.vllm import engine as vllm

USERS, GROUPS, TURNS, CONCURRENCY, MAX_TOKENS, BLOCKS = 12, 3, 10, 4, 16, 64


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
                    for _ in range(n))


def run_config(engines, policy: str, events: bool, seed: int) -> dict:
    from tests.test_vllm import Gateway, cached_by_vllm

    for e in engines:
        e.post("/reset_prefix_cache", {})
    time.sleep(0.5)
    gw = Gateway(engines, vllm.MODEL_DIR, policy=policy) if events else None
    if gw is None:  # the approximate index without a tokenizer, as a user without one runs it
        gw = _approximate_gateway(engines, policy)
    try:
        if events:
            gw.wait(lambda: all(gw.rt.kv_source(n)["source"] == "events" for n in gw.names), what="events")
        rng = random.Random(seed)
        systems = [f"Group {g} instructions: {_words(rng, 60)}" for g in range(GROUPS)]
        questions = [[_words(rng, 8) + "?" for _ in range(TURNS)] for _ in range(USERS)]
        client = gw.client()
        lock = threading.Lock()
        rows: list[tuple[int, int, str, int, int, int]] = []  # user, turn, engine, predicted, cached, prompt

        def user(u: int) -> None:
            history = [{"role": "system", "content": systems[u % GROUPS]}]
            for t in range(TURNS):
                history.append({"role": "user", "content": questions[u][t]})
                raw = client.chat.completions.with_raw_response.create(model="tiny", messages=history,
                                                                       max_tokens=MAX_TOKENS, temperature=0)
                resp = raw.parse()
                with lock:
                    rows.append((u, t, raw.headers["x-kvroute-replica"], int(raw.headers["x-kvroute-prefix-hit"]),
                                 resp.usage.prompt_tokens_details.cached_tokens, resp.usage.prompt_tokens))
                history.append({"role": "assistant", "content": resp.choices[0].message.content or ""})

        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(user, range(USERS)))
    finally:
        gw.close()
    by = {(u, t): (eng, p, c, n) for u, t, eng, p, c, n in rows}
    stays = sum(1 for (u, t), (eng, *_) in by.items() if t > 0 and by[(u, t - 1)][0] == eng)
    prompt = sum(r[5] for r in rows)
    wrong = sum(1 for *_, p, c, n in rows if cached_by_vllm(p, n) != c)
    return {"policy": policy, "index": "events" if events else "approximate (no tokenizer)",
            "follow_up_turns": USERS * (TURNS - 1), "stayed": stays,
            "predicted_share": round(sum(r[3] for r in rows) / prompt, 3),
            "vllm_cached_share": round(sum(r[4] for r in rows) / prompt, 3),
            "wrong_predictions": wrong, "requests": len(rows)}


def _approximate_gateway(engines, policy: str):
    """The same in-process gateway without events and without a tokenizer."""
    from tests.test_vllm import Gateway

    return Gateway(engines, None, policy=policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvroute-stick-"))
    model = vllm.write_model(vllm.MODEL_DIR)
    ports = free_ports(6)
    engines = [vllm.VLLMEngine(model, ports[3 * i], ports[3 * i + 1], ports[3 * i + 2], core=i, blocks=BLOCKS,
                               workdir=root / f"e{i}") for i in range(2)]
    results = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        for policy, events in (("lmetric", True), ("lmetric", False), ("round_robin", True)):
            r = run_config(engines, policy, events, args.seed)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
