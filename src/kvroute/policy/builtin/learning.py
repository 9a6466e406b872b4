"""Plugins that learn while serving: each wraps one pure core of :mod:`kvroute.policy.adaptive`
and hears the Router's lifecycle events, so the simulator and the gateway teach it alike.

* ``es`` — a cost whose weights GORGO v2's (1+1)-ES tunes on the p95 TTFT of a window;
* ``calibration`` — GORGO v1's per-replica fit of TTFT against uncached and queued tokens;
* ``hotspot`` — LMetric §5.2's two-phase KV-hotspot detector and its fallback;
* ``predictor`` — llm-d's predicted TTFT on a step-time model, with its error measured.

Each plugin's registered name is also the prefix of its keys in ``Router.policy_state``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvroute.model import Branch, Decision, Endpoint
from kvroute.perf.profile import HardwareProfile
from kvroute.policy.adaptive.es_tuner import GORGO_RANGES, OnePlusOneES, WeightRange
from kvroute.policy.adaptive.hotspot import HotspotDetector
from kvroute.policy.adaptive.plugins import CalibrationPlugin, HotspotPlugin, PredictionErrorPlugin, TunerPlugin
from kvroute.policy.adaptive.predictor import TTFTPredictor
from kvroute.policy.adaptive.ttft_fit import TTFTFit
from kvroute.policy.base import argmin
from kvroute.policy.catalog import PLUGINS, register_plugin
from kvroute.policy.plugins import DecisionState, Route, Scorer
from kvroute.policy.profiles import resolve_profile


def _scorer(name: str) -> Scorer:
    """A registered scorer without arguments."""
    scorer = PLUGINS["scorer"][name]()
    assert isinstance(scorer, Scorer)
    return scorer


@register_plugin
class TunedCost(Scorer, TunerPlugin):
    """A weighted sum of other scorers whose weights GORGO v2's (1+1)-ES tunes online (§2.2).

    ``terms`` maps each weight's name to the scorer it multiplies (GORGO: ``w_rtt: rtt_ms,
    t_p: uncached_tokens, w_queue: inflight_tokens``); ``start`` gives every weight's value;
    ``ranges`` the ``[lo, hi]`` of the ones the ES tunes (the others stay fixed: only ratios
    matter). Every measured TTFT is one fitness sample; ``frozen`` serves ``start`` unchanged
    (held-out evaluation with learned weights). Seeded from the policy's seed.
    """

    name = "es"

    def __init__(self, terms: Mapping[str, str], start: Mapping[str, float],
                 ranges: Mapping[str, Sequence[float]], window: int = 128, hop: int = 32,
                 sigma0: float = 0.5, sigma_min: float = 0.05, frozen: bool = False, seed: int = 0):
        scorers = PLUGINS["scorer"]
        unknown = sorted(set(terms.values()) - set(scorers))
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(unknown)} in terms; valid scorers: {', '.join(scorers)}")
        missing = sorted(set(terms) - set(start))
        if missing or not set(ranges) <= set(terms):
            raise ValueError(f"every term needs a start weight (missing: {', '.join(missing) or 'none'}) and "
                             f"ranges may only name terms ({', '.join(terms)})")
        self.terms = [(w, _scorer(s)) for w, s in terms.items()]
        self.fixed = {w: float(start[w]) for w in terms if w not in ranges}
        tuned = {w: WeightRange(float(start[w]), float(lo), float(hi)) if not frozen
                 else GORGO_RANGES.get(w, WeightRange(float(start[w]), float(lo), float(hi)))
                 for w, (lo, hi) in ranges.items()}
        es = OnePlusOneES(tuned, window=window, hop=hop, sigma0=sigma0, sigma_min=sigma_min, seed=seed,
                          frozen={w: float(start[w]) for w in ranges} if frozen else None)
        TunerPlugin.__init__(self, es)
        self.inputs = frozenset().union(*(s.inputs for _, s in self.terms))

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The weighted sum of the terms' values, with the weights the tuner serves now."""
        live, fixed = self.es.weights, self.fixed
        total: list[float] | None = None
        for w, scorer in self.terms:
            k = live[w] if w in live else fixed[w]
            vals = scorer.values(st, eps)
            total = [k * v for v in vals] if total is None else [t + k * v for t, v in zip(total, vals)]
        return total if total is not None else [0.0] * len(eps)


@register_plugin
class CalibratedTTFT(Scorer, CalibrationPlugin):
    """GORGO v1's calibration (§4.2, done online): per replica, TTFT − RTT in ms fitted by
    recursive least squares on uncached and queued tokens from observed first tokens.

    Until a replica has ``min_samples`` observations its cost is the constants'
    ``t_p · uncached + w_queue · queued tokens``.
    """

    name = "calibration"
    inputs = frozenset({"prefix", "load"})

    def __init__(self, t_p: float = 1.0, w_queue: float = 0.1, min_samples: int = 8):
        CalibrationPlugin.__init__(self, TTFTFit(min_samples=min_samples))
        self.t_p, self.w_queue = t_p, w_queue

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Predicted TTFT − RTT in ms per endpoint from its fitted model, or the constants' cost before it has
        enough samples."""
        model, t_p, w_queue = self.fit.model, self.t_p, self.w_queue
        out = []
        for e, uncached in zip(eps, st.new_prefill(eps)):
            m = model(e.id)
            out.append(t_p * uncached + w_queue * e.inflight_tokens if m is None
                       else 1000.0 * m.predict(uncached, e.inflight_tokens))
        return out


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
        self.score = _scorer("lmetric")

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


@register_plugin
class PredictedTTFT(Scorer, PredictionErrorPlugin):
    """Each replica's TTFT for this request predicted on a hardware profile's step-time model
    (llm-d's latency-based scheduler, LMetric §4.6); its error against measured TTFTs is state."""

    name = "predictor"
    inputs = frozenset({"prefix", "prefill_backlog", "load", "rtt"})

    def __init__(self, profile: str | HardwareProfile = "h20-qwen3-30b-a3b"):
        PredictionErrorPlugin.__init__(self)
        self.predictor = TTFTPredictor(resolve_profile(profile))  # a name: the runtime's profile source

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The predicted TTFT per endpoint (seconds), remembered so the error can be scored once the first
        token arrives."""
        req = st.req
        preds = self.predictor.predict_many(eps, req.prompt_tokens, req.block_tokens, st.matches)
        last = (req.id, {e.id: v for e, v in zip(eps, preds)})  # scored when it is dispatched
        st.defer(lambda: setattr(self, "last", last))
        return preds
