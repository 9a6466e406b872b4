"""A request inside a simulated engine (``Seq``), its life-cycle states, and the shape of an
analytic decode jump. Split out of sim/engine.py (issue 22) so that the engine's modules —
kvcache.py, batch.py, handover.py, engine.py — and the code that drives them share one
definition."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3

Jump = tuple[float, int, float, float, int]  # (start, K, alpha, beta, D) of an analytic decode jump


def steps_done(jump: Jump, elapsed: float) -> int:
    """Decode steps of ``jump`` completed ``elapsed`` seconds after it started (step k of a jump
    takes alpha + beta·k, so K steps take K·alpha + beta·K(K−1)/2)."""
    _, K, alpha, beta, _ = jump
    if beta <= 0:
        k = int(elapsed / alpha) if alpha > 0 else K
    else:  # largest k with k·α + β·k(k−1)/2 ≤ elapsed
        b = alpha - beta / 2
        k = int((-b + math.sqrt(b * b + 2 * beta * elapsed)) / beta)
    if k < 0:  # min(max(k, 0), K) without the builtin calls
        k = 0
    return K if K < k else k


class Seq:
    """One request inside an engine."""

    __slots__ = ("rid", "payload", "prompt", "output", "hashes", "bt", "state", "cached",
                 "prefill_left", "private", "refs", "a", "finish_at", "order", "first_token_done",
                 "generated", "moving", "remote", "max_new")

    def __init__(self, rid: str, prompt: int, output: int, hashes: tuple[int, ...], bt: int,
                 payload: Any = None, max_new: int = 0):
        self.rid = rid
        self.max_new = max_new  # the client's max_tokens (0: none sent); SGLang's admission reads it
        self.payload = payload
        self.prompt = prompt
        self.output = output if output > 1 else 1
        self.hashes = hashes
        self.bt = bt
        self.state = WAITING
        self.cached = -1  # prompt tokens served from the prefix cache (first admission)
        self.prefill_left = 0
        self.private = 0  # tokens of KV this sequence holds outside shared cache blocks
        self.refs = 0  # leading blocks of ``hashes`` it references in the cache
        self.a = 0  # context length = a + engine.steps while decoding
        self.finish_at = 0
        self.order = 0
        self.first_token_done = False
        self.generated = 0  # tokens generated before a preemption (or a migration)
        self.moving = False  # past its engine's context limit, or chosen to migrate
        # prefill/decode disaggregation: the prompt's KV comes from a prefill engine; called at
        # admission with the tokens to move (the prompt less this engine's cached prefix), it
        # returns the transfer's seconds (sim/disagg.py, emulator/pd.py)
        self.remote: Callable[[int], float] | None = None
