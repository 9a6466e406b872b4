"""``auto``'s least-work rule routes only among replicas whose KV cache holds the request beside the prompt blocks of
the load balancer's requests in flight (``kv_room``, policy/adaptive/selector/kv_room.py; docs/auto.md, session 12)."""

from itertools import count

from kvroute.model import DecisionKind, Request
from kvroute.policy.adaptive.selector.kv_room import fits
from kvroute.policy.presets.auto import LEAST_WORK

KV = {"kv_blocks": 100, "block_size": 16}  # 1,600 tokens of KV cache per replica
BT = 64  # the prefix index's block
_fresh = count(1_000_000)


def req(rid: str, blocks: int, prefix: list[int] | None = None) -> Request:
    """A prompt of ``blocks`` full blocks: ``prefix``'s hashes first, then its own."""
    own = [next(_fresh) for _ in range(blocks - len(prefix or []))]
    return Request(id=rid, block_hashes=(prefix or []) + own, block_tokens=BT, prompt_tokens=blocks * BT)


def decoding(r, where: dict[str, list[Request]]) -> None:
    """Dispatch each request to the given replica (the Router's own commit, listeners told) and see its first token."""
    for eid, reqs in where.items():
        for q in reqs:
            r.commit(q, eid)
            r.on_first_token(q.id, 0.2)


def test_fits_counts_held_plus_needed_tokens_against_the_capacity():
    assert fits(1000, 600, 1600) and not fits(1001, 600, 1600)
    assert fits(10**9, 10**9, 0)  # capacity unknown: every replica fits


def test_least_work_skips_a_replica_whose_cache_is_full_of_requests_in_flight(router_for):
    for on in (True, False):
        r = router_for("auto", 3, params={"kv_room": on}, **KV)
        # e0 decodes one long conversation (1,536 of its 1,600 tokens); e1 and e2 two short ones each
        decoding(r, {"e0": [req("a", 24)], "e1": [req("b", 2), req("c", 2)], "e2": [req("d", 2), req("e", 2)]})
        d = r.route(req("new", 5))
        assert d.kind == DecisionKind.DISPATCH and d.branch == LEAST_WORK
        # no prefill queued anywhere: the least work alone picks the fewest in flight, e0, where 320 more tokens do
        # not fit (1,856 > 1,600) and the prompt would wait for memory; kv_room sends it where it fits
        assert (d.target != "e0") == on, (on, d.target)


def test_a_prefix_shared_by_requests_in_flight_is_held_once(router_for):
    r = router_for("auto", 3, **KV)
    trunk = [next(_fresh) for _ in range(20)]  # 1,280 tokens every branch shares
    # e0 holds three branches of one tree: 1,280 + 3 x 64 = 1,472 tokens (their prompts sum to 4,032)
    decoding(r, {"e0": [req(f"t{i}", 21, trunk) for i in range(3)], "e1": [req("x", 2)], "e2": [req("y", 2)]})
    assert r.policy_state()["kv_room.held_tokens"] == 1472 + 2 * 128
    d = r.route(req("t3", 21, trunk))  # needs 64 tokens more on e0 (1,536 <= 1,600): stays with its cached trunk
    assert d.target == "e0" and d.branch == LEAST_WORK
    assert r.policy_state()["kv_room.held_tokens"] == 1536 + 2 * 128
    for rid in ("t0", "t1", "t2", "x"):
        r.on_finish(rid)
    assert r.policy_state()["kv_room.held_tokens"] == 1344 + 128  # t3 still holds the trunk and its own block


def test_when_no_replica_has_room_every_one_stays_a_candidate(router_for):
    r = router_for("auto", 2, **KV)
    decoding(r, {"e0": [req("a", 24)], "e1": [req("b", 11), req("c", 11)]})
    d = r.route(req("big", 7))  # fits nowhere (1,984 and 1,856 > 1,600): the least work decides alone
    assert d.kind == DecisionKind.DISPATCH and d.branch == LEAST_WORK and d.target == "e0"
