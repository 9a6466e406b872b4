"""The policy interface and the pipeline every preset runs.

``Policy.decide`` is the whole pipeline: hard filters (health, circuit, residency zone, the
request's excluded endpoints), then admission (selective pushing: which endpoints may take a
request *now*; none → hold in the LB queue), then ``choose`` (every preset is a
:class:`~kvroute.policy.compose.Pipeline`: its filters, then its rules). A policy never
performs I/O and never reads a clock: everything it needs arrives in the :class:`View`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.admission import Admission, make_admission
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.params import PolicyParams
from kvroute.policy.selection import argmax, argmin, decide, hard_filter, softmax_pick
from kvroute.prefix import HashRing, PrefixIndex

__all__ = ["Policy", "PolicyParams", "View", "argmax", "argmin", "hard_filter", "softmax_pick"]


@dataclass(slots=True)
class View:
    """Read-only state a policy decides on; produced by the gateway or the simulator."""

    endpoints: list[Endpoint]
    prefix: PrefixIndex
    ring: HashRing
    local_queue: int = 0  # requests waiting in this LB's own queue (the peer gate compares)
    # the peer load balancers this LB may forward a held request to, as its peer Router sees them
    # (their last status: queue, available replicas); empty without peers (the forward gate reads it)
    peers: list[Endpoint] = field(default_factory=list)


class Policy(ABC):
    """A routing policy: ``decide`` maps a request and a :class:`View` to a :class:`Decision`.

    Every preset is a :class:`~kvroute.policy.compose.Pipeline` built by
    :func:`~kvroute.policy.registry.build_policy`; subclassing this directly (implementing
    ``choose``) still works for a policy that is not a composition of plugins.
    """

    name: str = ""
    source: str = ""  # paper or repository the behaviour comes from
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    uses_ring: bool = False  # the Router must keep its consistent-hash ring filled
    # plugins subscribed to request-lifecycle events (empty: the Router's hooks cost nothing)
    listeners: tuple[Lifecycle, ...] = ()
    inputs: frozenset[str] = frozenset()  # what its plugins read (kvroute.policy.plugins.INPUTS)

    @property
    def reads_kv_usage(self) -> bool:
        """Whether scoring reads ``Endpoint.kv_usage`` (lets a simulated probe skip it)."""
        return "kv_usage" in self.inputs

    @property
    def reads_prefill_backlog(self) -> bool:
        """Whether scoring reads ``Endpoint.queued_prefill_tokens``, the only counter that
        ``Router.on_first_token`` changes (lets the simulator skip that event for the others)."""
        return "prefill_backlog" in self.inputs

    def context_limit(self, endpoint_id: str) -> int | None:
        """Largest sequence length (prompt + generated tokens) ``endpoint_id``'s stage serves;
        a stream growing past it migrates to a later stage (CascadeInfer §3.2). None: no limit."""
        return None

    def __init__(self, params: PolicyParams | None = None, seed: int = 0):
        self.params = params if params is not None else self.Params()
        self.rng = random.Random(seed)
        self.admission: Admission = make_admission(self.params)

    def decide(self, req: Request, view: View, dry_run: bool = False) -> Decision:
        """Filter, admit, then ``choose``: a dispatch, a hold (no endpoint admits the request
        now: keep it queued), or none (nothing can serve it; ``reason`` says why). Never raises:
        a policy bug becomes a ``policy-error`` decision. Changes no state: what the plugins'
        state should become comes back in ``Decision.effects``; ``dry_run`` also leaves the
        random generators as they were (tie-breaks draw from copies). The steps are
        :func:`kvroute.policy.selection.decide` (compiled in the compiled build)."""
        return decide(self, req, view, dry_run)

    @abstractmethod
    def choose(self, req: Request, eps: list[Endpoint], view: View, dry_run: bool = False) -> Decision:
        """Score, combine and pick among the admitted endpoints ``eps`` (never empty); state
        changes go into ``Decision.effects``, and a ``dry_run`` draws from copies of the random
        generators."""
