"""A term weighted 0 is left out when a preset compiles (policy/compiler.py): not scored, its lifecycle hooks not
called — and every decision is the one the composition with the term kept makes (issue 25: auto's
``waiting_uncached``, weight ``behind_prefill`` = 0 by default, was scored and counted on every request)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as hs

from kvroute.model import Endpoint
from kvroute.policy import Router
from kvroute.policy.builtin.scorers import WaitingUncached
from kvroute.policy.compiler import compile_preset, parse_params
from kvroute.policy.compose import Pipeline, Rule
from kvroute.policy.registry import PRESETS, preset_from_mapping
from tests.conftest import make_request


def _kept(policy: Pipeline, seed: int) -> Pipeline:
    """``policy`` with a fresh ``waiting_uncached`` weighted 0 added to every cost rule: the composition as
    it compiled before zero-weight terms were dropped."""
    rules = []
    for r in policy.rules:
        if r.picker is not None and r.scorers and not r.normalised:
            z = WaitingUncached()
            r = Rule(r.branch, r.when, r.among, (*r.scorers, (z, 0.0)), r.normalised, r.picker, r.route,
                     (*r.plugins, z))
        rules.append(r)
    return Pipeline(policy.preset, policy.params, seed, policy.filters, tuple(rules))


def test_auto_compiles_without_its_zero_weight_term():
    policy = compile_preset(PRESETS["auto"], parse_params(PRESETS["auto"], None))
    assert all(w != 0 for r in policy.rules for _, w in r.scorers)
    assert not any(isinstance(p, WaitingUncached) for p in (*policy.plugins, *policy.listeners))
    on = compile_preset(PRESETS["auto"], parse_params(PRESETS["auto"], {"behind_prefill": 1.0}))
    assert any(isinstance(p, WaitingUncached) for p in on.listeners)  # a weight other than 0 keeps it


def test_terms_all_weighted_zero_still_compile_and_pick_as_before():
    preset = preset_from_mapping({"name": "zeros", "cost": {"inflight": 0, "queue": 0}}, "test")
    policy = compile_preset(preset, parse_params(preset, None))
    assert policy.rules[0].scorers == () and policy.rules[0].picker is not None


def _drive(router: Router, ops: list[tuple[int, int, int]]) -> list[str | None]:
    """Route a request per op (prompt family, length, what happens next), with first tokens, ends and
    failures as the op says; the targets chosen."""
    targets = []
    live: list[str] = []
    for i, (family, words, then) in enumerate(ops):
        req = make_request(f"r{i}", f"family {family} " + "word " * words)
        targets.append(router.route(req).target)
        if targets[-1] is not None:
            live.append(req.id)
        if live and then % 4 == 1:
            router.on_first_token(live[0], 0.01 * (then % 7))
        elif live and then % 4 == 2:
            router.on_finish(live.pop(0), 0.5, 16)
        elif live and then % 4 == 3:
            router.on_failed(live.pop())
    return targets


@settings(max_examples=25, deadline=None)
@given(ops=hs.lists(hs.tuples(hs.integers(0, 5), hs.integers(1, 400), hs.integers(0, 11)), min_size=1,
                    max_size=60),
       seed=hs.integers(0, 2**16), presets=hs.sampled_from(["auto", "gorgo", "dynamo_kv", "least_request"]))
def test_decisions_are_those_of_the_composition_with_the_zero_term_kept(ops, seed, presets):
    rng = random.Random(seed)
    loads = [(rng.randrange(4), rng.random()) for _ in range(4)]
    routers = []
    for build in (lambda p, s: p, _kept):
        policy = build(compile_preset(PRESETS[presets], parse_params(PRESETS[presets], None), seed), seed)
        eps = [Endpoint(f"e{i}") for i in range(4)]
        for ep, (waiting, kv) in zip(eps, loads):
            ep.apply_probe(1, waiting, kv)
        routers.append(Router(policy, eps))
    assert _drive(routers[0], ops) == _drive(routers[1], ops)
