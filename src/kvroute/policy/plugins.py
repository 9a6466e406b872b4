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

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvroute.model import Decision, Endpoint, Request

if TYPE_CHECKING:
    from kvroute.policy.base import View

# what a scorer, filter or condition may read besides the request (its declared inputs)
INPUTS = {
    "prefix": "the prefix index: blocks of the prompt cached per endpoint",
    "prefill_backlog": "Endpoint.queued_prefill_tokens (changed by Router.on_first_token)",
    "kv_usage": "Endpoint.kv_usage (probed)",
    "load": "router-side and probed load counters (in-flight, batch size)",
    "rtt": "Endpoint.rtt_s (probed)",
    "ring": "the consistent-hash ring",
}


class DecisionState:
    """Facts about one decision, computed at most once and only when a plugin asks.

    Load-only presets never touch the prefix index; prefix-aware ones match the prompt once,
    whichever and however many plugins read the matches.
    """

    __slots__ = ("req", "view", "rng", "dry_run", "effects", "_matches", "_best_of", "_best", "_prefill_of",
                 "_prefill", "_lmetric_of", "_lmetric")

    def __init__(self, req: Request, view: View, rng: random.Random, dry_run: bool = False):
        self.req = req
        self.view = view
        self.dry_run = dry_run
        self.rng = copy_of(rng) if dry_run else rng  # a dry run draws, and leaves the policy's as it was
        self.effects: list[Callable[[], None]] = []
        self._matches: dict[str, int] | None = None
        self._best_of: list[Endpoint] | None = None  # the endpoint list _best was computed for
        self._best = 0
        self._prefill_of: list[Endpoint] | None = None
        self._prefill: list[int] = []
        self._lmetric_of: list[Endpoint] | None = None
        self._lmetric: list[float] = []

    def defer(self, effect: Callable[[], None]) -> None:
        """Run ``effect`` (a state change this decision implies) when the dispatch is committed."""
        self.effects.append(effect)

    def random(self, rng: random.Random) -> random.Random:
        """A plugin's own generator for this decision: itself, or a copy in a dry run."""
        return copy_of(rng) if self.dry_run else rng

    @property
    def matches(self) -> dict[str, int]:
        """Leading prompt blocks cached per endpoint id (absent: none)."""
        m = self._matches
        if m is None:
            m = self._matches = self.view.prefix.match(self.req.block_hashes)
        return m

    def matched(self, endpoint_id: str) -> int:
        """Blocks cached on ``endpoint_id``, or 0 when nothing asked for the matches (the Router
        then looks the target up itself)."""
        m = self._matches
        return m.get(endpoint_id, 0) if m else 0

    def best_match(self, eps: list[Endpoint]) -> int:
        """The longest match among ``eps``, in blocks (0: none of them holds any)."""
        if self._best_of is not eps:
            get = self.matches.get
            self._best = max([get(e.id, 0) for e in eps]) if eps else 0
            self._best_of = eps
        return self._best

    def hit_ratio(self, eps: list[Endpoint]) -> float:
        """Share of the prompt's tokens the best-matching endpoint among ``eps`` holds."""
        return self.req.hit_ratio(self.best_match(eps))

    def new_prefill(self, eps: list[Endpoint]) -> list[int]:
        """Tokens each endpoint would have to prefill for this request: the prompt minus its
        cached prefix there (the one place this formula lives). Shared: do not modify it."""
        if self._prefill_of is not eps:
            p, bt = self.req.prompt_tokens, self.req.block_tokens
            get = self.matches.get
            self._prefill = [p if (m := get(e.id)) is None else max(0, p - bt * m) for e in eps]
            self._prefill_of = eps
        return self._prefill

    def lmetric(self, eps: list[Endpoint]) -> list[float]:
        """LMetric §4's P-tokens × BS per endpoint: (queued prefill + new prefill) × (running +
        waiting + dispatched since the probe + 1) — the one place this formula lives. Computed once
        per decision and endpoint list: ``auto`` and ``lmetric`` read it up to three times (the
        hotspot route, the trust region, the incumbent's score). Shared: do not modify it."""
        if self._lmetric_of is not eps:
            self._lmetric = [(e.queued_prefill_tokens + n) * (e.running + e.waiting + e.dispatched_since_probe + 1)
                             for n, e in zip(self.new_prefill(eps), eps)]
            self._lmetric_of = eps
        return self._lmetric


def copy_of(rng: random.Random) -> random.Random:
    """A generator in the same state as ``rng`` (drawing from it leaves ``rng`` as it is)."""
    copy = random.Random()
    copy.setstate(rng.getstate())
    return copy


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

