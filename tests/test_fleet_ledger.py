"""The fleet ledger (pure): a sibling's dispatches mirrored into this instance's Router — counters,
prefix index, prefill backlog — undone on free, repaired by snapshots, forgotten on silence or
restart; malformed messages change nothing."""

from __future__ import annotations

import pytest

from kvroute.fleet.ledger import (
    PEER,
    REPLICA,
    BadMessage,
    Ledger,
    add_message,
    decode,
    encode,
    simple_message,
    snapshot_message,
)
from kvroute.model import Endpoint, EndpointKind, Request
from kvroute.policy import Router, build_policy

HASHES = (11, 22, 33, 44)


def routers():
    rep = Router(build_policy("least_request"), [Endpoint("r0"), Endpoint("r1")])
    peer = Router(build_policy("least_request"), [Endpoint("eu", kind=EndpointKind.PEER)])
    return {REPLICA: rep, PEER: peer}


def sibling_dispatch(rs, rid="q1", ep="r1", tokens=256, layer=REPLICA):
    """What instance A does: route locally, then the add message it publishes."""
    rs[layer].commit(Request(rid, block_hashes=HASHES, block_tokens=64, prompt_tokens=tokens), ep)
    return add_message("A", 0, rid, rs[layer].tickets[rid], 64, layer)


def test_add_prefill_free_mirror_the_siblings_accounting():
    a, b = routers(), routers()
    ledger = Ledger("B", b, timeout_s=3.0)
    msg = decode(encode(sibling_dispatch(a)))
    assert ledger.apply(msg, now=0.0).added == ("r1", HASHES)  # the runtime speculates it into an event table
    r1 = b[REPLICA].endpoint("r1")
    assert (r1.inflight, r1.inflight_tokens, r1.queued_prefill_tokens, r1.dispatched_since_probe) == (1, 256, 256, 1)
    assert b[REPLICA].prefix.match_one("r1", HASHES) == 4  # the sibling's prompt is in our index too
    ledger.apply(simple_message("prefill", "A", 1, id="q1"), 0.1)
    assert r1.queued_prefill_tokens == 0 and r1.inflight == 1
    out = ledger.apply(simple_message("free", "A", 2, id="q1", ok=True), 0.2)
    assert out.freed and r1.inflight == 0 and r1.inflight_tokens == 0
    assert b[REPLICA].prefix.match_one("r1", HASHES) == 4  # served: the engine holds the prefix
    assert ledger.mirrored() == 0


def test_a_failed_dispatch_leaves_the_index_as_locally():
    a, b = routers(), routers()
    ledger = Ledger("B", b, 3.0)
    ledger.apply(sibling_dispatch(a), 0.0)
    ledger.apply(simple_message("free", "A", 1, id="q1", ok=False), 0.1)
    assert b[REPLICA].prefix.match_one("r1", HASHES) == 0


def test_listeners_never_hear_mirrored_requests():
    heard = []

    class Spy:
        name = "spy"

        def on_dispatched(self, *a):
            heard.append(a)

        on_first_token = on_finished = on_failed = on_dispatched

        def state(self):
            return {}

    a, b = routers(), routers()
    b[REPLICA].policy.listeners = (Spy(),)
    ledger = Ledger("B", b, 3.0)
    ledger.apply(sibling_dispatch(a), 0.0)
    ledger.apply(simple_message("free", "A", 1, id="q1", ok=True), 0.1)
    assert heard == []


def test_own_messages_are_ignored_and_a_redispatch_moves_the_load():
    a, b = routers(), routers()
    ledger = Ledger("A", b, 3.0)
    ledger.apply(sibling_dispatch(a), 0.0)
    assert b[REPLICA].endpoint("r1").inflight == 0
    ledger = Ledger("B", b, 3.0)
    ledger.apply(sibling_dispatch(a, ep="r1"), 0.0)
    a[REPLICA].on_finish("q1")
    moved = sibling_dispatch(a, ep="r0")
    moved["s"] = 1
    ledger.apply(moved, 0.1)
    assert (b[REPLICA].endpoint("r0").inflight, b[REPLICA].endpoint("r1").inflight) == (1, 0)


