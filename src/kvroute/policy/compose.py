"""A preset as data, and the policy it compiles to.

A preset (built in, from a YAML file, or from an entry point) is one mapping::

    filters: [low_queue]                        # optional, after the hard filters
    rules:                                      # tried in order; the first that routes wins
      - when: {hit_ratio_at_least: $cache_threshold}
        among: best_prefix                      # candidates for this rule
        cost: {inflight: 1}                     # raw values, lower wins (argmin)
        branch: prefix-hit
    cost: {inflight: 1}                         # the final, unconditional rule
    branch: least-load

A rule routes unless a ``when`` condition fails, its ``among`` filters leave no candidate, or
its picker declines; then the next rule tries. ``cost`` sums raw scorer values times weights
(lower wins, argmin by default); ``score`` sums scorer outputs normalised to [0, 1] (higher
wins, argmax by default); a term weighted 0 is left out when compiled (policy/compiler.py);
``picker`` overrides the default; ``route`` names a rule written in code; ``enabled: $flag``
keeps a rule only when a parameter says so. A plugin is named as
``name``, ``{name: value}`` or ``{name: {arg: value}}``, and ``$param`` anywhere refers to one
of the preset's parameters, so a user's overrides reach the plugins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.model import Decision, Endpoint, Request
from kvroute.model.decision import Branch
from kvroute.policy.base import Policy, View
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import Condition, DecisionState, Filter, Picker, Plugin, Route, Scorer
from kvroute.policy.state import Turns

RULE_KEYS = ("when", "among", "cost", "score", "picker", "route", "branch", "enabled")
PRESET_KEYS = ("filters", "rules", "cost", "score", "picker", "route", "branch")


@dataclass(frozen=True)
class Preset:
    """A named composition: its parameters' model, its spec (the mapping above), and where the
    behaviour comes from."""

    name: str
    params: type[PolicyParams]
    spec: Mapping[str, Any]
    source: str = ""
    doc: str = ""
    origin: str = "kvroute"  # built in, a file path, or an entry point

    @property
    def summary(self) -> str:
        """The first line of the preset's description."""
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""


@dataclass(slots=True)
class Rule:
    """One compiled branch of a preset: when → among → score → pick (or a coded route)."""

    branch: str
    when: tuple[Condition, ...] = ()
    among: tuple[Filter, ...] = ()
    scorers: tuple[tuple[Scorer, float], ...] = ()
    normalised: bool = False  # score (normalised, higher wins) rather than cost (raw, lower wins)
    picker: Picker | None = None
    route: Route | None = None
    plugins: tuple[Plugin, ...] = field(default=())
    turns: Turns | None = None  # the picker's own counter when it is plain round robin (compiler.py)

    def apply(self, st: DecisionState, eps: list[Endpoint]) -> Decision | None:
        """Route over ``eps``, or None when this rule does not apply."""
        for cond in self.when:
            if not cond.holds(st, eps):
                return None
        for f in self.among:
            eps = f.filter(st, eps)
            if not eps:
                return None
        if self.route is not None:
            return self.route.route(st, eps)
        turns = self.turns
        if turns is not None:  # round robin, its counter compiled: no interpreted pick per decision
            turn = turns.pick(st, eps)
            return Decision.dispatch(turn.id, self.branch, st.matched(turn.id), None)
        picker = self.picker
        assert picker is not None  # the compiler gives every rule a route or a picker
        values = self.combine(st, eps) if picker.needs_values else ()
        ep = picker.pick(st, eps, values)
        if ep is None:
            return None
        return Decision.dispatch(ep.id, self.branch, st.matched(ep.id),
                                 (eps, values) if values else None)

    def combine(self, st: DecisionState, eps: list[Endpoint]) -> Sequence[float]:
        """The scorers' values per endpoint, weighted and summed (normalised for ``score``)."""
        scorers = self.scorers
        if not scorers:
            return [0.0] * len(eps)
        if self.normalised:
            (first, w), *rest = scorers
            total = [w * v for v in first.normalised(st, eps)]
            for s, w in rest:
                total = [t + w * v for t, v in zip(total, s.normalised(st, eps))]
            return total
        if len(scorers) == 1:
            (s, w), = scorers
            values = s.values(st, eps)
            return values if w == 1 else [w * v for v in values]
        # one pass over the endpoints for the usual two or three terms (GORGO, Dynamo)
        if len(scorers) == 2:
            (s0, w0), (s1, w1) = scorers
            return [w0 * a + w1 * b for a, b in zip(s0.values(st, eps), s1.values(st, eps))]
        if len(scorers) == 3:
            (s0, w0), (s1, w1), (s2, w2) = scorers
            return [w0 * a + w1 * b + w2 * c
                    for a, b, c in zip(s0.values(st, eps), s1.values(st, eps), s2.values(st, eps))]
        total = [0.0] * len(eps)
        for s, w in scorers:
            total = [t + w * v for t, v in zip(total, s.values(st, eps))]
        return total


class Pipeline(Policy):
    """A policy compiled from a :class:`Preset`: hard filters and admission (the base class),
    then the preset's filters, then its rules in order."""

    def __init__(self, preset: Preset, params: PolicyParams, seed: int,
                 filters: tuple[Filter, ...], rules: tuple[Rule, ...]):
        super().__init__(params, seed)
        self.name = preset.name
        self.source = preset.source
        self.preset = preset
        self.filters = filters
        self.rules = rules
        plugins = [*filters, *(p for r in rules for p in r.plugins)]
        self.plugins = tuple(plugins)
        self.inputs = frozenset().union(*(p.inputs for p in plugins))
        self.uses_ring = any(p.uses_ring for p in plugins)
        self.listeners = tuple(p for p in plugins if isinstance(p, Lifecycle))

    def context_limit(self, endpoint_id: str) -> int | None:
        """The first plugin's that defines one (CascadeInfer's ``length_stage``), else None."""
        for p in self.plugins:
            limit = getattr(p, "context_limit", None)
            if limit is not None:
                return limit(endpoint_id)  # type: ignore[no-any-return]
        return None

    def choose(self, req: Request, eps: list[Endpoint], view: View, dry_run: bool = False) -> Decision:
        """Apply the preset's filters, then its rules in order; the first that routes wins. The
        state changes the plugins deferred travel with the decision (``Decision.effects``)."""
        st = DecisionState(req, view, self.rng, dry_run)
        for f in self.filters:
            eps = f.filter(st, eps)
            if not eps:
                return Decision.none(f"filter {f.name} left no endpoint", branch=Branch.ALL_FILTERED)
        for rule in self.rules:
            d = rule.apply(st, eps)
            if d is not None:
                if st.effects:
                    d.effects = tuple(st.effects)
                return d
        return Decision.none(f"no rule of {self.name} chose an endpoint", branch=Branch.NO_RULE)

    def describe(self) -> dict[str, Any]:
        """The plugins this policy runs, rule by rule (``kvroute policies --json``)."""
        rules = []
        for r in self.rules:
            item: dict[str, Any] = {"branch": r.branch}
            if r.when:
                item["when"] = [c.describe() for c in r.when]
            if r.among:
                item["among"] = [f.describe() for f in r.among]
            if r.route is not None:
                item["route"] = r.route.describe()
            else:
                if r.scorers:
                    item["score" if r.normalised else "cost"] = {s.describe(): w for s, w in r.scorers}
                assert r.picker is not None
                item["picker"] = r.picker.describe()
            rules.append(item)
        return {"filters": [f.describe() for f in self.filters], "admission": self.admission.name,
                "rules": rules}
