"""A simulated engine replica, behaving like vLLM v1 / SGLang: the step loop.

* Continuous batching with at most ``max_running`` sequences and a per-step token budget
  (``max_batched_tokens``) shared by decodes (one token each) and chunked prefill (FCFS).
* A paged KV cache with a prefix cache, evicted LRU tail-first (sim/kvcache.py); FCFS admission,
  decode growth that evicts, then preempts the newest sequence (sim/batch.py). vLLM v1 caches a
  chunk's full blocks as it schedules the chunk, running chunks before the waiting queue, which
  it admits only while the step's token budget lasts; SGLang caches them after the chunk's step
  (sim/batch.py ``store_at``, issue 21p). vLLM v1 also allocates a prompt's memory chunk by
  chunk (preempting the newest running sequence when a chunk finds none) and reuses whole blocks
  below the prompt's last token (sim/batch.py, issue 21q).
* Between batch-composition changes, decoding is advanced analytically: with D decoding
  sequences the k-th step takes α + β·k (context sums grow by D per step), so K steps take
  K·α + β·K(K−1)/2 and the engine jumps straight to the next finish or memory limit. A new
  arrival interrupts a jump at the next step boundary.
* Migration (context limit, depart, adopt; sim/handover.py, driven by sim/migration.py).

Memory is counted in tokens (blocks × block size), not rounded per sequence: a simplification
worth at most block_size − 1 tokens per running sequence.

Engines that share a machine's cores (``Host``, sim/host.py) slow each other down: a step's time
scales by ``max(1, stepping engines / (cores - background))``, the background being the other
work on the machine, re-timed whenever an engine on the host starts or stops stepping; the first
step of an engine that starts stepping beside others also by the profile's measured
``newcomer_slowdown`` (sim/host.py ``newcomer_factor``). Engines without a host run as if each had
its own machine.

Modules (split by idea, issue 22): seq.py (a request, the states, the jump), kvcache.py (KV
accounting and prefix cache), batch.py (queue, admission, transitions), handover.py (migration),
host.py (shared cores), this file (step planning and the event loop's callbacks). Extension
points, None by default (one test each): ``admission`` (batch.py) may hold a sequence back;
``step_noise`` (here) returns a factor for each planned step or decode jump's time, given its
number of steps (sim/noise.py); ``gauge`` (batch.py) is the waiting count a probe reads
(sim/queue_gauge.py, sim/deferred_gauge.py, sim/step_gauge.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvroute.perf.profile import HardwareProfile
from kvroute.sim.batch import COMPUTED, SCHEDULED
from kvroute.sim.deferred_gauge import DeferredGauge
from kvroute.sim.events import Scheduler
from kvroute.sim.handover import Handover
from kvroute.sim.host import Host, newcomer_factor
from kvroute.sim.seq import DECODE, DONE, PREFILL, WAITING, Jump, Seq, steps_done
from kvroute.sim.sglang_admission import install as install_admission
from kvroute.sim.slot_cache import for_profile as slot_cache
from kvroute.sim.step_gauge import VLLMStatsGauge

__all__ = ["DECODE", "DONE", "PREFILL", "WAITING", "Engine", "Host", "Jump", "Seq"]


class Engine(Handover):
    """One simulated engine replica (see the module docstring): sequences are submitted, and it calls back at
    each first token and finish on the shared event loop."""

    def __init__(self, eid: str, profile: HardwareProfile, loop: Scheduler,
                 on_first_token: Callable[[Seq, float], None],
                 on_finish: Callable[[Seq, float], None],
                 on_step: Callable[[list[Seq]], None] | None = None,
                 max_jump_steps: int | None = None, host: Host | None = None):
        """``on_step`` (called with the sequences that decoded one token) and ``max_jump_steps=1``
        make the engine step token by token, which the real-time emulator needs to stream.
        ``host``: the machine whose cores this engine shares with other engines (None: its own)."""
        super().__init__(profile, loop, on_first_token, on_finish)
        self.id = eid
        self.host = host
        if host is not None:
            host.engines.append(self)
        self._slow = 1.0  # the host's slowdown the step in progress was timed with
        self._joined = 0  # engines of the host stepping when this one started to (its first step: sim/host.py)
        self._nf = 1.0  # the newcomer factor of the step in progress (host.newcomer_factor)
        self._step_end = 0.0  # when the single step in progress (not a decode jump) ends
        self.on_step = on_step
        self.max_jump_steps = max_jump_steps
        # migration (sim/handover.py): hears of sequences past ``limit`` after a step
        self.on_limit: Callable[[Engine, list[Seq]], None] | None = None
        # extension point: a factor applied to each planned step's (or decode jump's α and β) time
        self.step_noise: Callable[[int], float] | None = None
        self._version = 0
        self._chunks: list[tuple[Seq, int]] = []  # the prefill chunks of the step in progress
        self._copying = False  # llama-server's launch copies in progress (before a step, _copy)
        self.busy_s = 0.0
        install_admission(self)  # SGLang's token budget when the profile says so (sim/sglang_admission.py)
        if profile.waiting_gauge == "llama_server":  # requests_deferred (sim/deferred_gauge.py)
            self.gauge = DeferredGauge(self)
        # vLLM's num_requests_waiting: as the last finished step's schedule left it (sim/step_gauge.py)
        self._stats = VLLMStatsGauge(self) if profile.waiting_gauge == "vllm" else None
        if self._stats is not None:
            self.gauge = self._stats
        self.slot_cache = slot_cache(profile)  # llama-server's prompt-cache copies when measured (sim/slot_cache.py)

    _steps_done = staticmethod(steps_done)

    @property
    def stepping(self) -> bool:
        """Whether a step is in progress (the engine has work)."""
        return self._busy

    def kv_usage(self, now: float) -> float:
        """Share of KV capacity held by requests, as vLLM v1 reports it: cached blocks that no
        request references are free (evictable), not used."""
        used = self.used - len(self.evictable) * self.cache_bt
        jump = self._jump
        if jump is not None:
            used += jump[4] * steps_done(jump, now - jump[0])
        return min(1.0, used / self.capacity)

    # -- the step loop ---------------------------------------------------------------------------
    def _plan(self) -> None:
        """At a step boundary: admit, then schedule the next step or decode jump."""
        decoding = self.decoding
        if self.incoming:
            self._adopt_incoming()
        # vLLM: the running chunks take memory and are cached first, then a budget (sim/batch.py
        # _schedule_running; its trivial cases inlined: no budget off vLLM, the whole one when none runs)
        if self.store_at != SCHEDULED:
            admit_budget: int | None = None
        elif self.prefilling:
            admit_budget = self._schedule_running()
        else:
            admit_budget = self.p.max_batched_tokens - len(decoding)
        # vLLM v1 admits nothing in a step that had to preempt (unless the engine went idle)
        if self.waiting and (not self._preempted or not (self.prefilling or decoding)):
            self._admit(admit_budget)
        if self.gauge is not None:  # SGLang's num_queue_reqs moves only at some passes (sim/queue_gauge.py)
            self.gauge.passed()
        slots = self.slot_cache
        if slots is not None and slots.pending:  # llama-server: the launches' copies come before the step
            copy_s = sum(slots.pending.values())
            slots.pending.clear()
            if copy_s > 0:
                return self._copy(copy_s)
        n_dec = len(decoding)
        prefilling = self.prefilling
        host = self.host
        if not prefilling and not n_dec:
            if host is not None and self._busy:
                self._busy = False
                host.stepping_changed(self, False)
            self._busy = False
            self._jump = None
            return
        if host is not None and not self._busy:
            self._busy = True
            host.stepping_changed(self, True)
            self._joined = host.stepping - 1
        self._busy = True
        self._version += 1
        p = self.p
        T = self.steps
        ctx_sum = 0
        ctx_sq = 0
        if n_dec:
            if self.capacity - self.used < n_dec and not self._decode_room(n_dec):
                return self._plan()  # a preemption changed the batch
            ctx_a = self.ctx_a
            ctx_sum = ctx_a + n_dec * T
            ctx_sq = self.ctx_a2 + 2 * T * ctx_a + n_dec * T * T
        loop = self.loop
        noise = self.step_noise
        if prefilling:
            budget = p.max_batched_tokens - n_dec
            chunks, tokens, attn = [], 0, 0.0
            tile = p.prefill_attn_tile  # query rows padded to whole tiles (perf/profile.py)
            store = self.store_at == SCHEDULED  # vLLM caches a chunk's full blocks as it is scheduled
            n_all, len_sum, len_sq = n_dec, ctx_sum, ctx_sq
            for seq in prefilling:
                if budget <= 0:
                    break
                left = seq.prefill_left
                c = left if left < budget else budget
                if store and seq.refs * seq.bt + seq.private < seq.prompt - left + c:
                    break  # vLLM: no memory for this chunk; it preempted itself (sim/batch.py _schedule_running)
                chunks.append((seq, c))
                tokens += c
                attn += (c if tile == 1 else p.attn_rows(c)) * (seq.prompt - left + c / 2)
                budget -= c
                end = seq.prompt - left + c  # the chunk attends over this many keys
                if store:  # mostly stored already by _schedule_running / _admit: call only for new blocks
                    bt = seq.bt
                    if end // bt > seq.refs and len(seq.hashes) > seq.refs:
                        self._store_blocks(seq, end)
                    else:
                        self.cache_bt = bt  # all _store_blocks would do
                n_all += 1
                len_sum += end
                len_sq += end * end
            self._chunks = chunks
            self._jump = None
            # one varlen attention pass over decodes and chunks (heterogeneity: perf/profile.py)
            dt = p.step_time(tokens, n_dec, ctx_sum, attn, p.heterogeneity(n_all, len_sum, len_sq))
            if p.c_admit_s:  # a new sequence's first chunk stalls the step (perf/profile.py)
                dt += p.c_admit_s * sum(1 for seq, _ in chunks if seq.prompt - seq.prefill_left <= max(seq.cached, 0))
            if n_dec and p.c_prefill_mixed_s:  # prefill beside decodes, as measured (perf/profile.py)
                dt += p.c_prefill_mixed_s * tokens
            if noise is not None:
                dt *= noise(1)
            if host is not None:  # cores shared with other engines (Host); a newcomer's first step more so
                nf = newcomer_factor(p.newcomer_slowdown, self._joined, dt) if self._joined else 1.0
                self._joined, self._nf = 0, nf
                self._slow = host.slowdown_of(self) * nf
                dt *= self._slow
                self._step_end = loop.now + dt
            self.busy_s += dt
            loop.at(loop.now + dt, self._end_step, (self._version, 1))
            return
        # decode only: jump to the next finish or memory limit
        k_finish = self.finishes[0][0] - T
        k_mem = (self.capacity - self.used) // n_dec
        if k_mem < k_finish:
            k_mem += len(self.evictable) * self.cache_bt // n_dec
            if k_mem < 1:
                k_mem = 1
        K = k_finish if k_finish < k_mem else k_mem
        if self.limit is not None:  # stop at the step where a sequence passes the stage's limit
            top = max((q.a for q in decoding.values() if not q.moving), default=None)
            if top is not None and self.limit - (top + T) + 1 < K:
                K = self.limit - (top + T) + 1
        if K < 1:
            K = 1
        if self.max_jump_steps is not None and K > self.max_jump_steps:
            K = self.max_jump_steps
        # step k of the jump takes alpha + beta·k: every context grows by one token per step
        h = p.heterogeneity(n_dec, ctx_sum, ctx_sq)
        alpha = p.step_time(0, n_dec, ctx_sum, 0.0, h)
        beta = p.decode_growth(n_dec, h)
        if noise is not None:  # one factor for the K steps (sim/noise.py)
            f = noise(K)
            alpha *= f
            beta *= f
        if host is not None:  # cores shared with other engines (Host)
            self._joined, self._nf = 0, 1.0  # the newcomer transient: prefill steps only (sim/host.py)
            self._slow = slow = host.slowdown_of(self)
            alpha *= slow
            beta *= slow
        if self._chunks:
            self._chunks = []
        now = loop.now
        self._jump = (now, K, alpha, beta, n_dec)
        dt = K * alpha + beta * K * (K - 1) / 2
        self.busy_s += dt
        loop.at(now + dt, self._end_step, (self._version, K))

    def _copy(self, dt: float) -> None:
        """llama-server's loop copying slots to and from its host prompt cache for the tasks it just
        launched (sim/slot_cache.py), before it steps: tools/server/server-queue.cpp
        ``process_new_tasks`` launches every task in its queue, each launch saving the idle slots
        (server-context.cpp ``process_single_task``, ``cache_idle_slots``), and only then runs
        ``update_slots``, so a request that arrives during the copies is launched too and joins the
        step they precede (issue 21g: four warm turns launched 40 ms apart on one engine all began
        their prompt in one batch). The copies use the host's cores like a step."""
        host = self.host
        if host is not None and not self._busy:
            self._busy = True
            host.stepping_changed(self, True)
            self._joined = host.stepping - 1
        self._busy = True
        self._version += 1
        self._jump = None
        self._copying = True
        loop = self.loop
        if host is not None:
            self._nf = 1.0
            self._slow = host.slowdown_of(self)
            dt *= self._slow
            self._step_end = loop.now + dt
        self.busy_s += dt
        loop.at(loop.now + dt, self._end_copy, self._version)

    def _end_copy(self, version: int) -> None:
        if version != self._version:
            return  # re-timed by the host (_rescale)
        self._copying = False
        self._plan()

    def _rescale(self) -> None:
        """The host's slowdown changed mid-step: a decode jump stops at its next step boundary
        (the next plan is timed with the new slowdown); a single step's remaining time stretches
        or shrinks by the ratio of the slowdowns."""
        assert self.host is not None
        slow = self.host.slowdown_of(self) * self._nf
        if self._jump is not None:
            self._interrupt(self._jump)
            return
        now = self.loop.now
        left = self._step_end - now
        if left <= 0 or slow == self._slow:
            return
        new = left * slow / self._slow
        self._slow = slow
        self._step_end = now + new
        self.busy_s += new - left
        self._version += 1
        if self._copying:
            self.loop.at(self._step_end, self._end_copy, self._version)
        else:
            self.loop.at(self._step_end, self._end_step, (self._version, 1))

    def _interrupt(self, jump: Jump) -> None:
        start, K, alpha, beta, n_dec = jump
        k = steps_done(jump, self.loop.now - start) + 1
        if k >= K:
            return
        old = K * alpha + beta * K * (K - 1) / 2
        new = k * alpha + beta * k * (k - 1) / 2
        self.busy_s -= old - new
        self._version += 1
        self._jump = (start, k, alpha, beta, n_dec)
        self.loop.at(start + new, self._end_step, (self._version, k))

    def _end_step(self, token: tuple[int, int]) -> None:
        version, k = token
        if version != self._version:
            return  # superseded by an interrupt
        self.changes += 1
        now = self.loop.now
        n_dec = len(self.decoding)
        on_step = self.on_step
        advanced = list(self.decoding.values()) if on_step is not None and n_dec else None
        steps = self.steps
        if n_dec:
            self.steps = steps = steps + k
            self.used += n_dec * k
            if self.used > self.capacity:  # the jump grew into evictable cache blocks
                self._make_room(0)
        self._jump = None
        self._preempted = False
        chunks = self._chunks
        if chunks:
            for seq, c in chunks:
                if seq.state != PREFILL:
                    continue  # cancelled during the step
                left = seq.prefill_left - c
                seq.prefill_left = left
                if left == 0:
                    self._prefill_done(seq, now)
                elif self.store_at == COMPUTED:  # SGLang: cache_unfinished_req after the chunk (sim/batch.py)
                    self._store_blocks(seq, seq.prompt - left)
            self._chunks = []
        prefilling = self.prefilling
        if prefilling and prefilling[0].state != PREFILL:
            self.prefilling = [s for s in prefilling if s.state == PREFILL]
        finishes = self.finishes
        if finishes and finishes[0][0] <= steps:
            pop = heapq.heappop
            while finishes and finishes[0][0] <= steps:
                at, order, seq = pop(finishes)
                if seq.state == DECODE and seq.finish_at == at and self.decoding.get(order) is seq:
                    self._finish(seq, now)
        if advanced and on_step is not None:
            on_step(advanced)
        if self.leaving:
            self._depart_leaving()
        if self.limit is not None and self.on_limit is not None and self.decoding:
            limit = self.limit
            over = [q for q in self.decoding.values() if not q.moving and q.a + steps > limit]
            if over:
                for q in over:
                    q.moving = True
                self.on_limit(self, over)
        if self._stats is not None:  # the step's stats reach the engine's /metrics (sim/step_gauge.py)
            self._stats.stepped()
        self._plan()
