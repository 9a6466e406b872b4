from kvroute.prefix import HashRing


def test_vnodes_and_deterministic_lookup():
    ring = HashRing([f"e{i}" for i in range(4)])
    assert ring.points >= 1024
    assert ring.lookup("user-1") == HashRing([f"e{i}" for i in range(4)]).lookup("user-1")


def test_lookup_skips_filtered_endpoints_clockwise():
    ring = HashRing(["a", "b", "c"])
    for key in range(200):
        owner = ring.lookup(key)
        allowed = {"a", "b", "c"} - {owner}
        nxt = ring.lookup(key, allowed)
        assert nxt in allowed
        # it is the first allowed owner clockwise
        assert nxt == next(o for o in ring.successors(key) if o in allowed)
    assert ring.lookup("k", set()) is None


def test_minimal_remapping_on_join_and_leave():
    ids = [f"e{i}" for i in range(8)]
    ring = HashRing(ids)
    keys = [f"session-{i}" for i in range(5000)]
    before = {k: ring.lookup(k) for k in keys}
    ring.add("e8")
    after = {k: ring.lookup(k) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "e8" for k in moved)  # keys only move to the newcomer
    assert 0.05 < len(moved) / len(keys) < 0.2  # about 1/9 of them
    ring.remove("e3")
    gone = {k: ring.lookup(k) for k in keys}
    changed = [k for k in keys if gone[k] != after[k]]
    assert all(after[k] == "e3" for k in changed)  # only e3's keys move
    assert "e3" not in set(gone.values())
