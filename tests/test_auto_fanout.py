"""auto's decode term on traffic that fans out (``decode_fanout``, docs/auto.md session 14): a real Router with the
``auto`` preset and three endpoints, driven through its own lifecycle calls (commit, first token, finish)."""

from kvroute.policy.presets.auto import LEAST_WORK
from tests.conftest import make_request


def _setup(router, req) -> None:
    """a caches 16 of the request's 18 blocks and decodes twelve answers of this LB; c decodes one; b is idle."""
    a, b, c = router.view.endpoints
    router.prefix.insert(a.id, req.block_hashes[:-2])
    for i in range(12):
        router.commit(make_request(f"a{i}", f"other {i} " * 40), a.id)
    router.commit(make_request("c0", "other c " * 40), c.id)
    for rid in [f"a{i}" for i in range(12)] + ["c0"]:
        router.on_first_token(rid, 0.4)


def _answer_then(router, key: str, children: int, n: int) -> None:
    """One answer of program ``key`` ends on c, then ``children`` requests of that program are dispatched at once (to
    c: in a Router without probes LMetric's batch counts every dispatch since the last probe, which would take b out
    of the trust region)."""
    c = router.view.endpoints[2].id
    router.commit(make_request(f"{key}-p{n}", f"{key} parent {n} " * 20, key=key), c)
    router.on_first_token(f"{key}-p{n}", 0.2)
    router.on_finish(f"{key}-p{n}", 2.0, 50)
    rids = [f"{key}-c{n}-{j}" for j in range(children)]
    for j, rid in enumerate(rids):  # sent together, before any of them answers
        router.commit(make_request(rid, f"{key} child {n} {j} " * 20, key=key), c)
    for rid in rids:
        router.on_first_token(rid, 0.2)
        router.on_finish(rid, 2.0, 50)


def test_auto_decode_term_acts_only_once_this_lb_has_seen_programs_fan_out(router_for):
    """By default the decode term (a prefill counted once more per answer decoding where it would run) is on but gated:
    it acts only while at least a quarter of this LB's dispatches were fan-outs (a program's second or later request
    sent on one answer, as a tree's children are). Conversations — one request per answer — leave the pick to the
    least work (the cache); enough tree nodes turn the term on."""
    req = make_request("turn2", "hello " * 800)  # 18 blocks, 1,204 tokens
    router = router_for("auto", 3)
    _setup(router, req)  # 13 dispatches without a routing key
    # nothing followed yet: the least work keeps the request with its cache (a: 180 uncached, b and c 1,204)
    d = router.decide(req)
    assert (d.branch, d.target) == (LEAST_WORK, "e0")
    assert router.policy_state()["decoding_uncached.on"] == 0
    for n in range(4):  # four conversations' turns: each answer is followed by one request of its program
        _answer_then(router, f"chat{n}", 1, n)
    state = router.policy_state()  # 21 dispatches, 4 of them follow-ups, none a fan-out
    assert (state["decoding_uncached.followed"], state["decoding_uncached.fanned"]) == (4, 0)
    assert state["decoding_uncached.on"] == 0 and router.decide(req).target == "e0"
    for n in range(2):  # two tree nodes answer, four children each: 3 fan-outs a node
        _answer_then(router, f"tree{n}", 4, n)
    state = router.policy_state()  # 6 fan-outs of 31 dispatches: under a quarter
    assert (state["decoding_uncached.followed"], state["decoding_uncached.fanned"]) == (12, 6)
    assert state["decoding_uncached.on"] == 0 and router.decide(req).target == "e0"
    _answer_then(router, "tree2", 4, 0)  # 9 of 36: a quarter — the term acts
    assert router.policy_state()["decoding_uncached.on"] == 1
    # with the term: a 180 + 12 x 180 = 2,340 after b's 1,204 (no answer decoding there) — the request leaves its
    # cache for the replica where no answer waits on its prefill
    d = router.decide(req)
    assert (d.branch, d.target) == (LEAST_WORK, "e1")
    for i in range(12):  # a's answers are done: nothing decodes there, the request stays with its cache
        router.on_finish(f"a{i}", 5.0, 100)
    assert router.policy_state()["decoding_uncached.on"] == 1 and router.decide(req).target == "e0"


def test_auto_a_conversation_s_consecutive_turns_are_not_a_fan_out(router_for):
    """A conversation alone on the LB sends each turn when the previous answer ended, with no other dispatch between:
    every turn after the first is a follow-up, none a fan-out (the turn before it was answered in between)."""
    router = router_for("auto", 3)
    e = router.view.endpoints[0].id
    for t in range(6):
        router.commit(make_request(f"t{t}", f"turn {t} " * 20, key="alice"), e)
        router.on_first_token(f"t{t}", 0.2)
        router.on_finish(f"t{t}", 2.0, 50)
    state = router.policy_state()
    assert (state["decoding_uncached.followed"], state["decoding_uncached.fanned"], state["decoding_uncached.on"]) \
        == (5, 0, 0)


def test_auto_decode_term_without_the_fanout_gate_acts_on_any_traffic(router_for):
    """``decode_fanout: false`` is session 10's term as it was: on from the first answer decoding, whatever follows."""
    req = make_request("turn2", "hello " * 800)
    router = router_for("auto", 3, params={"decode_fanout": False})
    _setup(router, req)
    assert router.decide(req).target == "e1"
    off = router_for("auto", 3, params={"decode_prefill": 0.0})
    _setup(off, req)
    assert off.decide(req).target == "e0"