def test_snapshot_repairs_lost_messages_and_counts_the_gap():
    a, b = routers(), routers()
    ledger = Ledger("B", b, 3.0)
    ledger.apply(sibling_dispatch(a, "q1", "r1"), 0.0)  # its free will be lost
    a[REPLICA].on_finish("q1")
    a[REPLICA].commit(Request("q2", prompt_tokens=100, block_tokens=64), "r0")  # its add is lost
    snap = snapshot_message("A", 5, a, [("q2", REPLICA)], queue=3, queued_tokens=900)
    out = ledger.apply(snap, 0.5)
    assert out.gap == 4 and out.freed
    assert (b[REPLICA].endpoint("r0").inflight, b[REPLICA].endpoint("r1").inflight) == (1, 0)
    assert b[REPLICA].endpoint("r0").queued_prefill_tokens == 100
    assert ledger.queue() == 3 and ledger.queued_tokens() == 900
    a[REPLICA].on_first_token("q2")  # prefill done, message lost: the next snapshot says so
    ledger.apply(snapshot_message("A", 6, a, [("q2", REPLICA)], 0, 0), 0.6)
    assert b[REPLICA].endpoint("r0").queued_prefill_tokens == 0 and b[REPLICA].endpoint("r0").inflight == 1


def test_silent_or_restarted_siblings_are_forgotten():
    a, b = routers(), routers()
    ledger = Ledger("B", b, timeout_s=1.0)
    ledger.apply(sibling_dispatch(a), 0.0)
    assert ledger.expire(0.9) == []
    assert ledger.expire(1.5) == [("A", 1)]
    assert b[REPLICA].endpoint("r1").inflight == 0 and not ledger.siblings
    ledger.apply(sibling_dispatch(a, "q9"), 2.0)
    assert b[REPLICA].endpoint("r1").inflight == 1
    out = ledger.apply(simple_message("hello", "A", 0), 2.1)  # a new process under the same name
    assert out.restarted and out.wants_snapshot and b[REPLICA].endpoint("r1").inflight == 0
    ledger.apply(sibling_dispatch(a, "q10"), 2.2)
    assert ledger.apply(simple_message("bye", "A", 1), 2.3).freed  # stopping: forgotten at once
    assert not ledger.siblings and b[REPLICA].endpoint("r1").inflight == 0


def test_peer_layer_and_unknown_endpoints():
    a, b = routers(), routers()
    ledger = Ledger("B", b, 3.0)
    ledger.apply(sibling_dispatch(a, layer=PEER, ep="eu"), 0.0)
    assert b[PEER].endpoint("eu").inflight == 1
    b2 = {REPLICA: Router(build_policy("least_request"), [Endpoint("r0")]), PEER: b[PEER]}
    out = Ledger("B", b2, 3.0).apply(sibling_dispatch(a, "q5", "r1"), 0.0)
    assert out.skipped == "r1" and b2[REPLICA].endpoint("r0").inflight == 0


@pytest.mark.parametrize("raw", [
    b"not json", b"[1, 2]", b'{"t": "add"}', b'{"t": "add", "o": "A", "s": -1}',
    b'{"t": "add", "o": "A", "s": 0, "id": "x", "ep": "r0", "tok": 10, "m": 0, "bt": 64, "h": ["a"]}',
    b'{"t": "add", "o": "A", "s": 0, "id": "x", "ep": "r0", "tok": 10, "m": 0, "bt": 64, "h": [], "l": "moon"}',
    b'{"t": "snap", "o": "A", "s": 0, "q": 0, "qt": 0, "r": [["x", "r0", -5, 0, "replica"]]}',
    b'{"t": "teleport", "o": "A", "s": 0}',
])
def test_malformed_messages_change_nothing(raw):
    b = routers()
    ledger = Ledger("B", b, 3.0)
    with pytest.raises(BadMessage):
        ledger.apply(decode(raw), 0.0)
    assert not ledger.siblings and all(e.inflight == 0 for e in b[REPLICA].endpoints)
