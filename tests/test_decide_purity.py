"""Router.decide is a dry run (issue 18): deciding — once or twice — changes no counter, index,
plugin state or random generator, and what it decides is what route then does."""

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.model import Endpoint
from kvroute.policy import PRESETS, Router, build_policy
from tests.conftest import make_request

TEXTS = ["system prompt A " * 40, "system prompt B " * 40, "another topic " * 30, "short"]


def snapshot(router: Router) -> bytes:
    """Everything a decision could touch: endpoints, tickets, prefix index, ring, the policy with its
    plugins and random generators."""
    return pickle.dumps((router.endpoints, router.tickets, router.prefix, router.ring, router.policy))


events = st.lists(st.tuples(st.sampled_from(["route", "first", "finish", "probe"]), st.integers(0, 3),
                            st.integers(0, 50)), min_size=0, max_size=30)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=events, probe=st.integers(0, 3), text=st.integers(0, 3))
def test_deciding_twice_changes_nothing_and_route_does_what_decide_said(preset, history, probe, text):
    router = Router(build_policy(preset, seed=3), [Endpoint(f"e{i}", kv_blocks=2000, max_running=8)
                                                   for i in range(4)])
    live: list[str] = []
    for n, (kind, i, v) in enumerate(history):  # bring the router and its plugins into some state
        if kind == "route":
            req = make_request(f"h{n}", TEXTS[i] + str(v % 3))
            if router.route(req).dispatched:
                live.append(req.id)
        elif kind == "first" and live:
            router.on_first_token(live[i % len(live)], ttft_s=0.01 * (v + 1))
        elif kind == "finish" and live:
            router.on_finish(live.pop(i % len(live)), e2e_s=0.1 * (v + 1), output_tokens=v)
        elif kind == "probe":
            ep = router.endpoints[i]
            ep.running, ep.waiting, ep.dispatched_since_probe = v % 9, v // 9, 0
    router.endpoints[probe].kv_usage = 0.5
    req = make_request("q", TEXTS[text] + "tail")
    before = snapshot(router)
    first = router.decide(req)
    assert snapshot(router) == before
    second = router.decide(req)
    assert snapshot(router) == before
    assert (second.kind, second.target, second.branch) == (first.kind, first.target, first.branch)
    routed = router.route(req)
    assert (routed.kind, routed.target, routed.branch) == (first.kind, first.target, first.branch)
