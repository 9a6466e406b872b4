"""llama-server's slots and host prompt cache, for the time their copies cost.

Read from the llama.cpp that llama-cpp-python 0.3.36 vendors (tools/server/server-context.cpp,
server-task.cpp, common/common.h), with the engine's defaults (``--cache-ram`` 8192 MiB,
``--cache-idle-slots`` on, ``--slot-prompt-similarity`` 0.10, ``-np`` given so ``kv_unified``
off). Launching a task, on the one loop every slot waits for:

* ``get_available_slot``: among idle slots, the one whose content shares the largest fraction of
  the new prompt (longest common prefix / prompt tokens), if above 0.10; the prompt cache is then
  updated only when that would keep under half of the slot's content (``f_keep < 0.5``). Else the
  least recently used idle slot, and the cache is always updated: ``prompt_save`` copies the
  slot's content to host memory (unless a cached prompt already holds all of it), then
  ``prompt_load`` copies back the cached prompt that keeps the larger fraction of both itself
  (``f_keep``, at least 0.25) and the new prompt (``f_sim``) than the slot's own, and drops it
  from the cache.
* After the launch (``cache_idle_slots``): every idle slot is saved (``prompt_save``), a no-op
  for content already cached.
* ``server_prompt_cache::alloc`` drops cached prompts that the saved one contains. Its size limit
  (8 GiB, ~2M tokens of the test tier's tiny model) is not modelled.

So a slot that finished a request since the last launch is copied out at the next one unless the
new request takes it (the next turn of its conversation does, by its common prefix). Each copy
costs ``slot_save_s_per_token × tokens`` (perf/profile.py; measured by `kvroute calibrate`),
spent on the engine's loop before its next step, during which newly arrived requests are
launched too and join that step (sim/engine.py ``_copy``). The KV cache's prefix reuse is
sim/kvcache.py's (``idle_slots``); with ``slot_choice: llama_server`` (the default) a new
sequence reuses at most what its slot holds after the load (``reusable``, called at admission,
where the slot is taken), else this module only times the copies.
"""

from __future__ import annotations

from kvroute.perf.profile import HardwareProfile
from kvroute.sim.seq import Seq

