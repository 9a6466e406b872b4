"""A short, readable walk-through of every preset on sample requests (part of `make demo`).

Four replicas; two users each hold a three-turn conversation over a shared system prompt, and
a burst of unrelated one-shot prompts arrives between turns. For each preset it reports where
each request went, which branch decided, and the resulting prefix reuse and load spread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.model import Endpoint, Request
from kvroute.policy import PRESETS, Router, build_policy
from kvroute.prefix import BlockHasher, chat_key

SYSTEM = "You are a meticulous assistant for an infrastructure team. Answer precisely. " * 12


def sample_requests() -> list[Request]:
    hasher = BlockHasher()
    reqs: list[Request] = []
    convs = {"alice": [{"role": "system", "content": SYSTEM}],
             "bob": [{"role": "system", "content": SYSTEM}]}
    for turn in range(3):
        for user, msgs in convs.items():
            msgs.append({"role": "user", "content": f"{user} question {turn}: " + "details " * 150})
            hashes, tokens = hasher(chat_key(msgs))
            reqs.append(Request(id=f"{user}-t{turn}", routing_key=user, block_hashes=hashes,
                                prompt_tokens=tokens, tenant=user))
            msgs.append({"role": "assistant", "content": f"answer {turn} for {user} " * 60})
        for k in range(3):
            text = f"one-shot prompt {turn}-{k} " + "unrelated words " * (60 + 20 * k)
            hashes, tokens = hasher(chat_key([{"role": "user", "content": text}]))
            reqs.append(Request(id=f"burst-{turn}-{k}", block_hashes=hashes, prompt_tokens=tokens))
    return reqs


@dataclass
class WalkResult:
    preset: str
    routes: list[tuple[str, str, str]]  # (request id, target, branch)
    hit_tokens: int
    prompt_tokens: int
    spread: list[int]


def walk(preset: str, reqs: list[Request]) -> WalkResult:
    eps = [Endpoint(f"r{i}", waiting=0) for i in range(4)]
    router = Router(build_policy(preset), eps)
    routes, hit, total = [], 0, 0
    served = {e.id: 0 for e in eps}
    for i, req in enumerate(reqs):
        cached = router.prefix.match(req.block_hashes)  # what each replica holds before routing
        d = router.route(req)
        routes.append((req.id, d.target or "-", d.branch))
        if d.dispatched:
            hit += req.prompt_tokens - req.new_prefill_tokens(cached.get(d.target, 0))
            total += req.prompt_tokens
            served[d.target] += 1
        if i % 3 == 2:  # requests finish now and then, so load moves
            for r in reqs[i - 2: i]:
                router.on_finish(r.id)
    for r in reqs:
        router.on_finish(r.id)
    assert all(e.inflight == 0 for e in eps)
    return WalkResult(preset, routes, hit, total, list(served.values()))


def run() -> list[WalkResult]:
    reqs = sample_requests()
    return [walk(name, reqs) for name in PRESETS]
