"""LMetric's hotspot detector as plugins: ``HotspotPlugin`` exports the detector's counters
(:mod:`.detector`); ``Hotspot`` (route ``hotspot``) routes a hot class away from its holders.
``state()`` is exported under ``hotspot.``.
"""

from __future__ import annotations

from kvroute.model import Branch, Decision, Endpoint
from kvroute.policy.adaptive.hotspot.detector import HotspotDetector
from kvroute.policy.base import argmin
from kvroute.policy.catalog import new_scorer, register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Route


class HotspotPlugin(Lifecycle):
    """Exports LMetric's hotspot detector's counters (it learns from decisions, not events)."""

    name = "hotspot"

    def __init__(self, detector: HotspotDetector):
        self.detector = detector

    def state(self) -> dict[str, float]:
        """Alarmed and filtering classes, requests filtered."""
        return self.detector.state()


@register_plugin
class Hotspot(Route, HotspotPlugin):
    """LMetric §5.2: when the class of this request (its deepest cached prefix) outgrows the
    instances holding it (Equation 2) and more than 2·|M| consecutive class requests still
    prefer them (Equation 4), route among the other instances by P-tokens × BS.

    Declines (the next rule routes) while the detector sees no hotspot for the class.
    """

    name = "hotspot"
    inputs = frozenset({"prefix", "prefill_backlog", "load"})

    def __init__(self, window: int = 256):
        HotspotPlugin.__init__(self, HotspotDetector(window))
        self.score = new_scorer("lmetric")

    def _record(self, klass: int | None, holders: int, others: int, prefers: bool) -> None:
        self.detector.record(klass, holders, others, prefers)  # the dispatch was committed

    def route(self, st: DecisionState, eps: list[Endpoint]) -> Decision | None:
        """Dispatch away from the holders of a hot prefix class to the lowest P-tokens × BS; None when the
        class is not hot."""
        get = st.matches.get
        depth = [get(e.id, 0) for e in eps]
        deepest = max(depth)
        if deepest <= 0:
            n = len(eps)
            st.defer(lambda: self._record(None, 0, n, False))
            return None
        scores = self.score.values(st, eps)
        holders = [s for s, d in zip(scores, depth) if d == deepest]
        others = [s for s, d in zip(scores, depth) if d < deepest]
        prefers = not others or min(holders) <= min(others)  # Equation 4
        klass, n_holders, n_others = st.req.block_hashes[deepest - 1], len(holders), len(others)
        st.defer(lambda: self._record(klass, n_holders, n_others, prefers))
        if not self.detector.peek(klass, n_holders, n_others, prefers):
            return None
        rest = [i for i, d in enumerate(depth) if d < deepest]
        ep = argmin([eps[i] for i in rest], [scores[i] for i in rest], st.rng)
        return Decision.dispatch(ep.id, Branch.HOTSPOT_FILTERED, get(ep.id, 0), (eps, scores))
