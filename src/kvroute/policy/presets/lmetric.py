"""LMetric: new prefill tokens × batch size, no hyper-parameters; optional KV-hotspot detector."""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.adaptive.hotspot import HotspotDetector
from kvroute.policy.adaptive.plugins import HotspotPlugin
from kvroute.policy.base import Policy, PolicyParams, View, argmin, explain


class LMetricParams(PolicyParams):
    """LMetric has no weights; the detector is its one switch."""

    hotspot: bool = Field(False, description="LMetric §5.2's two-phase KV-hotspot detector: when a "
                          "request class outgrows the instances caching its prefix (Equation 2) and "
                          "more than 2·|M| consecutive class requests still prefer them, route the "
                          "class among the other instances")
    hotspot_window: int = Field(256, ge=8, description="routed requests the detector measures class "
                                "shares over")


class LMetric(Policy):
    """Minimise (queued prefill + this request's new prefill tokens) × (batch size + 1).

    New prefill tokens are the prompt minus its cached prefix on the endpoint; queued prefill is
    the router's backlog of dispatched-but-not-prefilled tokens there; batch size is running +
    waiting (LMetric §4, Figure 17). The +1 keeps idle endpoints comparable by their P-tokens
    (blitz-router's lmetric.rs does the same). With ``hotspot: true`` the detector of §5.2
    (:mod:`kvroute.policy.adaptive.hotspot`) may take a hotspot's instances out of the targets.
    """

    name = "lmetric"
    source = "LMetric §4 (P-tokens × BS), §5.2 (hotspot detector); blitz-router policies/lmetric.rs"
    Params = LMetricParams
    params: LMetricParams

    def __init__(self, params: PolicyParams | None = None, seed: int = 0):
        super().__init__(params, seed)
        self.detector: HotspotDetector | None = None
        self._deepest = 0  # the last checked request's deepest cached prefix, in blocks
        if self.params.hotspot:
            self.detector = HotspotDetector(self.params.hotspot_window)
            self.listeners = (HotspotPlugin(self.detector),)

    @property
    def reads_prefill_backlog(self) -> bool:
        return True

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        matches = view.prefix.match(req.block_hashes)
        p, bt = req.prompt_tokens, req.block_tokens
        get = matches.get
        # (e.batch_size inlined: this line runs per endpoint per decision)
        scores = [(e.queued_prefill_tokens + (p if (m := get(e.id)) is None else max(0, p - bt * m)))
                  * (e.running + e.waiting + e.dispatched_since_probe + 1) for e in eps]
        if self.detector is not None and self._hotspot(req, eps, scores, matches):
            others = [i for i, e in enumerate(eps) if get(e.id, 0) < self._deepest]
            ep = argmin([eps[i] for i in others], [scores[i] for i in others], self.rng)
            return Decision.dispatch(ep.id, "hotspot-filtered", get(ep.id, 0), explain(eps, scores))
        ep = argmin(eps, scores, self.rng)
        return Decision.dispatch(ep.id, "min-score", get(ep.id, 0), explain(eps, scores))

    def _hotspot(self, req: Request, eps: list[Endpoint], scores: list[int], matches: dict[str, int]) -> bool:
        """Ask the detector whether to filter out the instances holding this request's deepest
        cached prefix (its class); sets ``_deepest`` to that prefix's length in blocks."""
        assert self.detector is not None
        depth = [matches.get(e.id, 0) for e in eps]
        deepest = self._deepest = max(depth)
        if deepest <= 0:
            self.detector.check(None, 0, len(eps), False)
            return False
        holders = [s for s, d in zip(scores, depth) if d == deepest]
        others = [s for s, d in zip(scores, depth) if d < deepest]
        prefers = not others or min(holders) <= min(others)  # Equation 4
        return self.detector.check(req.block_hashes[deepest - 1], len(holders), len(others), prefers)
