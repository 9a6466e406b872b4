"""auto's online selector (policy/adaptive/selector): which rule it keeps, and its guard."""

from __future__ import annotations

import pytest

from kvroute.policy.adaptive.selector import A, B, TTFTSelector


class _Req:
    def __init__(self, rid):
        self.id = rid


class _St:
    """The part of a DecisionState the selector reads, with Router.route's commit of its deferred
    state changes."""

    def __init__(self, rid):
        self.req = _Req(rid)
        self.effects = []

    def defer(self, effect):
        self.effects.append(effect)


def drive(sel: TTFTSelector, ttft, e2e, n: int, start: int = 0) -> list[int]:
    """n requests: ask, dispatch, answer at once with the arm's TTFT and E2E; returns the arms that served."""
    arms = []
    for i in range(start, start + n):
        rid = f"r{i}"
        st = _St(rid)
        arm = A if sel.holds(st, []) else B
        arms.append(arm)
        for effect in st.effects:  # the dispatch is committed
            effect()
        sel.on_dispatched(_Req(rid), None, 0)
        sel.on_first_token(rid, "e", ttft[arm])
        sel.on_finished(rid, "e", e2e[arm], 10)
    return arms


def test_the_selector_measures_both_rules_then_keeps_the_faster():
    sel = TTFTSelector(window=8, exploit=2)
    arms = drive(sel, {A: 0.5, B: 0.2}, {A: 5.0, B: 5.0}, 16)
    assert arms == [A] * 8 + [B] * 8  # one block each
    assert drive(sel, {A: 0.5, B: 0.2}, {A: 5.0, B: 5.0}, 8, 16) == [B] * 8  # B was faster: kept
    assert sel.state()["wins_other"] == 1
    # after `exploit` blocks both are measured again; now A is faster, and wins
    later = drive(sel, {A: 0.1, B: 0.9}, {A: 5.0, B: 5.0}, 40, 24)
    assert A in later[:16] and later[-8:] == [A] * 8


def test_the_guard_refuses_a_faster_first_token_bought_with_slower_answers():
    sel = TTFTSelector(window=8, exploit=2, e2e_slack=0.1)
    drive(sel, {A: 0.1, B: 0.3}, {A: 20.0, B: 5.0}, 16)  # A: best TTFT, 4× the end-to-end latency
    assert drive(sel, {A: 0.1, B: 0.3}, {A: 20.0, B: 5.0}, 8, 16) == [B] * 8


# TTFT and E2E latency each rule's requests measure → the rule served after one exploration round
ROUNDS = [
    pytest.param({A: 0.5, B: 0.2}, {A: 5.0, B: 5.0}, 0.1, B, id="the-other-rule-is-faster"),
    pytest.param({A: 0.2, B: 0.5}, {A: 5.0, B: 5.0}, 0.1, A, id="the-guarded-rule-is-faster"),
    pytest.param({A: 0.3, B: 0.3}, {A: 5.0, B: 5.0}, 0.1, A, id="a-tie-keeps-the-guarded-rule"),
    pytest.param({A: 0.1, B: 0.3}, {A: 20.0, B: 5.0}, 0.1, B, id="guard-refuses-fast-first-tokens-slow-answers"),
    pytest.param({A: 0.1, B: 0.3}, {A: 5.4, B: 5.0}, 0.1, A, id="within-the-e2e-slack"),
    pytest.param({A: 0.1, B: 0.3}, {A: 5.4, B: 5.0}, 0.05, B, id="beyond-a-tighter-slack"),
]


@pytest.mark.parametrize(("ttft", "e2e", "slack", "kept"), ROUNDS)
def test_the_rule_kept_after_one_round(ttft, e2e, slack, kept):
    sel = TTFTSelector(window=8, exploit=2, e2e_slack=slack)
    assert drive(sel, ttft, e2e, 16) == [A] * 8 + [B] * 8  # one block each
    assert drive(sel, ttft, e2e, 16, 16) == [kept] * 16  # the winner serves `exploit` blocks
    assert sel.state()["rounds"] == 1
    assert sel.state()["wins_guarded" if kept == A else "wins_other"] == 1


@pytest.mark.parametrize(("window", "exploit"), [(7, 8), (64, 0)])
def test_bad_settings_are_refused(window, exploit):
    with pytest.raises(ValueError, match="window must be"):
        TTFTSelector(window=window, exploit=exploit)
