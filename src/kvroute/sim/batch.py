"""The running batch of a simulated engine: the waiting queue, admission, and a sequence's moves
between states (split out of sim/engine.py, issue 22).

* Admission is FCFS from the waiting queue while a slot (``max_running``) and memory for the
  uncached part of the prompt exist (vLLM v1's scheduler; head-of-line blocking: the queue waits
  for memory behind its first sequence).
* vLLM v1 (``store_at`` "scheduled", issue 21q) takes that memory chunk by chunk: admission only
  checks that the whole uncached prompt would fit now, and each scheduled chunk then allocates its
  own tokens; a chunk that finds no memory (after eviction) preempts the newest running sequence,
  itself last (:meth:`Batch._grow`, :meth:`Batch._schedule_running`). Its prefix hit is whole
  blocks below the prompt's last token, so a block-aligned prompt recomputes its last block
  (:func:`vllm_hit_blocks`). The other engines reserve the uncached prompt at admission, and
  their hit is every matched token but the last.
* When a prompt's blocks become prefix cache (sim/kvcache.py), by ``store_at`` (:func:`store_at`):
  vLLM v1 as each chunk is scheduled, SGLang as each chunk is computed, llama-server (whose running
  prompts no other request can reuse) when the prompt is done. vLLM v1 admits a waiting sequence
  only while the step's token budget has room after the running sequences' chunks.
* A finished prompt's sequence joins the decode batch;
  decode growth that finds no memory evicts cache, then preempts the newest sequence (recompute:
  it re-prefills prompt + generated tokens later).

Extension point: ``admission`` (None by default, one test per admission) may hold a sequence back
even when memory allows, e.g. SGLang's scheduler, which also reserves KV for the running
sequences' future output; it is asked ``admission(engine, seq, need)`` with the KV tokens the
sequence would take now and returns whether it may be admitted (False: it stays at the head of
the queue, as when memory is short). ``gauge`` (None by default: probes read the live queue)
holds the waiting count as an SGLang engine exports it (sim/queue_gauge.py). ``slot_cache``
(None unless the profile measured llama-server's slot copies) hears of every finish and cancel.

The step loop (sim/engine.py) implements ``_plan`` and ``_interrupt``.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import deque
from collections.abc import Callable

from kvroute.perf.profile import HardwareProfile
from kvroute.sim.deferred_gauge import DeferredGauge
from kvroute.sim.events import Scheduler
from kvroute.sim.kvcache import KVCache
from kvroute.sim.queue_gauge import SGLangQueueGauge
from kvroute.sim.seq import DECODE, DONE, PREFILL, WAITING, Jump, Seq
from kvroute.sim.slot_cache import SlotCache
from kvroute.sim.step_gauge import VLLMStatsGauge

Admission = Callable[["Batch", Seq, int], bool]  # (engine, seq, KV tokens it takes) → may admit

SCHEDULED, COMPUTED, PREFILL_END = "scheduled", "computed", "prefill_end"


def vllm_hit_blocks(matched: int, prompt: int, bt: int) -> int:
    """The cached blocks vLLM v1 reuses of ``matched`` matching leading blocks of a ``prompt``-token
    request (``bt`` tokens a block): whole blocks of at most ``prompt − 1`` tokens. vLLM 0.32
    (.venv-vllm) ``vllm/v1/core/kv_cache_manager.py`` ``get_computed_blocks`` looks up with
    ``max_cache_hit_length = request.num_tokens - 1`` (line 295) so that the last token is
    computed for its logits, and ``single_type_kv_cache_manager.py`` ``find_longest_cache_hit``
    takes at most ``max_length // block_size`` blocks (line 784): a prompt of whole blocks, all
    cached, recomputes its whole last block, not just its last token."""
    top = (prompt - 1) // bt
    return matched if matched < top else top


def store_at(profile: HardwareProfile) -> str:
    """When a prompt's full blocks become hittable prefix cache on this profile's engine.

    * ``"scheduled"`` (vLLM v1, ``admission: vllm``): as each chunk is scheduled. vLLM 0.32
      (.venv-vllm) ``vllm/v1/core/kv_cache_manager.py`` ``allocate_slots`` ends with
      ``cache_blocks(request, min(total_computed_tokens + num_new_tokens, request.num_tokens))``
      (line 616), and ``block_pool.py`` ``cache_blocks`` caches ``num_tokens // block_size`` full
      blocks; ``v1/core/sched/scheduler.py`` ``schedule`` allocates the RUNNING requests' chunks
      first (line 657) and only then looks the WAITING ones up (``_get_local_prefix_cache_hit``,
      line 967), each of them only ``while token_budget > 0`` (line 912). So a request that waited
      behind a shared prefix being chunked hits every block scheduled so far.
    * ``"computed"`` (SGLang, ``admission: sglang``): after each chunk's forward pass.
      sgl-project/sglang ``python/sglang/srt/managers/scheduler.py`` ``get_next_batch_to_run``
      calls ``tree_cache.cache_unfinished_req(self.chunked_req)`` before it forms the next batch,
      whose waiting requests then match the radix tree (``get_new_batch_prefill``).
    * ``"prefill_end"`` (llama-server, ``prefix_reuse: idle_slots``): a prefix is reused only from
      an idle slot's copy (sim/kvcache.py), so a running prompt's blocks are never hittable and the
      moment they are stored does not matter; they are stored when the prompt is done.
    """
    if profile.prefix_reuse == "idle_slots":
        return PREFILL_END
    return COMPUTED if profile.admission == "sglang" else SCHEDULED


class Batch(KVCache):
    """Waiting queue, prefilling and decoding sequences, and their transitions (see the module
    docstring); subclassed by the step loop (``Engine``)."""

    def __init__(self, profile: HardwareProfile, loop: Scheduler,
                 on_first_token: Callable[[Seq, float], None], on_finish: Callable[[Seq, float], None]):
        super().__init__(profile)
        self.loop = loop
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.admission: Admission | None = None
        # what a probe reads as waiting (None: the live queue)
        self.gauge: SGLangQueueGauge | DeferredGauge | VLLMStatsGauge | None = None
        self.slot_cache: SlotCache | None = None  # llama-server's slot copies (sim/slot_cache.py)
        self.store_at = store_at(profile)  # when prompt blocks become cache (see store_at)
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.decoding: dict[int, Seq] = {}  # admission order → seq (newest last)
        self.finishes: list[tuple[int, int, Seq]] = []
        self.steps = 0  # decode clock: every decoding sequence gains one token per step
        self.ctx_a = 0  # Σ a_i over decoding sequences
        self.ctx_a2 = 0  # Σ a_i²
        self._order = 0
        self.changes = 0  # bumped whenever the waiting or running sets may have changed (probes skip the rest)
        self._busy = False  # a step or decode jump is in progress
        self._jump: Jump | None = None  # while decoding analytically
        self._preempted = False
        self.loading = 0  # admitted sequences whose KV is still arriving from a prefill engine
        # counters
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0

    # -- the step loop's part (sim/engine.py) --------------------------------------------------
    def _plan(self) -> None:
        """At a step boundary: admit, then schedule the next step or decode jump."""
        raise NotImplementedError  # Engine implements it

    def _interrupt(self, jump: Jump) -> None:
        """Cut a decode jump in progress at its next step boundary."""
        raise NotImplementedError  # Engine implements it

    def _wake(self) -> None:
        """Something changed: an idle engine plans a step at once, a decode jump in progress is
        cut at the next step boundary (a step of prefill runs to its end)."""
        if not self._busy:
            self._plan()
        elif self._jump is not None:
            self._interrupt(self._jump)

    # -- indicators (what a probe reads) -------------------------------------------------------
    @property
    def running(self) -> int:
        """Sequences in the running batch (prefilling or decoding)."""
        return len(self.prefilling) + len(self.decoding)

    @property
    def queued(self) -> int:
        """Sequences waiting for admission, or for their KV from a prefill engine (vLLM lists
        those as waiting too)."""
        return len(self.waiting) + self.loading

    # -- arrivals --------------------------------------------------------------------------------
    def fits(self, prompt: int, output: int) -> bool:
        """Whether a request of this prompt + output could ever fit the KV cache (else an engine refuses it)."""
        return prompt + output <= self.capacity

    def cancel(self, seq: Seq) -> None:
        """Drop a sequence (its client went away), wherever it is, and free what it holds."""
        self.changes += 1
        if seq.state == WAITING:
            with contextlib.suppress(ValueError):  # already admitted meanwhile
                self.waiting.remove(seq)
        elif seq.state == PREFILL:
            self.prefilling = [s for s in self.prefilling if s is not seq]
            self.used -= seq.private
            self._unref(seq)
        elif seq.state == DECODE:
            self._release(seq)
        if self.slot_cache is not None:
            self.slot_cache.release(seq)
        seq.state = DONE

    def submit(self, seq: Seq) -> None:
        """Queue a sequence (FCFS); an idle engine plans a step at once, a decode jump in progress is cut at
        the next step boundary."""
        self.changes += 1
        self.waiting.append(seq)
        self._wake()

    # -- admission -------------------------------------------------------------------------------
    def _schedule_running(self) -> int | None:
        """At every step boundary, before admission. vLLM v1 (``store_at`` "scheduled"): the
        chunks the running prefills get in the coming step (FCFS, as ``Engine._plan`` will give
        them) allocate their memory (:meth:`_grow`, preempting when it is short) and have their
        full blocks cached now, and the token budget left for the waiting queue is returned;
        None (no budget bound on admission) for the other engines. A sequence that had to
        preempt itself ends the running chunks of this step, as in vLLM 0.32 (.venv-vllm)
        ``v1/core/sched/scheduler.py`` ``schedule`` (``if preempted_req == request: break``,
        line 842, then ``if new_blocks is None: break``)."""
        if self.store_at != SCHEDULED:
            return None
        budget = self.p.max_batched_tokens - len(self.decoding)
        # no copy needed: _preempt rebinds self.prefilling to a new list and never changes this one
        for seq in self.prefilling:
            if budget <= 0:
                break
            left = seq.prefill_left
            if seq.state != PREFILL or left <= 0:
                continue  # preempted by an earlier chunk of this schedule, or cancelled
            c = left if left < budget else budget
            end = seq.prompt - left + c
            bt = seq.bt
            refs = seq.refs
            extra = end - refs * bt - seq.private
            if extra > 0:  # the chunk needs memory: _grow, inlined (a preemption of another
                # sequence leaves this one's refs and private, so ``extra`` stays the same)
                while extra > self.capacity - self.used and not self._make_room(extra):
                    victim = self._newest_running()
                    self._preempt(victim)
                    if victim is seq:
                        return budget
                seq.private += extra
                self.used += extra
            if end // bt > refs and len(seq.hashes) > refs:  # new full blocks (_store_blocks' test)
                self._store_blocks(seq, end)
            else:
                self.cache_bt = bt  # all _store_blocks would do
            budget -= c
        return budget

    def _grow(self, seq: Seq, end: int) -> bool:
        """vLLM v1: give prefilling ``seq`` memory for its prompt's first ``end`` tokens (a
        scheduled chunk's end), evicting LRU cache blocks if need be; False, taking nothing, when
        even full eviction would not do. vLLM 0.32 (.venv-vllm) ``v1/core/kv_cache_manager.py``
        ``allocate_slots`` allocates slots for ``total_computed_tokens + num_new_tokens`` (line
        541) and returns None when the free blocks (evictable cache included) are too few (line
        577). A prefilling sequence holds ``refs`` whole cache blocks (its hit and its chunks'
        stored blocks) plus ``private`` tokens, so it has memory for ``refs·bt + private``
        prompt tokens (its hit is whole blocks: :func:`vllm_hit_blocks`)."""
        extra = end - seq.refs * seq.bt - seq.private
        if extra <= 0:
            return True
        if extra > self.capacity - self.used and not self._make_room(extra):
            return False
        seq.private += extra
        self.used += extra
        return True

    def _newest_running(self) -> Seq:
        """The running sequence admitted last (prefilling or decoding): vLLM v1 preempts
        ``self.running.pop()`` (scheduler.py line 834), the newest in its running list."""
        newest = max(self.prefilling, key=lambda s: s.order) if self.prefilling else None
        if self.decoding:
            d = self.decoding[next(reversed(self.decoding))]
            if newest is None or d.order > newest.order:
                newest = d
        assert newest is not None
        return newest

    def _admit(self, budget: int | None = None) -> None:
        """FCFS admission from the waiting queue (module docstring). ``budget``: the step's
        prefill tokens left (vLLM v1, ``_schedule_running``): admission stops when it is spent,
        and each admitted sequence's first chunk has its full blocks cached at once, so the next
        one in the queue can hit them; None: no token bound."""
        cap = self.p.max_running
        waiting, prefilling, decoding = self.waiting, self.prefilling, self.decoding
        admission = self.admission
        while waiting and len(prefilling) + len(decoding) + self.loading < cap:
            if budget is not None and budget <= 0:
                return  # vLLM: ``while token_budget > 0`` (scheduler.py)
            seq = waiting[0]
            hashes = seq.hashes
            m = self._match(hashes)
            chunked = budget is not None and seq.remote is None  # vLLM: memory chunk by chunk (_grow)
            if budget is not None:  # vLLM: whole blocks below the prompt's last token (vllm_hit_blocks, inlined)
                top = (seq.prompt - 1) // seq.bt
                if m > top:
                    m = top
            slots = self.slot_cache
            if slots is not None and slots.limits:  # llama-server: only what its slot holds (sim/slot_cache.py)
                r = slots.reusable(seq)
                if r is not None and r < m:
                    m = r
            matched = m * seq.bt
            if matched > seq.prompt:
                matched = seq.prompt
            need = seq.prompt - matched
            if admission is not None and not admission(self, seq, need):
                return  # held back by the admission policy: head-of-line, like memory
            if chunked:  # vLLM checks that the whole uncached prompt fits, then takes its first
                if not self._room(need, hashes[:m]):  # chunk (scheduler.py line 1270,
                    return  # ``full_sequence_must_fit``; kv_cache_manager.py line 522)
            elif need > self.capacity - self.used and not self._make_room(need, hashes[:m]):
                return  # head-of-line: wait for memory
            waiting.popleft()
            if slots is not None:  # it takes its slot now; the copies' time goes to its first step
                slots.pending[seq.rid] = slots.launch(seq)
            self._take(hashes, m)
            seq.refs = m
            cached = matched if matched < seq.prompt else seq.prompt - 1  # the last prompt token is always computed
            if seq.cached < 0:
                seq.cached = cached
                self.prompt_tokens += seq.prompt
                self.hit_tokens += cached
            if chunked:
                seq.private = 0  # its chunks take memory as they are scheduled (_grow)
            else:
                seq.private = need
                self.used += need
            seq.prefill_left = seq.prompt - cached
            seq.state = PREFILL
            self._order += 1
            seq.order = self._order
            if seq.remote is not None:  # disaggregated: memory is held, the KV arrives, then the
                self._load(seq, need)  # last prompt token is computed here (the first token)
                continue
            prefilling.append(seq)
            if budget is not None:  # its first chunk is scheduled in this step (vLLM)
                left = seq.prefill_left
                c = left if left < budget else budget
                end = seq.prompt - left + c
                if end > m * seq.bt:  # its chunk needs memory beyond its hit (_grow's test, inlined)
                    grown = self._grow(seq, end)  # fits: the whole uncached prompt did (_room)
                    assert grown
                self._store_blocks(seq, end)
                budget -= c

    def _load(self, seq: Seq, tokens: int) -> None:
        """Admitted with its KV on the way from a prefill engine: it joins the batch when the
        transfer of ``tokens`` ends, with one prompt token left to compute."""
        assert seq.remote is not None
        delay = seq.remote(tokens)
        seq.remote = None
        seq.prefill_left = 1
        self.loading += 1
        self.loop.at(self.loop.now + delay, self._loaded, seq)

    def _loaded(self, seq: Seq) -> None:
        self.loading -= 1
        self.changes += 1
        if seq.state != PREFILL:
            return  # cancelled while its KV was arriving (cancel freed its memory)
        self.prefilling.append(seq)
        self._wake()

    # -- transitions -----------------------------------------------------------------------------
    def _prefill_done(self, seq: Seq, now: float) -> None:
        bt = seq.bt  # its prompt's full blocks become cache (_store_prompt), unless already stored
        if seq.prompt // bt > seq.refs and len(seq.hashes) > seq.refs:  # (vLLM: as chunks were scheduled)
            self._store_prompt(seq)
        else:
            self.cache_bt = bt  # all _store_blocks would do
        seq.state = DECODE
        # KV now holds the prompt; each decode step adds the previous token's KV, so the
        # context is a + steps and a sequence's tokens beyond its prompt are generated − 1
        seq.a = seq.prompt - self.steps
        self.ctx_a += seq.a
        self.ctx_a2 += seq.a * seq.a
        self.decoding[seq.order] = seq
        if not seq.first_token_done:
            seq.first_token_done = True
            self.on_first_token(seq, now)
        self._schedule_finish(seq, now)

    def _schedule_finish(self, seq: Seq, now: float) -> None:
        """A sequence that just joined the decode batch: finished if its output is complete, else
        due at the step where its last token comes."""
        remaining = seq.output - seq.generated - 1
        if remaining <= 0:
            self._finish(seq, now)
        else:
            seq.finish_at = self.steps + remaining
            heapq.heappush(self.finishes, (seq.finish_at, seq.order, seq))

    def _decode_room(self, n_dec: int) -> bool:
        """Memory for one more decode step; evict cache, else preempt the newest sequence: the
        newest running one on vLLM v1 (:meth:`_newest_running`; a prefilling sequence holds
        memory there too), the newest decoding one elsewhere."""
        if self._make_room(n_dec):
            return True
        if self.store_at == SCHEDULED:
            self._preempt(self._newest_running())
        else:
            self._preempt(self.decoding[next(reversed(self.decoding))])
        return False

    def _release(self, seq: Seq) -> None:
        del self.decoding[seq.order]
        self.ctx_a -= seq.a
        self.ctx_a2 -= seq.a * seq.a
        self.used -= seq.private + (seq.a + self.steps - seq.prompt)
        self._unref(seq)

    def _finish(self, seq: Seq, now: float) -> None:
        self._release(seq)
        if self.slot_cache is not None:
            self.slot_cache.release(seq)
        seq.state = DONE
        self.on_finish(seq, now)

    def _preempt(self, seq: Seq) -> None:
        """Free a running sequence's memory and put it back at the head of the queue (recompute).
        A prefilling one (vLLM v1 only, where chunks hold memory) starts its prompt over, as in
        vLLM 0.32 ``scheduler.py`` ``_preempt_request`` (``num_computed_tokens = 0``, line 1593;
        ``waiting.prepend_request``, line 1613)."""
        if seq.state == PREFILL:
            self.prefilling = [s for s in self.prefilling if s is not seq]
            self.used -= seq.private
            self._unref(seq)
            self._preempted = True
            self.preemptions += 1
            seq.state = WAITING
            self.waiting.appendleft(seq)
            return
        generated = seq.a + self.steps - seq.prompt + 1  # tokens produced in this admission
        self._release(seq)
        self._preempted = True
        self.preemptions += 1
        seq.generated += generated
        seq.prompt += generated  # recompute: prompt and generated tokens prefill again
        seq.state = WAITING
        self.waiting.appendleft(seq)
