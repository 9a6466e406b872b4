"""The per-decision state every plugin reads (split out of policy/plugins.py, issue 22 item 5).

:class:`DecisionState` computes the facts about one decision — the prompt's prefix matches, the
new prefill per endpoint, LMetric's score — at most once and only when a plugin asks; it is the
per-endpoint work of most presets, and one of the modules the optional compiled build compiles
(kvroute/buildinfo.py, docs/compiled.md). policy/plugins.py re-exports it with the plugin kinds.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvroute.model import Endpoint, Request
from kvroute.native import mypyc_attr

if TYPE_CHECKING:
    from kvroute.policy.base import View


@mypyc_attr(allow_interpreted_subclasses=True)  # PDState (builtin/pd.py); compiled build
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


class Turns:
    """Round robin's counter (``builtin/pickers.RoundRobin``), in this compiled module so that a rule
    whose picker is plain round robin takes its turn without an interpreted call per decision
    (``compose.Rule.apply``; issue 25, docs/hot-path.md, thirteenth round). The counter moves only
    when the dispatch is committed (``DecisionState.defer``), as before."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def pick(self, st: DecisionState, eps: list[Endpoint]) -> Endpoint:
        """The candidate whose turn it is; the turn passes on at the commit."""
        ep = eps[self.next % len(eps)]
        st.defer(self.advance)
        return ep

    def advance(self) -> None:
        """The next candidate's turn."""
        self.next += 1
