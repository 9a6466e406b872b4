"""vLLM v1's memory per chunk and its block-aligned prefix hit in the engine model (issue 21q,
sim/batch.py): checked against a step-by-step reference of vLLM 0.32's scheduler written out here
and against hand-worked cases."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.sim.batch import vllm_hit_blocks
from kvroute.sim.engine import Seq
from tests.test_sim_engine import Harness, small_profile

BT = 16


def vllm_memory_reference(prompts: list[tuple[int, tuple[int, ...]]], budget: int, capacity: int):
    """vLLM v1's scheduler for one-output-token requests (no decodes), written out step by step
    from vLLM 0.32 (.venv-vllm) ``v1/core/sched/scheduler.py`` and ``kv_cache_manager.py``.

    Each step: the running prefills (admission order) each allocate their chunk's tokens, evicting
    LRU cache blocks, else the newest running request is preempted (its blocks freed, back at the
    head of the queue), and the chunk's full blocks are cached; then, unless the step preempted
    (or nothing runs), the waiting requests while budget is left: the hit is whole cached leading
    blocks of at most ``prompt − 1`` tokens, the request is admitted only if its whole uncached
    prompt fits the free memory plus evictable blocks other than its hit, and its first chunk is
    allocated and cached. A request whose prompt is done frees its blocks, tail first. Request 0
    is queued at the first step, the rest from the second. Memory counts tokens (whole blocks
    cached, the partial tail private), and a block computed while another copy is cached is
    shared: the simulator's two stated simplifications. Returns each request's hit at its first
    admission, the preemptions, the order prompts finished in and the hashes cached at the end."""
    cache: dict[int, int] = {}  # hash -> running requests referencing it
    lru: list[int] = []  # unreferenced cached hashes, the next evicted first
    used = 0
    hit = [-1] * len(prompts)
    blocks: dict[int, list[int]] = {}  # request -> hashes it references
    private: dict[int, int] = {}
    done: dict[int, int] = {}
    waiting, running, finished, preemptions, step = [0], [], [], 0, 0

    def evict_for(n):
        nonlocal used
        while capacity - used < n:
            del cache[lru.pop(0)]
            used -= BT

    def store(i, end):
        nonlocal used
        hs = prompts[i][1]
        for k in range(len(blocks[i]), min(len(hs), end // BT)):
            h = hs[k]
            if h in cache:  # another copy is cached: share it
                if cache[h] == 0:
                    lru.remove(h)
                cache[h] += 1
                used -= BT
            else:
                cache[h] = 1
            private[i] -= BT
            blocks[i].append(h)

    def free(i):
        nonlocal used
        used -= private.pop(i)
        for h in reversed(blocks.pop(i)):
            cache[h] -= 1
            if cache[h] == 0:
                lru.append(h)

    while waiting or running or step < 2:
        step += 1
        if step == 2:
            waiting += list(range(1, len(prompts)))
        left, scheduled, preempted = budget, [], False
        for i in list(running):
            if left <= 0:
                break
            if i not in running:
                continue
            end = done[i] + min(prompts[i][0] - done[i], left)
            extra = end - len(blocks[i]) * BT - private[i]
            while extra > capacity - used + len(lru) * BT:
                victim = running.pop()
                free(victim)
                waiting.insert(0, victim)
                preemptions += 1
                preempted = True
                if victim == i:
                    break
            if i not in running:
                break
            evict_for(extra)
            private[i] += extra
            used += extra
            store(i, end)
            scheduled.append((i, end))
            left -= end - done[i]
        while waiting and left > 0 and (not preempted or not running):
            i = waiting[0]
            p, hs = prompts[i]
            m = 0
            while m < len(hs) and hs[m] in cache:
                m += 1
            m = min(m, (p - 1) // BT)
            need = p - m * BT
            others = len(lru) - sum(1 for h in hs[:m] if cache[h] == 0)
            if need > capacity - used + others * BT:
                break
            waiting.pop(0)
            for h in hs[:m]:
                if cache[h] == 0:
                    lru.remove(h)
                cache[h] += 1
            blocks[i], private[i], done[i] = list(hs[:m]), 0, m * BT
            if hit[i] < 0:
                hit[i] = m * BT
            end = done[i] + min(p - done[i], left)
            evict_for(end - done[i])
            private[i] += end - done[i]
            used += end - done[i]
            store(i, end)
            scheduled.append((i, end))
            left -= end - done[i]
            running.append(i)
        for i, end in scheduled:
            if i in running:
                done[i] = end
                if end == prompts[i][0]:
                    running.remove(i)
                    free(i)
                    finished.append(i)
    return hit, preemptions, finished, set(cache)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8), st.sampled_from([0, 0, 1, 7, 15])),
                min_size=2, max_size=8),
       st.sampled_from([16, 40, 64, 200]), st.integers(10, 30))
def test_vllm_memory_and_hits_match_a_step_by_step_reference(reqs, budget, kv_blocks):
    rng = random.Random(len(reqs) * 31 + budget + kv_blocks)
    families = {f: tuple(rng.getrandbits(64) for _ in range(8)) for f in range(3)}
    prompts = [(n * BT + extra, families[f][:n]) for f, n, extra in reqs]
    h = Harness(small_profile(kv_blocks=kv_blocks, max_batched_tokens=budget))  # 160-480 tokens
    seqs = [Seq(f"r{i}", p, 1, hs, BT) for i, (p, hs) in enumerate(prompts)]
    for s in seqs:
        h.eng.submit(s)
    h.run()
    hit, preemptions, finished, cached = vllm_memory_reference(prompts, budget, kv_blocks * BT)
    assert [s.cached for s in seqs] == hit
    assert h.eng.preemptions == preemptions
    assert sorted(h.done, key=lambda r: (h.done[r], int(r[1:]))) == [f"r{i}" for i in finished]
    assert set(h.eng.refcnt) == cached


def test_hit_blocks_stop_below_the_last_prompt_token():
    assert vllm_hit_blocks(4, 64, 16) == 3  # 64 tokens, all 4 blocks cached: the last recomputed
    assert vllm_hit_blocks(4, 65, 16) == 4  # one token past the blocks: all 4 reused
    assert vllm_hit_blocks(2, 64, 16) == 2
    assert vllm_hit_blocks(1, 16, 16) == 0  # a one-block prompt reuses nothing
    assert vllm_hit_blocks(5, 80, 1) == 5  # token-sized blocks: all but the last token


def test_admission_takes_only_the_first_chunk_of_memory():
    """vLLM admits a prompt whose whole uncached part fits, but allocates only its scheduled chunk:
    after the first step of a 300-token prompt with a 64-token budget, 64 tokens are in use, not
    300 (the simulator before issue 21q reserved all 300 at admission)."""
    h = Harness(small_profile(kv_blocks=100, max_batched_tokens=64))
    a = Seq("a", 300, 2, tuple(range(18)), BT)
    h.eng.submit(a)
    assert h.eng.used == 64 and a.private == 0 and a.refs == 4  # four whole blocks cached at schedule
    h.check()
    h.run()
    assert "a" in h.done


def test_a_chunk_without_memory_preempts_the_newest_running_request_itself():
    """Two decoding requests grow while a long prompt is chunked beside them (8-token budget: six
    prompt tokens a step). vLLM admitted the prompt when its 250 tokens fitted; when a later chunk
    finds no memory it preempts the newest running request, the prompt itself (scheduler.py
    ``self.running.pop()``), not a decoding one: both decoding requests finish undisturbed and the
    prompt is admitted again after them. (The simulator before issue 21q reserved all 250 tokens at
    admission, so the decodes ran short and d2 was preempted; the prompt finished first.)"""
    h = Harness(small_profile(kv_blocks=20, max_batched_tokens=8))  # 320 tokens
    e = h.eng
    d1 = Seq("d1", 16, 120, (1,), BT)
    d2 = Seq("d2", 16, 120, (2,), BT)
    e.submit(d1)
    e.submit(d2)
    b = Seq("b", 250, 1, tuple(range(100, 115)), BT)
    h.loop.at(0.2, e.submit, b)  # the two are decoding by then
    h.run()
    assert e.preemptions == 1
    assert sorted(h.done, key=h.done.get) == ["d1", "d2", "b"]
    assert d1.generated == 0 and d2.generated == 0  # never preempted (a recompute counts them)
