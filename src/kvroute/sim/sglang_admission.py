"""SGLang-style admission: reserve a decaying share of every running request's future output.

vLLM v1 admits a waiting request whenever its uncached prompt fits and preempts later, when a
decode step finds no memory (``sim/engine.py``). SGLang's scheduler instead budgets the tokens
its running requests may still generate (sgl-project/sglang ``python/sglang/srt/managers/``):

* ``schedule_policy.py``, ``PrefillAdder``: each running request holds
  ``min(max_new_tokens − generated, CLIP) × new_token_ratio`` tokens of the free pool
  (``_get_running_request_total_token_offset``); a new request is admitted only if its uncached
  prompt plus ``min(max_new_tokens, CLIP)`` (the whole estimate, not a share) fits what is left
  (``add_one_req``: ``total_tokens = extend_input_len + max_new``; NO_TOKEN otherwise, and the
  scheduler stops admitting for this round, FCFS).
* ``scheduler.py``: ``new_token_ratio`` starts at ``init_new_token_ratio`` (0.7 × the default
  ``schedule_conservativeness`` 1.0), falls by ``new_token_ratio_decay`` = (init − min) / 600
  after every decode step that did not run out of memory, never below ``min_new_token_ratio``
  = init × 0.14, returns to init when the scheduler finds nothing to run, and after a decode
  out-of-memory retraction becomes min(1, (Σ generated + 20 × n) / (Σ max_new_tokens + 1)) over
  the requests left in the batch (``ScheduleBatch.retract_decode``).
* Constants (``environ.py``; ``global_config.py`` in older releases): SGLANG_INIT_NEW_TOKEN_RATIO
  0.7, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600,
  SGLANG_RETRACT_DECODE_STEPS 20, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION 4096.
* ``max_new_tokens``: the client's ``max_tokens`` when it sends one, else
  ``max_req_len − prompt − 1`` (``scheduler.py``, ``init_req_max_new_tokens``; ``max_req_len``
  is at most the KV pool's tokens). kvroute's synthetic clients send one (chat 2048, tree node
  1024: workload/synthetic.py; SkyWalker's released client sends 512 a chat turn and 256 a tree
  node, sky/lbbench/workloads, which its reproduce scenarios set with ``workload.conversation``).

Because the reservation makes admission stop before memory runs out, requests wait in the
engine's queue earlier — the "pending" signal SkyWalker's selective pushing probes (§3.3).
Kept out of the engine: :func:`install` sets the engine's ``admission`` hook (sim/batch.py) when
the profile says ``admission: sglang``. A retraction is seen at the next admission check (the
engine's preemption counter moved), which is when SGLang next reads the ratio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.sim.queue_gauge import SGLangQueueGauge

if TYPE_CHECKING:  # the engine imports this module; no import back at run time
    from kvroute.sim.batch import Batch
    from kvroute.sim.seq import Seq

INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO × schedule_conservativeness (1.0)
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION


class SGLangReserve:
    """One engine's ``new_token_ratio`` and the admission test built on it."""

    __slots__ = ("init", "floor", "decay", "ratio", "max_req_len", "_steps", "_preemptions")

    def __init__(self, kv_tokens: int):
        self.init = INIT_NEW_TOKEN_RATIO
        self.floor = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay = (self.init - self.floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.ratio = self.init
        self.max_req_len = kv_tokens - 1  # SGLang: min(context_len, pool tokens) − 1
        self._steps = 0  # the engine's decode clock when the ratio was last brought up to date
        self._preemptions = 0  # the engine's preemption count at the last look

    def max_new(self, seq: Seq) -> int:
        """The request's ``max_new_tokens``: its client's cap, at most the pool less its original prompt."""
        top = max(0, self.max_req_len - (seq.prompt - seq.generated) - 1)
        return min(seq.max_new, top) if seq.max_new > 0 else top

    def _catch_up(self, engine: Batch) -> None:
        """Apply the decay of the decode steps run since the last look (one per step)."""
        steps = engine.steps - self._steps
        if steps > 0:
            self.ratio = max(self.floor, self.ratio - self.decay * steps)
        self._steps = engine.steps

    @staticmethod
    def made(engine: Batch, seq: Seq) -> int:
        """Tokens a decoding sequence has generated in all (asked at a step boundary, as admission is)."""
        return seq.generated + seq.a + engine.steps - seq.prompt + 1

    def held(self, engine: Batch) -> float:
        """Tokens the running requests hold for their future output: Σ min(left, CLIP) × ratio."""
        total = 0
        for seq in engine.prefilling:
            total += max(0, min(self.max_new(seq) - seq.generated, CLIP_MAX_NEW_TOKENS))
        for seq in engine.decoding.values():
            total += max(0, min(self.max_new(seq) - self.made(engine, seq), CLIP_MAX_NEW_TOKENS))
        return total * self.ratio

    def __call__(self, engine: Batch, seq: Seq, need: int) -> bool:
        """Whether ``seq`` (``need`` uncached prompt tokens) passes SGLang's token budget now."""
        if engine.preemptions != self._preemptions:
            self._preemptions = engine.preemptions
            self.retracted(engine)
        self._catch_up(engine)
        if not engine.prefilling and not engine.decoding:
            self.ratio = self.init  # an idle scheduler resets the estimate
            held = 0.0
        else:
            held = self.held(engine)
        room = engine.free_tokens() - held
        left = max(0, self.max_new(seq) - seq.generated)  # a retracted request's remaining budget
        return need + min(left, CLIP_MAX_NEW_TOKENS) < room

    def retracted(self, engine: Batch) -> None:
        """After a decode out-of-memory preemption: re-estimate the ratio from the batch left."""
        self._catch_up(engine)
        left = list(engine.decoding.values())
        made = sum(self.made(engine, s) for s in left)
        budget = sum(self.max_new(s) for s in left)
        self.ratio = min(1.0, (made + RETRACT_DECODE_STEPS * len(left)) / (budget + 1))


def install(engine: Batch) -> None:
    """Give ``engine`` SGLang's admission when its profile asks for it (``admission: sglang``),
    and SGLang's waiting-queue gauge for probes to read (``waiting_gauge: sglang``;
    sim/queue_gauge.py)."""
    if engine.p.admission == "sglang":
        engine.admission = SGLangReserve(engine.p.kv_tokens)
    if engine.p.waiting_gauge == "sglang":
        engine.gauge = SGLangQueueGauge(engine)
