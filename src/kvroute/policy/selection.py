"""The steps of every decision that do not depend on the preset: the hard filter, the order of
``Policy.decide`` (filter, admit, choose), and the pickers' arithmetic (argmin, argmax, softmax).

They live apart from :mod:`kvroute.policy.base` so that the optional compiled build can compile
them (kvroute/buildinfo.py, docs/compiled.md): base.py holds the ``Policy`` class, whose class
attributes presets override and which therefore stays interpreted, while these functions run on
every decision of the simulator and of the gateway (issue 25's fourth round, docs/hot-path.md).
base.py re-exports them; importing them from there keeps working. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

from kvroute.model import Branch, Decision, Endpoint, Request
from kvroute.policy.admission import Admission


class Deciding(Protocol):
    """What :func:`decide` reads of a ``Policy`` (policy/base.py, which imports this module)."""

    name: str
    admission: Admission

    def choose(self, req: Request, eps: list[Endpoint], view: Any, dry_run: bool = False) -> Decision:
        """The preset's own step (``Policy.choose``)."""


class Viewing(Protocol):
    """What :func:`decide` reads of a ``View`` (policy/base.py)."""

    endpoints: list[Endpoint]
    local_queue: int
    peers: list[Endpoint]


def decide(policy: Deciding, req: Request, view: Viewing, dry_run: bool = False) -> Decision:
    """``Policy.decide``'s steps: hard filters, admission, then ``policy.choose``; a dispatch, a
    hold or none, never an exception (a policy bug becomes a ``policy-error`` decision)."""
    if not view.endpoints:
        return Decision.none("no endpoints configured")
    if req.prompt_tokens <= 0 and not req.block_hashes:  # not req.has_prompt, inlined (hot path)
        return Decision.none("request has no prompt or messages", branch=Branch.BAD_REQUEST)
    eps = hard_filter(req, view.endpoints)
    if not eps:
        usable = routable_in_zone(req, view.endpoints) if req.exclude else []
        if usable:  # healthy replicas exist: name why none is used, not "unhealthy"
            return Decision.none(f"every healthy endpoint is excluded for this request "
                                 f"({', '.join(sorted(e.id for e in usable))}: it failed there already, "
                                 "or they do not serve its model)", branch=Branch.ALL_FILTERED)
        zone = req.residency
        why = f"outside residency zone {zone!r}, " if zone else ""
        return Decision.none(f"every endpoint was filtered out ({why}unhealthy or circuit open)",
                             branch=Branch.ALL_FILTERED)
    # peers a held request could be forwarded to (a forwarded one never goes on)
    peers = hard_filter(req, view.peers) if view.peers and not req.from_peer else ()
    admission = policy.admission
    # blind pushing (the base class, never held) admits every endpoint: no interpreted call for it
    ready = eps if admission.__class__ is Admission else admission.ready(eps, view.local_queue, peers)
    if not ready:
        return Decision.hold(f"no endpoint admits a request now ({admission.name})")
    try:
        return policy.choose(req, ready, view, dry_run)
    except Exception as exc:  # a policy bug must not take the router down with it
        return Decision.none(f"policy {policy.name} failed: {exc!r}", branch=Branch.POLICY_ERROR)


def routable_in_zone(req: Request, eps: list[Endpoint]) -> list[Endpoint]:
    """The healthy endpoints of ``eps`` with the circuit closed, inside the request's residency
    zone (``Endpoint.routable``, written out: this runs per decision)."""
    zone = req.residency
    if zone is None:
        return [e for e in eps if e.healthy and not e.circuit_open]
    return [e for e in eps if e.healthy and not e.circuit_open and e.zone == zone]


def hard_filter(req: Request, eps: list[Endpoint]) -> list[Endpoint]:
    """The endpoints of ``eps`` any decision may consider: healthy with the circuit closed, inside
    the request's residency zone, not excluded for it (failed it, or do not serve its model). The
    one place these are written: ``Policy.decide`` and the peer decisions
    (:mod:`kvroute.policy.peering`) apply it."""
    out = routable_in_zone(req, eps)
    if req.exclude:
        out = [e for e in out if e.id not in req.exclude]
    return out


def argmin(eps: list[Endpoint], values: Sequence[float], rng: random.Random) -> Endpoint:
    """Endpoint with the smallest value; ties broken at random (never "first wins")."""
    best = min(values)
    if best == best and values.count(best) == 1:  # a unique minimum (not NaN): no tie to break
        return eps[values.index(best)]
    ties = [e for e, v in zip(eps, values) if v == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def argmax(eps: list[Endpoint], values: Sequence[float], rng: random.Random) -> Endpoint:
    """Endpoint with the largest value; ties broken at random."""
    best = max(values)
    if best == best and values.count(best) == 1:
        return eps[values.index(best)]
    ties = [e for e, v in zip(eps, values) if v == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def softmax_pick(eps: list[Endpoint], logits: Sequence[float], temperature: float,
                 rng: random.Random) -> Endpoint:
    """Sample with probability ∝ exp(logit / T) (higher logit = better)."""
    top = max(logits)
    weights = [math.exp((v - top) / temperature) for v in logits]
    return rng.choices(eps, weights=weights, k=1)[0]