SIMILARITY = 0.10  # --slot-prompt-similarity default (common/common.h slot_prompt_similarity)
KEEP_SAVE = 0.5  # get_available_slot: save when a similar slot would keep less than this of its content
KEEP_LOAD = 0.25  # server_prompt_cache::load: "don't trash large prompts"


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Leading elements ``a`` and ``b`` share (binary search on slice equality: C-speed compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Content:
    """What a slot or a cached prompt holds: block hashes of its prompt, tokens in all (its
    prompt plus generated tokens, which have no hashes)."""

    __slots__ = ("hashes", "bt", "tokens")

    def __init__(self, hashes: tuple[int, ...], bt: int, tokens: int):
        self.hashes, self.bt, self.tokens = hashes, bt, tokens

    def lcp(self, seq: Seq) -> int:
        """Tokens of ``seq``'s prompt this content holds as a common prefix."""
        return min(common_prefix(self.hashes, seq.hashes) * seq.bt, self.tokens, seq.prompt)

    def contains(self, other: _Content) -> bool:
        return (self.tokens >= other.tokens and len(self.hashes) >= len(other.hashes)
                and self.hashes[:len(other.hashes)] == other.hashes)


class _Slot:
    __slots__ = ("content", "used", "saved")

    def __init__(self) -> None:
        self.content: _Content | None = None
        self.used = -1  # t_last_used: launch count (empty slots first for LRU)
        self.saved = True  # its content is in the host cache (or it has none)


class SlotCache:
    """The slots and host prompt cache of one llama-server (see the module docstring)."""

    def __init__(self, p: HardwareProfile):
        self.per_token = p.slot_save_s_per_token
        self.idle = [_Slot() for _ in range(p.max_running)]
        self.busy: dict[str, _Slot] = {}  # request id → its slot
        self.cached: list[_Content] = []
        self.launches = 0
        self.limits = p.slot_choice == "llama_server"  # reuse only what the taken slot holds
        self.pending: dict[str, float] = {}  # request id → seconds of its launch's copies, not yet stepped
        self.copied_tokens = 0  # counters for tests and reports
        self.copies = 0

    def _copy(self, tokens: int) -> float:
        self.copies += 1
        self.copied_tokens += tokens
        return self.per_token * tokens

    def _save(self, slot: _Slot) -> float:
        content = slot.content
        if slot.saved or content is None:
            return 0.0
        slot.saved = True
        if any(c.contains(content) for c in self.cached):
            return 0.0
        self.cached = [c for c in self.cached if not content.contains(c)]
        self.cached.append(_Content(content.hashes, content.bt, content.tokens))
        return self._copy(content.tokens)

    def _choose(self, seq: Seq) -> tuple[_Slot, bool, _Content | None]:
        """The idle slot ``get_available_slot`` gives ``seq``, whether it updates the prompt
        cache, and the cached prompt ``prompt_load`` would copy into the slot (None: the slot
        keeps its content). Changes nothing."""
        best, best_sim = None, SIMILARITY
        for slot in self.idle:
            if slot.content is not None:
                sim = slot.content.lcp(seq) / seq.prompt
                if sim > best_sim:
                    best, best_sim = slot, sim
        if best is not None:
            assert best.content is not None
            update = best_sim * seq.prompt / best.content.tokens < KEEP_SAVE
        else:
            best = min(self.idle, key=lambda s: s.used)
            update = True
        # prompt_save runs first, but what it adds or drops (the slot's own content, prompts it
        # contains) never holds more of the prompt than the slot does, so the load's pick is the same
        return best, update, (self._best_cached(best, seq) if update else None)

    def reusable(self, seq: Seq) -> int | None:
        """Leading prompt blocks of ``seq`` that the slot it would take now holds (after the
        load from the host cache): all llama-server can reuse for it (server-context.cpp
        launch_slot_with_task keeps only the slot's common prefix). None: no slot to take."""
        if seq.rid in self.busy or not self.idle:
            return None
        slot, _, load = self._choose(seq)
        content = load if load is not None else slot.content
        return 0 if content is None else common_prefix(content.hashes, seq.hashes)

    def launch(self, seq: Seq) -> float:
        """``seq`` takes a slot: the seconds of the copies this costs the engine's loop."""
        if seq.rid in self.busy or not self.idle:
            return 0.0  # a preempted sequence back, or more running than slots: no slot to take
        self.launches += 1
        best, update, load = self._choose(seq)
        cost = 0.0
        if update:
            cost += self._save(best)
            if load is not None:
                self.cached.remove(load)
                cost += self._copy(load.tokens)
        self.idle.remove(best)
        best.used = self.launches
        best.content, best.saved = None, False
        self.busy[seq.rid] = best
        for slot in self.idle:  # --cache-idle-slots
            cost += self._save(slot)
        return cost

    def _best_cached(self, slot: _Slot, seq: Seq) -> _Content | None:
        """``server_prompt_cache::load``'s pick for ``seq`` in ``slot``: the cached prompt that
        keeps a larger fraction of itself (at least 0.25) and of the prompt than the slot's own."""
        own = slot.content.lcp(seq) if slot.content is not None else 0
        keep = own / slot.content.tokens if slot.content is not None else -1.0
        sim = own / seq.prompt
        best = None
        for c in self.cached:
            n = c.lcp(seq)
            k, s = n / c.tokens, n / seq.prompt
            if k >= KEEP_LOAD and k > keep and s > sim:
                best, keep, sim = c, k, s
        return best

    def release(self, seq: Seq) -> None:
        """``seq`` finished: its slot goes idle holding its prompt and output, not yet cached."""
        self.pending.pop(seq.rid, None)
        slot = self.busy.pop(seq.rid, None)
        if slot is None:
            return
        slot.content = _Content(seq.hashes, seq.bt, seq.prompt + seq.output)
        slot.saved = False
        self.idle.append(slot)


def for_profile(p: HardwareProfile) -> SlotCache | None:
    """llama-server's slots for an engine of profile ``p``: when its slot choice limits reuse
    (``slot_choice``) or it measured a cost for the copies."""
    if p.prefix_reuse == "idle_slots" and (p.slot_choice == "llama_server" or p.slot_save_s_per_token > 0):
        return SlotCache(p)
    return None
