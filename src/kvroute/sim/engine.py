"""A simulated engine replica, behaving like vLLM v1 / SGLang.

* Continuous batching with at most ``max_running`` sequences and a per-step token budget
  (``max_batched_tokens``) shared by decodes (one token each) and chunked prefill (FCFS).
* A paged KV cache of ``kv_blocks × block_size`` tokens. Prompt blocks become a prefix cache once
  computed (keyed by the request's chained block hashes); blocks no running sequence references
  stay cached and are evicted LRU, tail blocks before head blocks.
* Admission is FCFS from the waiting queue while a slot and memory for the uncached part of the
  prompt exist; decode growth that finds no memory evicts cache, then preempts the newest
  sequence (recompute: it re-prefills prompt + generated tokens later).
* Between batch-composition changes, decoding is advanced analytically: with D decoding
  sequences the k-th step takes α + β·k (context sums grow by D per step), so K steps take
  K·α + β·K(K−1)/2 and the engine jumps straight to the next finish or memory limit. A new
  arrival interrupts a jump at the next step boundary.

Memory is counted in tokens (blocks × block size), not rounded per sequence: a simplification
worth at most block_size − 1 tokens per running sequence.

Migration (CascadeInfer's length stages, Llumnix-like rebalancing; driven by ``sim/migration.py``)
adds three things, all idle unless used: a context ``limit`` (a decode jump stops at the step
where a sequence passes it, and ``on_limit`` hears of it), ``depart`` (a decoding sequence leaves
at the next step boundary, releasing its KV) and ``adopt`` (a migrated sequence joins the decode
batch at the next step boundary with its KV already present, no prefill).

Engines that share a machine's cores (``Host``, a deployment property) slow each other down: a
step's time scales by ``max(1, stepping engines / cores)``, re-timed whenever an engine on the
host starts or stops stepping. Engines without a host run as if each had its own machine.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from kvroute.perf.profile import HardwareProfile
from kvroute.prefix.index import cached_prefix
from kvroute.sim.events import Scheduler

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3

Jump = tuple[float, int, float, float, int]  # (start, K, alpha, beta, D) of an analytic decode jump


class Seq:
    """One request inside an engine."""

    __slots__ = ("rid", "payload", "prompt", "output", "hashes", "bt", "state", "cached",
                 "prefill_left", "private", "refs", "a", "finish_at", "order", "first_token_done",
                 "generated", "moving", "remote")

    def __init__(self, rid: str, prompt: int, output: int, hashes: tuple[int, ...], bt: int,
                 payload: Any = None):
        self.rid = rid
        self.payload = payload
        self.prompt = prompt
        self.output = max(1, output)
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


class Host:
    """CPU cores shared by the engines of one machine.

    Measured on a 2-core machine with three llama-servers (``-t 1 -tb 1``, one thread each): a
    ~1,080-token prefill took 0.111 s alone, 0.098-0.118 s with two engines prefilling at once,
    and 0.106-0.184 s (mean 0.158 s, 1.42x) with all three; ~1,910 tokens: 0.243 s alone,
    0.265-0.409 s (mean 1.39x) with three. Processor sharing predicts max(1, 3/2) = 1.5x. So
    while ``n`` engines step at once, each step takes ``max(1, n / cores)`` times its profile
    time. What a step does not count: the gateway's and the clients' own CPU (3-5 % and 2-4 % of
    a core in the same measurement)."""

    __slots__ = ("cores", "engines", "stepping")

    def __init__(self, cores: int):
        if cores < 1:
            raise ValueError(f"a host needs at least one core, got {cores}")
        self.cores = cores
        self.engines: list[Engine] = []
        self.stepping = 0  # engines with a step in progress

    @property
    def slowdown(self) -> float:
        """How much slower a step runs now than on a machine of its own."""
        return self.stepping / self.cores if self.stepping > self.cores else 1.0

    def stepping_changed(self, engine: Engine, busy: bool) -> None:
        """``engine`` starts (``busy``) or stops stepping: re-time the others' steps in progress."""
        before = self.slowdown
        self.stepping += 1 if busy else -1
        if self.slowdown != before:
            for other in self.engines:
                if other is not engine and other._busy:
                    other._rescale()


