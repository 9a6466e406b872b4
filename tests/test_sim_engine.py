"""The engine model: invariants under random load, prefix caching, preemption, analytic decode."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.perf.loader import available_profiles, load_profile
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop


def small_profile(**kw):
    """The L4 profile's step times with vLLM's admission and live waiting count (these tests are
    about vLLM's scheduler; SGLang's, which the L4 profile runs, is tested in
    test_sglang_admission.py and test_queue_gauge.py) and ``kw``."""
    base = load_profile("l4-llama3.1-8b").model_dump()
    base["admission"], base["waiting_gauge"] = "vllm", "live"
    base.update(kw)
    return type(load_profile("l4-llama3.1-8b"))(**base)


class Harness:
    """An engine plus bookkeeping that checks its invariants after every event."""

    def __init__(self, profile):
        self.loop = EventLoop()
        self.first, self.done = {}, {}
        self.eng = Engine("e", profile, self.loop, self._first, self._finish)
        self.computed: set[int] = set()  # blocks some sequence finished prefilling

    def _first(self, seq, t):
        assert seq.rid not in self.first
        self.first[seq.rid] = t
        self.computed.update(seq.hashes[: min(len(seq.hashes), seq.prompt // seq.bt)])

    def _finish(self, seq, t):
        assert seq.rid not in self.done, "finished twice"
        self.done[seq.rid] = t

    def check(self):
        e = self.eng
        assert 0 <= e.used <= e.capacity, (e.used, e.capacity)
        assert e.running <= e.p.max_running
        assert all(c >= 0 for c in e.refcnt.values())
        assert set(e.evictable) == {h for h, c in e.refcnt.items() if c == 0}
        # the cache only holds blocks that some sequence computed or (vLLM v1 caches a chunk's
        # blocks when it schedules it, sim/batch.py store_at) has in the step in progress
        for seq, c in e._chunks:
            self.computed.update(seq.hashes[: min(len(seq.hashes), (seq.prompt - seq.prefill_left + c) // seq.bt)])
        assert set(e.refcnt) <= self.computed
        private = sum(s.private + (s.a + e.steps - s.prompt) for s in e.decoding.values()) \
            + sum(s.private for s in e.prefilling)
        assert e.used == private + len(e.refcnt) * e.cache_bt

    def run(self):
        heap = self.loop._heap
        while heap:
            self.loop.run(until=heap[0][0])
            self.check()


chains = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 300),
                            st.floats(0, 5)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(chains, st.integers(200, 2000))
def test_engine_invariants_under_random_load(reqs, kv_blocks):
    h = Harness(small_profile(kv_blocks=kv_blocks, max_running=8, max_batched_tokens=512))
    rng = random.Random(len(reqs))
    families = {f: tuple(rng.getrandbits(64) for _ in range(12)) for f in range(4)}
    submitted = []
    for i, (fam, nblocks, out, at) in enumerate(reqs):
        hashes = families[fam][:nblocks]
        prompt = nblocks * 64 + rng.randrange(0, 64)
        if not h.eng.fits(prompt, out):
            continue
        seq = Seq(f"r{i}", prompt, out, hashes, 64)
        submitted.append(seq)
        h.loop.at(at, h.eng.submit, seq)
    h.run()
    assert set(h.done) == {s.rid for s in submitted}  # each finishes exactly once
    assert set(h.first) == set(h.done)
    assert all(h.first[r] <= h.done[r] for r in h.done)
    assert h.eng.running == 0 and not h.eng.waiting
    assert h.eng.hit_tokens <= h.eng.prompt_tokens


def test_prefix_cache_hits_only_after_prefill_and_skip_prefill_work():
    h = Harness(small_profile(kv_blocks=4000))
    hashes = tuple(range(100, 120))
    a = Seq("a", 20 * 64, 4, hashes, 64)
    b = Seq("b", 20 * 64, 4, hashes, 64)
    h.eng.submit(a)
    h.run()
    t_a = h.first["a"]
    h.loop.at(h.loop.now + 1.0, h.eng.submit, b)
    start = h.loop.now + 1.0
    h.run()
    # a block-aligned prompt: vLLM v1 reuses whole blocks below its last token, so it recomputes
    # its last block (sim/batch.py vllm_hit_blocks; the sim before issue 21q gave 20 * 64 - 1)
    assert b.cached == 19 * 64
    assert h.first["b"] - start < t_a / 5  # and the prefill was far shorter


def test_a_prompt_waiting_behind_a_chunked_prefix_hits_the_blocks_vllm_scheduled():
    """vLLM v1 caches a chunk's full blocks when it schedules the chunk and admits a waiting
    request only while the step's token budget has room (sim/batch.py ``store_at``): b, arriving
    during a's first 128-token chunk, waits until a's last chunk is scheduled and then hits the
    six blocks it shares with a (the simulator before issue 21p admitted it at once, cold)."""
    h = Harness(small_profile(kv_blocks=4000, max_batched_tokens=128))
    shared = tuple(range(6))
    a = Seq("a", 650, 2, shared + (10, 11, 12, 13), 64)
    b = Seq("b", 650, 2, shared + (20, 21, 22, 23), 64)
    h.eng.submit(a)  # five chunked-prefill steps of 128 tokens and one of 10
    h.loop.at(0.01, h.eng.submit, b)
    h.run()
    assert b.cached == 6 * 64 and h.eng.hit_tokens == 6 * 64
    assert h.first["b"] > h.first["a"]


def test_a_prompt_admitted_beside_another_hits_its_scheduled_chunk_in_the_same_step():
    """Both wait at one step boundary: vLLM schedules a's first chunk (and caches its blocks),
    then looks b up in the same schedule; with 256 tokens of budget left b hits a's first four
    blocks although no step has run yet. Memory counts the shared blocks once."""
    h = Harness(small_profile(kv_blocks=4000, max_batched_tokens=512))
    shared = tuple(range(8))
    a = Seq("a", 256 + 10, 2, shared[:4], 64)
    b = Seq("b", 8 * 64 + 5, 2, shared, 64)
    e = h.eng
    e.waiting.extend([a, b])  # both queued before the engine plans
    e.submit(Seq("c", 10, 1, (), 64))  # a third wakes the idle engine: one plan for all three
    assert a.cached == 0 and b.cached == 4 * 64
    assert e.refcnt[shared[0]] == 2  # a's block, referenced by b too, stored once
    h.check()
    h.run()


def test_sglang_caches_a_chunk_after_its_step():
    """SGLang caches a chunked request's prefix after each chunk's forward pass
    (``cache_unfinished_req``): b, arriving during a's first chunk, is admitted at the next step
    boundary (SGLang's admission has no token bound here) and hits a's first two blocks."""
    h = Harness(small_profile(kv_blocks=4000, max_batched_tokens=128, admission="sglang"))
    shared = tuple(range(6))
    a = Seq("a", 650, 2, shared + (10, 11, 12, 13), 64)
    b = Seq("b", 650, 2, shared + (20, 21, 22, 23), 64)
    h.eng.submit(a)
    h.loop.at(0.01, h.eng.submit, b)
    h.run()
    assert b.cached == 2 * 64


def vllm_reference(prompts: list[tuple[int, tuple[int, ...]]], budget: int, bt: int) -> list[int]:
    """Cached prompt tokens of each request by vLLM v1's scheduling rule, written out step by
    step: running prefills first (FCFS), each chunk's full blocks cached when scheduled, then the
    waiting queue while budget is left, looked up against the cache as it stands. Request 0 waits
    at the first step, the rest from the second; one output token each (no decodes), memory ample.
    The hit is the sim's (every matched token but the prompt's last)."""
    cached: set[int] = set()
    hit = [-1] * len(prompts)
    waiting, running, step = [0], [], 0

    def store(i, tokens):
        cached.update(prompts[i][1][: tokens // bt])

    while waiting or running or step < 2:
        step += 1
        if step == 2:
            waiting += list(range(1, len(prompts)))
        left, nxt = budget, []
        for i, done in running:
            c = min(prompts[i][0] - done, max(left, 0))
            left -= c
            store(i, done + c)
            if done + c < prompts[i][0]:
                nxt.append((i, done + c))
        while waiting and left > 0:
            i = waiting.pop(0)
            m = 0
            while m < len(prompts[i][1]) and prompts[i][1][m] in cached:
                m += 1
            hit[i] = min(m * bt, prompts[i][0] - 1)
            c = min(prompts[i][0] - hit[i], left)
            left -= c
            store(i, hit[i] + c)
            if hit[i] + c < prompts[i][0]:
                nxt.append((i, hit[i] + c))
        running = nxt
    return hit


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(1, 63)), min_size=2, max_size=8),
       st.sampled_from([64, 100, 256, 700]))
def test_vllm_prefix_hits_match_a_step_by_step_reference(reqs, budget):
    bt = 64
    rng = random.Random(len(reqs) * 7 + budget)
    families = {f: tuple(rng.getrandbits(64) for _ in range(12)) for f in range(3)}
    prompts = [(n * bt + extra, families[f][:n]) for f, n, extra in reqs]
    h = Harness(small_profile(kv_blocks=4000, max_batched_tokens=budget))
    seqs = [Seq(f"r{i}", p, 1, hs, bt) for i, (p, hs) in enumerate(prompts)]
    for s in seqs:
        h.eng.submit(s)
    h.run()
    assert [s.cached for s in seqs] == vllm_reference(prompts, budget, bt)


def test_preemption_under_memory_pressure_still_finishes_everything():
    h = Harness(small_profile(kv_blocks=120, max_running=16, max_batched_tokens=2048))  # 1920 tokens
    for i in range(8):
        h.eng.submit(Seq(f"r{i}", 100, 400, (), 64))
    h.run()
    assert len(h.done) == 8 and h.eng.preemptions > 0


def test_decode_jump_matches_step_by_step_time():
    p = small_profile(kv_blocks=10_000)
    h = Harness(p)
    h.eng.submit(Seq("a", 64, 50, (), 64))
    h.run()
    t_prefill = p.step_time(64, prefill_attn=64 * 32)
    # 49 more decode steps over a KV context growing from 64 to 112 tokens
    t_decode = sum(p.step_time(decode=1, decode_ctx=64 + k) for k in range(49))
    assert h.done["a"] == pytest.approx(t_prefill + t_decode, rel=1e-9)


def test_arrival_interrupts_a_decode_jump_at_the_next_step_boundary():
    p = small_profile(kv_blocks=10_000)
    h = Harness(p)
    h.eng.submit(Seq("long", 64, 1000, (), 64))
    h.loop.at(0.9, h.eng.submit, Seq("late", 64, 2, (), 64))
    h.run()
    assert 0.9 < h.first["late"] < 0.9 + 0.3  # not after the long request's 1000 tokens
    assert h.done["long"] > h.done["late"]


@pytest.mark.parametrize("name", available_profiles())
def test_profiles_reproduce_their_published_points(name):
    p = load_profile(name)
    assert p.points, f"{name} lists no published points"
    independent = [pt for pt in p.points if pt.get("independent")]
    assert independent or p.no_independent_anchor, \
        f"{name}: no independent anchor and no statement why none exists"
    for pt in p.points:
        if "ttft_s" in pt and "cached" in pt:  # a warm prefill: new tokens over a cached prefix
            n, c = pt["prefill"], pt["cached"]
            got, want = p.ttft_overhead_s + p.step_time(n, prefill_attn=n * (c + n / 2)), pt["ttft_s"]
        elif "ttft_s" in pt:
            got, want = p.ttft_overhead_s + p.prefill_time(pt["prefill"]), pt["ttft_s"]
        elif "attn_share" in pt:
            got, want = p.attention_share(pt["decode"], pt["ctx"]), pt["attn_share"]
        elif "expect_h" in pt:
            cv = pt["heterogeneity_cv"]  # two lengths m(1±cv) have exactly this CV
            got, want = p.heterogeneity(2, 2000, 1000**2 * ((1 + cv) ** 2 + (1 - cv) ** 2)), pt["expect_h"]
        elif "kv_fits" in pt:
            f = pt["kv_fits"]
            got = p.kv_tokens * f["kv_bytes_per_token"] / 1e9
            want = f["hbm_gb"] * 0.9 - f["weights_gb"]
            assert got <= want * 1.05, pt["source"]
            continue
        elif "prefill" in pt:
            got, want = p.prefill_time(pt["prefill"]), pt["expect_s"]
        else:
            got, want = p.step_time(decode=pt["decode"], decode_ctx=pt["decode"] * pt["ctx"]), pt["expect_s"]
        assert got == pytest.approx(want, rel=0.05), pt["source"]


def test_mixed_length_batches_are_slower_than_uniform():
    p = load_profile("h100-llama3.2-3b")
    lengths_uniform = [1000] * 4
    lengths_mixed = [100, 100, 100, 3700]
    def attention(ls):  # CascadeInfer's 1.1–2.1x is the attention kernel's time, not the step's
        s, s2 = sum(ls), sum(x * x for x in ls)
        step = p.step_time(decode=4, decode_ctx=s, h=p.heterogeneity(4, s, s2))
        return step - p.step_time(decode=4) + p.c_attn_fixed_s
    assert 1.1 <= attention(lengths_mixed) / attention(lengths_uniform) <= 2.1


def test_a_prefill_chunk_pays_attention_for_whole_tiles_of_query_rows():
    """llama.cpp's CPU attention pads a chunk of >= 64 query rows to whole 64-row tiles
    (profile.prefill_attn_tile): a lone 100-token prompt costs 128 rows, one of 40 costs 40."""
    base = load_profile("l4-llama3.1-8b").model_copy(update={"c_prefill_attn_s": 1e-6, "h_cv": 0.0})
    tiled = base.model_copy(update={"prefill_attn_tile": 64})

    def ttft(profile, prompt: int) -> float:
        loop = EventLoop()
        first: dict[str, float] = {}
        engine = Engine("e", profile, loop, lambda s, t: first.setdefault(s.rid, t), lambda s, t: None)
        engine.submit(Seq("a", prompt, 2, tuple(range(1, prompt // 16 + 1)), 16))
        loop.run()
        return first["a"]

    assert ttft(tiled, 100) - ttft(base, 100) == pytest.approx(1e-6 * 28 * 50, rel=1e-6)
    assert ttft(tiled, 40) == ttft(base, 40)
    assert tiled.prefill_time(100) - base.prefill_time(100) == pytest.approx(1e-6 * 28 * 50, rel=1e-6)
