"""The plugin protocols a policy is composed of, and the per-decision state they share.

Modelled on llm-d's inference scheduler (filters narrow the candidates, scorers rate them, a
picker chooses; data producers run apart from scorers) with kvroute's own twist: a *rule* is a
named branch ("imbalanced", "hit ratio ≥ τ") that either routes the request or lets the next
rule try, so a preset reads like its paper's pseudocode. Every plugin is pure: it sees the
request, the endpoints and a :class:`DecisionState`, never a clock or a socket. Deciding changes
no state: a plugin whose state follows its decisions (a round-robin cursor, a detector's window)
hands the change to :meth:`DecisionState.defer`, and the Router applies it when it commits the
dispatch (``Router.route``); ``Router.decide``, a dry run, drops it and draws from copies of the
random generators.

* :class:`Filter` — ``filter(st, eps) -> eps``: drop candidates (hard filters, or a rule's
  ``among``, e.g. "the endpoints holding the longest prefix").
* :class:`Scorer` — ``values(st, eps) -> list[float]``: one number per endpoint, with the inputs
  it reads declared (``inputs``), so runtimes know what to keep fresh. In a weighted ``score``
  combination each scorer's output is normalised to [0, 1], higher is better.
* :class:`Condition` — ``holds(st, eps) -> bool``: when a rule applies.
* :class:`Picker` — ``pick(st, eps, values) -> Endpoint | None``: choose one (None: this rule
  cannot choose; the next rule tries).
* :class:`Route` — a whole rule in code, for the few that are not condition → score → pick
  (``route(st, eps) -> Decision | None``).

A plugin that also subclasses :class:`~kvroute.policy.hooks.Lifecycle` hears what happened to
the requests it routed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from kvroute.model import Decision, Endpoint
from kvroute.policy.state import DecisionState, copy_of

__all__ = ["INPUTS", "KINDS", "Condition", "DecisionState", "Filter", "Picker", "Plugin", "Route", "Scorer",
           "check_inputs", "copy_of"]

# what a scorer, filter or condition may read besides the request (its declared inputs)
INPUTS = {
    "prefix": "the prefix index: blocks of the prompt cached per endpoint",
    "prefill_backlog": "Endpoint.queued_prefill_tokens (changed by Router.on_first_token)",
    "kv_usage": "Endpoint.kv_usage (probed)",
    "load": "router-side and probed load counters (in-flight, batch size)",
    "rtt": "Endpoint.rtt_s (probed)",
    "ring": "the consistent-hash ring",
}


class Plugin(ABC):  # noqa: B024 (each kind below declares its abstract method)
    """Common base: a registered name, a kind, the inputs it reads, and a one-line summary. Each
    kind's method is abstract, and :func:`~kvroute.policy.catalog.register_plugin` checks the
    declared inputs (:data:`INPUTS`): the runtimes keep fresh only what some plugin declares."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""
    inputs: frozenset[str] = frozenset()  # keys of INPUTS (an instance may widen its class's)
    uses_ring: ClassVar[bool] = False  # the Router must keep its hash ring filled
    config: Any = None  # the arguments it was configured with (set by the compiler)

    @classmethod
    def summary(cls) -> str:
        """The first line of the plugin's docstring."""
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def describe(self) -> str:
        """How this instance is configured, for ``kvroute policies``: its name, then its
        arguments as the preset gave them (parameters resolved)."""
        args = self.config
        if args is None:
            return self.name
        if isinstance(args, dict):
            return f"{self.name}({', '.join(f'{k}={v}' for k, v in args.items())})"
        return f"{self.name}({args})"


class Filter(Plugin):
    """Keeps the candidates that pass; never empties the pool on its own unless it must."""

    kind = "filter"

    @abstractmethod
    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The endpoints of ``eps`` that pass (a new list, or ``eps`` itself when all pass)."""
        ...


class Scorer(Plugin):
    """One number per endpoint; ``lower_is_better`` says which way is good."""

    kind = "scorer"
    lower_is_better: ClassVar[bool] = True

    @abstractmethod
    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The raw quantity per endpoint (tokens, requests, seconds, a cost)."""
        ...

    def normalised(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The quantity mapped to [0, 1], higher is better (min-max over ``eps`` by default;
        all equal → all 1)."""
        values = self.values(st, eps)
        lo, hi = min(values), max(values)
        if hi == lo:
            return [1.0] * len(values)
        span = hi - lo
        if self.lower_is_better:
            return [(hi - v) / span for v in values]
        return [(v - lo) / span for v in values]


class Condition(Plugin):
    """When a rule applies."""

    kind = "condition"

    @abstractmethod
    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """Whether the rule applies to this request over the candidates ``eps``."""
        ...


class Picker(Plugin):
    """Chooses one endpoint from the candidates and their combined values."""

    kind = "picker"
    needs_values: ClassVar[bool] = True  # whether it reads the scorers' values at all
    # what lower values mean to it: True for argmin-like pickers (costs), False for argmax-like
    minimises: ClassVar[bool] = True

    @abstractmethod
    def pick(self, st: DecisionState, eps: list[Endpoint], values: Sequence[float]) -> Endpoint | None:
        """The chosen endpoint, or None when this picker cannot choose (the next rule tries)."""
        ...


class Route(Plugin):
    """A whole rule in code: decide, or return None to let the next rule try."""

    kind = "route"

    @abstractmethod
    def route(self, st: DecisionState, eps: list[Endpoint]) -> Decision | None:
        """A dispatch decision over ``eps``, or None when this rule does not apply."""
        ...


KINDS: dict[str, type[Plugin]] = {c.kind: c for c in (Filter, Scorer, Condition, Picker, Route)}


def check_inputs(owner: str, inputs: frozenset[str]) -> None:
    """ValueError unless every declared input is one of :data:`INPUTS` (a misspelt one would let
    the simulator skip the probe or event that keeps it fresh)."""
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise ValueError(f"{owner}: unknown input(s) {', '.join(unknown)}; inputs: {', '.join(INPUTS)}")