class Engine:
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
        self.id = eid
        self.host = host
        if host is not None:
            host.engines.append(self)
        self._slow = 1.0  # the host's slowdown the step in progress was timed with
        self._step_end = 0.0  # when the single step in progress (not a decode jump) ends
        self.on_step = on_step
        self.max_jump_steps = max_jump_steps
        self.p = profile
        self.loop = loop
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.capacity = profile.kv_tokens
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.decoding: dict[int, Seq] = {}  # admission order → seq (newest last)
        self.finishes: list[tuple[int, int, Seq]] = []
        self.steps = 0  # decode clock: every decoding sequence gains one token per step
        self.ctx_a = 0  # Σ a_i over decoding sequences
        self.ctx_a2 = 0  # Σ a_i²
        self.used = 0  # KV tokens in use (private + cache blocks)
        self.refcnt: dict[int, int] = {}
        # llama-server (profile.prefix_reuse "idle_slots"): copies of each cached block that no
        # running sequence holds — in idle slots (left by finished sequences) and in the host
        # prompt cache; a new sequence reuses a prefix only by taking such a copy, so a prefix
        # that only running sequences hold must be computed again (profile.py)
        self.idle_copies: dict[int, int] | None = {} if profile.prefix_reuse == "idle_slots" else None
        self.host_copies: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cache blocks, LRU first
        self.cache_bt = 0  # tokens per cache block (the requests' block size)
        self._order = 0
        self.changes = 0  # bumped whenever the waiting or running sets may have changed (probes skip the rest)
        self._busy = False
        self._preempted = False
        self._version = 0
        # the step or jump in progress
        self._chunks: list[tuple[Seq, int]] = []
        self._jump: Jump | None = None  # while decoding analytically
        # counters
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.preemptions = 0
        self.busy_s = 0.0
        # migration (sim/migration.py); None / empty when unused, so they cost one test per step
        self.limit: int | None = None  # largest context this engine's stage serves
        self.on_limit: Callable[[Engine, list[Seq]], None] | None = None
        self.leaving: list[tuple[Seq, Callable[[Seq, int], None]]] = []
        self.incoming: list[tuple[Seq, int]] = []
        self.reserved = 0  # KV tokens held for migrations on their way in
        self.loading = 0  # admitted sequences whose KV is still arriving from a prefill engine
        # the emulator's KV events (emulator/kv_events.py); None in the simulator: one test each
        self.on_blocks_stored: Callable[[Seq, list[int]], None] | None = None  # seq, indexes of new blocks
        self.on_blocks_removed: Callable[[list[int]], None] | None = None  # evicted block hashes

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

    def kv_usage(self, now: float) -> float:
        """Share of KV capacity held by requests, as vLLM v1 reports it: cached blocks that no
        request references are free (evictable), not used."""
        used = self.used - len(self.evictable) * self.cache_bt
        jump = self._jump
        if jump is not None:
            used += jump[4] * self._steps_done(jump, now - jump[0])
        return min(1.0, used / self.capacity)

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
        seq.state = DONE

    def submit(self, seq: Seq) -> None:
        """Queue a sequence (FCFS); an idle engine plans a step at once, a decode jump in progress is cut at
        the next step boundary."""
        self.changes += 1
        self.waiting.append(seq)
        if not self._busy:
            self._plan()
        elif self._jump is not None:
            self._interrupt(self._jump)

    # -- the scheduler ---------------------------------------------------------------------------
    def _admit(self) -> None:
        cap = self.p.max_running
        waiting, prefilling, decoding = self.waiting, self.prefilling, self.decoding
        refcnt, evictable = self.refcnt, self.evictable
        while waiting and len(prefilling) + len(decoding) + self.loading < cap:
            seq = waiting[0]
            hashes = seq.hashes
            m = cached_prefix(hashes, refcnt)  # the cache is prefix-closed: blocks leave tail first
            copies = self.idle_copies
            if copies is not None:  # only a copy no running sequence holds can be taken
                k, host = 0, self.host_copies
                while k < m and (copies.get(hashes[k], 0) > 0 or host.get(hashes[k], 0) > 0):
                    k += 1
                m = k
            matched = min(m * seq.bt, seq.prompt)
            need = seq.prompt - matched
            if need > self.capacity - self.used and not self._make_room(need, hashes[:m]):
                return  # head-of-line: wait for memory
            waiting.popleft()
            if copies is not None:  # take a slot's copy (its old content goes to the host
                host = self.host_copies  # cache: one more copy) or else a host copy (moved)
                for h in hashes[:m]:
                    if copies.get(h, 0) > 0:
                        copies[h] -= 1
                        host[h] = host.get(h, 0) + 1
                    else:
                        host[h] -= 1
            for h in hashes[:m]:
                c = refcnt[h]
                if c == 0:
                    del evictable[h]
                refcnt[h] = c + 1
            seq.refs = m
            cached = min(matched, seq.prompt - 1)  # the last prompt token is always computed
            if seq.cached < 0:
                seq.cached = cached
                self.prompt_tokens += seq.prompt
                self.hit_tokens += cached
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
        if not self._busy:
            self._plan()
        elif self._jump is not None:
            self._interrupt(self._jump)

    def _make_room(self, need: int, protect: tuple[int, ...] = ()) -> bool:
        free = self.capacity - self.used
        if need <= free:
            return True
        evictable = self.evictable
        reclaimable = len(evictable) * self.cache_bt
        guarded = [h for h in protect if h in evictable] if protect else ()
        if need > free + reclaimable - len(guarded) * self.cache_bt:
            return False
        for h in guarded:  # about to be referenced: keep them out of the eviction order
            del evictable[h]
        bt = self.cache_bt
        short = need - free
        if short > 0:  # evict exactly the blocks that cover the shortfall, LRU first
            k = -(-short // bt)
            refcnt, pop = self.refcnt, evictable.popitem
            copies = self.idle_copies
            evicted: list[int] | None = [] if self.on_blocks_removed is not None else None
            for _ in range(k):
                h = pop(False)[0]
                del refcnt[h]
                if copies is not None:
                    copies.pop(h, None)
                    self.host_copies.pop(h, None)
                if evicted is not None:
                    evicted.append(h)
            self.used -= k * bt
            if evicted and self.on_blocks_removed is not None:
                self.on_blocks_removed(evicted)
        for h in guarded:
            evictable[h] = None
        return True

    def _plan(self) -> None:
        """At a step boundary: admit, then schedule the next step or decode jump."""
        decoding = self.decoding
        if self.incoming:
            self._adopt_incoming()
        # vLLM v1 admits nothing in a step that had to preempt (unless the engine went idle)
        if self.waiting and (not self._preempted or not (self.prefilling or decoding)):
            self._admit()
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
        if prefilling:
            budget = p.max_batched_tokens - n_dec
            chunks, tokens, attn = [], 0, 0.0
            n_all, len_sum, len_sq = n_dec, ctx_sum, ctx_sq
            for seq in prefilling:
                if budget <= 0:
                    break
                left = seq.prefill_left
                c = left if left < budget else budget
                chunks.append((seq, c))
                tokens += c
                attn += c * (seq.prompt - left + c / 2)
                budget -= c
                end = seq.prompt - left + c  # the chunk attends over this many keys
                n_all += 1
                len_sum += end
                len_sq += end * end
            self._chunks = chunks
            self._jump = None
            # one varlen attention pass over decodes and chunks (heterogeneity: perf/profile.py)
            dt = p.step_time(tokens, n_dec, ctx_sum, attn, p.heterogeneity(n_all, len_sum, len_sq))
            if host is not None:  # cores shared with other engines (Host)
                self._slow = host.slowdown
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
        if host is not None:  # cores shared with other engines (Host)
            self._slow = slow = host.slowdown
            alpha *= slow
            beta *= slow
        if self._chunks:
            self._chunks = []
        now = loop.now
        self._jump = (now, K, alpha, beta, n_dec)
        dt = K * alpha + beta * K * (K - 1) / 2
        self.busy_s += dt
        loop.at(now + dt, self._end_step, (self._version, K))

    def _decode_room(self, n_dec: int) -> bool:
        """Memory for one more decode step; evict cache, else preempt the newest sequence."""
        if self._make_room(n_dec):
            return True
        newest = self.decoding[next(reversed(self.decoding))]
        self._preempt(newest)
        return False

    @staticmethod
    def _steps_done(jump: Jump, elapsed: float) -> int:
        _, K, alpha, beta, _ = jump
        if beta <= 0:
            k = int(elapsed / alpha) if alpha > 0 else K
        else:  # largest k with k·α + β·k(k−1)/2 ≤ elapsed
            b = alpha - beta / 2
            k = int((-b + math.sqrt(b * b + 2 * beta * elapsed)) / beta)
        return min(max(k, 0), K)

    def _rescale(self) -> None:
        """The host's slowdown changed mid-step: a decode jump stops at its next step boundary
        (the next plan is timed with the new slowdown); a single step's remaining time stretches
        or shrinks by the ratio of the slowdowns."""
        assert self.host is not None
        slow = self.host.slowdown
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
        self.loop.at(self._step_end, self._end_step, (self._version, 1))

    def _interrupt(self, jump: Jump) -> None:
        start, K, alpha, beta, n_dec = jump
        k = self._steps_done(jump, self.loop.now - start) + 1
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
        self._plan()

    # -- migration ------------------------------------------------------------------------------
    def context(self, seq: Seq) -> int:
        """A decoding sequence's KV tokens now (mid-jump included); 0 when it does not decode here."""
        if seq.state != DECODE or self.decoding.get(seq.order) is not seq:
            return 0
        jump = self._jump
        done = self._steps_done(jump, self.loop.now - jump[0]) if jump is not None else 0
        return seq.a + self.steps + done

    def free_tokens(self) -> int:
        """KV tokens a migration could take now: free plus evictable cache."""
        return self.capacity - self.used + len(self.evictable) * self.cache_bt

    def reserve(self, tokens: int) -> None:
        """Hold ``tokens`` of KV for a migration on its way in (negative: release them)."""
        self.reserved += tokens
        self.used += tokens

    def depart(self, seq: Seq, then: Callable[[Seq, int], None]) -> None:
        """Let a decoding sequence leave at the next step boundary; ``then(seq, context)`` runs
        once its KV is released (not at all if it finished or was preempted first)."""
        self.leaving.append((seq, then))
        if not self._busy:
            self._depart_leaving()
        elif self._jump is not None:
            self._interrupt(self._jump)

    def _depart_leaving(self) -> None:
        leaving, self.leaving = self.leaving, []
        for seq, then in leaving:
            if seq.state != DECODE or self.decoding.get(seq.order) is not seq:
                continue
            self.changes += 1
            ctx = seq.a + self.steps
            produced = seq.generated + ctx - seq.prompt + 1  # tokens generated so far
            self._release(seq)
            seq.generated = produced - 1  # at the target the carried KV counts as its prompt
            seq.prompt = ctx
            seq.moving = False
            then(seq, ctx)

    def adopt(self, seq: Seq, ctx: int) -> None:
        """Take over a migrated sequence whose ``ctx`` tokens of KV arrived; it decodes from the
        next step boundary."""
        self.incoming.append((seq, ctx))
        self.changes += 1
        if not self._busy:
            self._plan()
        elif self._jump is not None:
            self._interrupt(self._jump)

    def _adopt_incoming(self) -> None:
        incoming, self.incoming = self.incoming, []
        now = self.loop.now
        for seq, ctx in incoming:
            self._order += 1
            seq.order = self._order
            seq.state = DECODE
            seq.refs = 0
            seq.private = ctx
            self.used += ctx
            seq.a = ctx - self.steps
            self.ctx_a += seq.a
            self.ctx_a2 += seq.a * seq.a
            self.decoding[seq.order] = seq
            remaining = seq.output - seq.generated - 1
            if remaining <= 0:
                self._finish(seq, now)
            else:
                seq.finish_at = self.steps + remaining
                heapq.heappush(self.finishes, (seq.finish_at, seq.order, seq))

    def _prefill_done(self, seq: Seq, now: float) -> None:
        bt = seq.bt
        self.cache_bt = bt
        full = min(len(seq.hashes), seq.prompt // bt)
        refcnt = self.refcnt
        evictable = self.evictable
        new = seq.hashes[seq.refs:full]
        shared = 0
        stored: list[int] | None = [] if self.on_blocks_stored is not None else None
        for i, h in enumerate(new):
            c = refcnt.get(h)
            if c is None:
                refcnt[h] = 1
                if stored is not None:
                    stored.append(seq.refs + i)
            else:  # computed meanwhile by another sequence: share it, free our copy
                if c == 0:
                    del evictable[h]
                refcnt[h] = c + 1
                shared += 1
        if shared:
            self.used -= bt * shared
        if stored and self.on_blocks_stored is not None:
            self.on_blocks_stored(seq, stored)
        seq.private -= bt * len(new)  # its prompt blocks are cache blocks now
        if full > seq.refs:
            seq.refs = full
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
        remaining = seq.output - seq.generated - 1
        if remaining <= 0:
            self._finish(seq, now)
        else:
            seq.finish_at = self.steps + remaining
            heapq.heappush(self.finishes, (seq.finish_at, seq.order, seq))

    def _release(self, seq: Seq) -> None:
        del self.decoding[seq.order]
        self.ctx_a -= seq.a
        self.ctx_a2 -= seq.a * seq.a
        self.used -= seq.private + (seq.a + self.steps - seq.prompt)
        self._unref(seq)

    def _unref(self, seq: Seq) -> None:
        refs = seq.refs
        if refs:
            refcnt, evictable = self.refcnt, self.evictable
            tail_first = seq.hashes[refs - 1::-1]  # tail first: the head stays cached longest
            copies = self.idle_copies
            if copies is not None:  # its slot keeps its copy, free for the next request
                for h in tail_first:
                    copies[h] = copies.get(h, 0) + 1
            for h in tail_first:
                c = refcnt[h] - 1
                refcnt[h] = c
                if c == 0:
                    evictable[h] = None
        seq.refs = 0
        seq.private = 0

    def _finish(self, seq: Seq, now: float) -> None:
        self._release(seq)
        seq.state = DONE
        self.on_finish(seq, now)

    def _preempt(self, seq: Seq) -> None:
        generated = seq.a + self.steps - seq.prompt + 1  # tokens produced in this admission
        self._release(seq)
        self._preempted = True
        self.preemptions += 1
        seq.generated += generated
        seq.prompt += generated  # recompute: prompt and generated tokens prefill again
        seq.state = WAITING
        self.waiting.appendleft(seq)
