"""llama-server's slot copies to and from its host prompt cache in the simulated engine
(sim/slot_cache.py, profile ``slot_save_s_per_token``) and their calibration probe's fit."""

import pytest

from kvroute.calibrate.slot_probe import per_token
from kvroute.perf.profile import HardwareProfile
from kvroute.sim.engine import Engine, Seq
from kvroute.sim.events import EventLoop
from kvroute.sim.slot_cache import common_prefix

# prefills of 1 ms per token, decode steps of 10 ms; llama-server's slot reuse
BASE = HardwareProfile(name="unit", hardware="test", model="test", c0_s=0.0, c_prefill_s=1e-3, c_decode_s=0.01,
                       c_attn_s=0.0, c_prefill_attn_s=0.0, h_cv=0.0, kv_blocks=10000, block_size=16, max_running=2,
                       prefix_reuse="idle_slots")
PER_TOKEN = 1e-4
A = tuple(range(62))  # block hashes of a 1,000-token prompt (16 tokens per block)


def _chain(per_token: float, requests: list[tuple[str, int, int, tuple[int, ...]]]):
    """Run ``requests`` (rid, prompt, output, hashes) one after another on one engine; return the
    engine, first-token times and finish times."""
    loop = EventLoop()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    todo = list(requests)
    e: Engine

    def finish(s, t):
        done[s.rid] = t
        if todo:
            rid, prompt, output, hashes = todo.pop(0)
            loop.at(t + 1.0, lambda _: e.submit(Seq(rid, prompt, output, hashes, 16)), None)

    e = Engine("e", BASE.model_copy(update={"slot_save_s_per_token": per_token}), loop,
               lambda s, t: first.__setitem__(s.rid, t), finish)
    rid, prompt, output, hashes = todo.pop(0)
    e.submit(Seq(rid, prompt, output, hashes, 16))
    loop.run()
    return e, first, done


def test_off_by_default_and_with_shared_prefix_reuse():
    e, _, _ = _chain(0.0, [("a", 1000, 11, A)])
    assert e.slot_cache is not None and e.slot_cache.copies == 0  # the slot choice, copies free
    loop = EventLoop()
    old_model = BASE.model_copy(update={"slot_choice": "any_copy"})
    assert Engine("o", old_model, loop, lambda s, t: None, lambda s, t: None).slot_cache is None
    loop = EventLoop()
    vllm_like = BASE.model_copy(update={"slot_save_s_per_token": PER_TOKEN, "prefix_reuse": "shared"})
    assert Engine("v", vllm_like, loop, lambda s, t: None, lambda s, t: None).slot_cache is None


def test_a_finished_slot_is_copied_at_the_next_launch_unless_its_next_turn_takes_it():
    # an unrelated request after a: a's slot (1,011 tokens) is saved at b's launch, in b's first step
    requests = [("a", 1000, 11, A), ("b", 100, 1, (1000, 1001, 1002, 1003, 1004, 1005))]
    e, first, _ = _chain(PER_TOKEN, requests)
    _, plain, _ = _chain(0.0, requests)
    assert e.slot_cache.copied_tokens == 1011 and e.slot_cache.copies == 1
    assert first["b"] - plain["b"] == pytest.approx(1011 * PER_TOKEN)
    assert first["a"] == plain["a"]  # nothing was idle at a's launch
    # a's next turn takes a's slot by its common prefix: nothing to copy
    e, first, _ = _chain(PER_TOKEN, [("a", 1000, 11, A), ("a2", 1100, 5, (*A, 500, 501, 502, 503, 504, 505))])
    assert e.slot_cache.copied_tokens == 0
    assert first["a2"] == _chain(0.0, [("a", 1000, 11, A), ("a2", 1100, 5, (*A, 500, 501, 502, 503))])[1]["a2"]


def test_a_request_taking_a_slot_by_lru_loads_the_best_cached_prompt():
    """Two slots: a's slot is taken over by e (least recently used), so a's next turn d finds its
    prefix in no idle slot and loads a's cached state (1,011 tokens) into the LRU slot."""
    b = tuple(range(1000, 1006))
    x = tuple(range(2000, 2006))
    d = (*A, 3000, 3001, 3002, 3003, 3004, 3005)
    e, _, _ = _chain(PER_TOKEN, [("a", 1000, 11, A), ("b", 100, 1, b), ("x", 100, 1, x), ("d", 1100, 1, d)])
    # b's launch saves a (1,011); x's saves b (101); d's loads a (1,011) and saves x (101)
    assert e.slot_cache.copied_tokens == 1011 + 101 + 1011 + 101 and e.slot_cache.copies == 4
    assert [c.tokens for c in e.slot_cache.cached] == [101, 101]  # a moved back into a slot


