import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.prefix import PrefixIndex


def brute_longest(held: set[int], chain: tuple[int, ...]) -> int:
    n = 0
    for h in chain:
        if h not in held:
            break
        n += 1
    return n


# A small universe of chains sharing prefixes: chain k of a family extends chain k-1.
def make_chains(seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    chains = []
    for _family in range(4):
        chain: tuple[int, ...] = ()
        for _ in range(5):
            chain = chain + tuple(rng.getrandbits(64) for _ in range(rng.randint(1, 6)))
            chains.append(chain)
    return chains


ops = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 19),
                         st.integers(1, 40)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=ops, seed=st.integers(0, 3), cap=st.integers(3, 40))
def test_index_matches_brute_force_reference(ops, seed, cap):
    chains = make_chains(seed)
    index = PrefixIndex(capacity_blocks=cap)
    last_touch: dict[str, dict[int, int]] = {}  # reference: exact recency per endpoint
    last_chain: dict[str, tuple[int, ...]] = {}
    for step, (ep, k, cut) in enumerate(ops):
        chain = chains[k][:cut]
        index.insert(ep, chain)
        stored = chain[:cap]
        for h in stored:
            last_touch.setdefault(ep, {})[h] = step
        last_chain[ep] = stored
    for ep, touched in last_touch.items():
        held = {h for h in touched if ep in index.holders(h)}
        assert index.blocks(ep) == len(held) <= cap  # bounded
        assert set(last_chain[ep]) <= held  # the latest insert is always kept
        # LRU: what is held is exactly the most recently touched blocks
        if held != set(touched):
            newest_evicted = max(touched[h] for h in touched if h not in held)
            assert all(touched[h] >= newest_evicted for h in held)
        # longest prefix equals the brute-force walk, for every chain and its truncations
        for chain in chains:
            for cut in (1, len(chain) // 2 + 1, len(chain)):
                probe = chain[:cut]
                assert index.match_one(ep, probe) == brute_longest(held, probe)
                assert index.match(probe).get(ep, 0) == brute_longest(held, probe)


def test_remove_and_clear_endpoint():
    index = PrefixIndex()
    index.insert("a", (1, 2, 3))
    index.insert("b", (1, 2))
    assert index.match((1, 2, 3)) == {"a": 3, "b": 2}
    assert sorted(index.holders(2)) == ["a", "b"]
    index.remove_endpoint("a")
    assert index.match((1, 2, 3)) == {"b": 2}
    index.clear("b")
    assert index.match((1, 2, 3)) == {} and len(index) == 0


def test_bounded_under_long_churn():
    rng = random.Random(1)
    index = PrefixIndex(capacity_blocks=1000)
    hot = tuple(rng.getrandbits(64) for _ in range(50))
    for _ in range(3000):
        index.insert("e", hot)  # refreshing hot blocks must not grow the log without bound
        index.insert("e", tuple(rng.getrandbits(64) for _ in range(20)))
        assert index.blocks("e") <= 1000
    assert index.match_one("e", hot) == 50
    table = index._tables["e"]
    assert table.logged <= 2 * 1000 + 50


def test_insert_longer_than_capacity_keeps_the_head():
    index = PrefixIndex(capacity_blocks=4)
    index.insert("e", (1, 2, 3, 4, 5, 6))
    assert index.match_one("e", (1, 2, 3, 4, 5, 6)) == 4


def test_max_blocks_bounds_what_is_indexed_and_matched():
    index = PrefixIndex(max_blocks=4)
    chain = tuple(range(100, 110))
    index.insert("e", chain)
    assert index.blocks("e") == 4  # only the head is indexed
    assert index.match(chain) == {"e": 4} and index.match_one("e", chain) == 4
    unbounded = PrefixIndex(max_blocks=0)
    unbounded.insert("e", chain)
    assert unbounded.match(chain) == {"e": 10}


def test_hit_ratio_counts_tokens_so_a_bounded_index_does_not_overstate_it():
    from kvroute.model import Request

    req = Request("r", block_hashes=tuple(range(512)), block_tokens=64, prompt_tokens=32768)
    assert req.hit_ratio(256) == 0.5  # the indexed head of a 32K prompt is half of it
    assert req.new_prefill_tokens(256) == 16384


def test_forget_undoes_only_the_blocks_an_insert_added_and_no_one_reused():
    idx = PrefixIndex(capacity_blocks=100)
    shared = [1, 2, 3]
    idx.insert("e", shared)
    tick = idx.insert("e", shared + [4, 5])  # a request that added blocks 4 and 5 to what was cached
    idx.forget("e", shared + [4, 5], 3, tick)  # it failed: the engine never held 4, 5
    assert idx.match([1, 2, 3, 4, 5])["e"] == 3 and idx.blocks("e") == 3
    tick = idx.insert("e", shared + [6, 7])
    idx.insert("e", shared + [6, 7, 8])  # a later request went through 6, 7: they stay
    idx.forget("e", shared + [6, 7], 3, tick)
    assert idx.match([1, 2, 3, 6, 7, 8])["e"] == 6