def test_a_request_arriving_during_a_launchs_copies_joins_the_step_they_precede():
    """llama-server launches every queued task, copying slots, before it steps (server-queue.cpp
    process_new_tasks, server-context.cpp process_single_task): b's launch saves a's slot (1,001
    tokens, 0.1001 s); c arrives 50 ms into that copy, is launched too, and both prefill in one
    step — their first tokens come together, after the copy and the two prompts' 200 ms."""
    loop = EventLoop()
    first: dict[str, float] = {}
    e = Engine("e", BASE.model_copy(update={"slot_save_s_per_token": PER_TOKEN, "max_running": 3}), loop,
               lambda s, t: first.__setitem__(s.rid, t), lambda s, t: None)
    e.submit(Seq("a", 1000, 1, A, 16))
    loop.run()
    start = loop.now + 1.0
    loop.at(start, lambda _: e.submit(Seq("b", 100, 1, tuple(range(1000, 1006)), 16)), None)
    loop.at(start + 0.05, lambda _: e.submit(Seq("c", 100, 1, tuple(range(2000, 2006)), 16)), None)
    loop.run()
    assert e.slot_cache is not None and e.slot_cache.copied_tokens == 1001
    assert first["b"] == first["c"] == pytest.approx(start + 1001 * PER_TOKEN + 0.2)


def test_common_prefix_and_the_probes_per_token_fit():
    assert common_prefix((1, 2, 3, 4), (1, 2, 9)) == 2 and common_prefix((), (1,)) == 0
    assert common_prefix((1, 2, 3), (1, 2, 3)) == 3
    # extra seconds over copied tokens, median over points, divided by the machine's sharing
    assert per_token([(1000, 0.006), (3000, 0.012), (2000, 0.010)], 1.0) == pytest.approx(5e-6)
    assert per_token([(1000, 0.006)], 1.5) == pytest.approx(4e-6)
    assert per_token([(1000, -0.002)], 1.0) == 0.0 and per_token([], 1.0) == 0.0


def _cached(update: dict, requests: list[tuple[str, int, int, tuple[int, ...]]]) -> dict[str, int]:
    """Run ``requests`` one after another (each 1 s after the last finished) on one engine of
    BASE + ``update``; the cached prompt tokens each got."""
    loop = EventLoop()
    cached: dict[str, int] = {}
    todo = list(requests)

    def finish(s, t):
        cached[s.rid] = s.cached
        if todo:
            rid, prompt, output, hashes = todo.pop(0)
            loop.at(t + 1.0, lambda _: e.submit(Seq(rid, prompt, output, hashes, 16)), None)

    e = Engine("e", BASE.model_copy(update=update), loop, lambda s, t: None, finish)
    rid, prompt, output, hashes = todo.pop(0)
    e.submit(Seq(rid, prompt, output, hashes, 16))
    loop.run()
    return cached


def test_a_request_reuses_only_what_the_slot_llama_server_gives_it_holds():
    """q shares a's first 20 blocks and takes a's slot by its common prefix (a is saved to the
    host cache: q keeps under half of it). a's next turn d then finds q's slot similar (320 of
    1,100 tokens > 10 %) and keeping over half of it, so llama-server does not look in the host
    cache (get_available_slot: f_keep >= 0.5) and d reuses 320 tokens; any copy would give 992."""
    q = (*A[:20], *range(4000, 4006))
    d = (*A, *range(3000, 3006))
    requests = [("a", 1000, 11, A), ("q", 416, 1, q), ("d", 1100, 1, d)]
    slots = _cached({}, requests)
    anywhere = _cached({"slot_choice": "any_copy"}, requests)
    assert slots["q"] == anywhere["q"] == 320
    assert slots["d"] == 320 and anywhere["d"] == 992
    # after an unrelated request took a's slot by LRU, a's next turn loads a back from the host cache
    b, x = tuple(range(1000, 1006)), tuple(range(2000, 2006))
    assert _cached({}, [("a", 1000, 11, A), ("b", 100, 1, b), ("x", 100, 1, x), ("d", 1100, 1, d)])["d"] == 992
