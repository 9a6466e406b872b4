"""GORGO v2's tuner as plugins: ``TunerPlugin`` feeds every measured TTFT to the (1+1)-ES
(:mod:`.es`); ``TunedCost`` (scorer ``es``) is the weighted cost whose weights it tunes.

The Router calls the lifecycle hooks alike in the simulator and the gateway; ``state()`` reaches
``/metrics`` (``kvroute_policy_state``) and simulate's JSON (``policy_state``) under ``es.``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvroute.model import Endpoint
from kvroute.policy.adaptive.es_tuner.es import GORGO_RANGES, OnePlusOneES, WeightRange
from kvroute.policy.catalog import PLUGINS, new_scorer, register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Scorer


class TunerPlugin(Lifecycle):
    """Feeds every measured TTFT to GORGO v2's (1+1)-ES; the preset reads ``es.weights``.

    A request's TTFT joins the tuner's window when the request completes, as in GORGO's proxy
    (proxy/modal_proxy.py records a sample with its TTFT and total time at the end of the
    response, and gorgo/tuner.py's window is the trailing samples): the window holds the last
    128 completed requests. A request that fails adds no sample.
    """

    name = "es"

    def __init__(self, es: OnePlusOneES):
        self.es = es
        self._ttft: dict[str, float] = {}  # requests past their first token, not yet complete

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """The request's TTFT, kept until it completes."""
        self._ttft[req_id] = ttft_s

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """One fitness sample: the completed request's TTFT."""
        ttft = self._ttft.pop(req_id, None)
        if ttft is not None:
            self.es.observe(ttft)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """No sample from a failed request."""
        self._ttft.pop(req_id, None)

    def state(self) -> dict[str, float]:
        """Weights, σ, window p95, accepted/proposed."""
        return self.es.state()


@register_plugin
class TunedCost(Scorer, TunerPlugin):
    """A weighted sum of other scorers whose weights GORGO v2's (1+1)-ES tunes online (§2.2).

    ``terms`` maps each weight's name to the scorer it multiplies (GORGO: ``w_rtt: rtt_ms,
    t_p: uncached_tokens, w_queue: inflight_tokens``); ``start`` gives every weight's value;
    ``ranges`` the ``[lo, hi]`` of the ones the ES tunes (the others stay fixed: only ratios
    matter). Every completed request's TTFT is one fitness sample; ``judge`` scores a step on the rolling
    window (the paper) or on the last hop; ``frozen`` serves ``start`` unchanged
    (held-out evaluation with learned weights). Seeded from the policy's seed.
    """

    name = "es"

    def __init__(self, terms: Mapping[str, str], start: Mapping[str, float],
                 ranges: Mapping[str, Sequence[float]], window: int = 128, hop: int = 32,
                 sigma0: float = 0.5, sigma_min: float = 0.05, frozen: bool = False, seed: int = 0,
                 judge: str = "window"):
        scorers = PLUGINS["scorer"]
        unknown = sorted(set(terms.values()) - set(scorers))
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(unknown)} in terms; valid scorers: {', '.join(scorers)}")
        missing = sorted(set(terms) - set(start))
        if missing or not set(ranges) <= set(terms):
            raise ValueError(f"every term needs a start weight (missing: {', '.join(missing) or 'none'}) and "
                             f"ranges may only name terms ({', '.join(terms)})")
        self.terms = [(w, new_scorer(s)) for w, s in terms.items()]
        self.fixed = {w: float(start[w]) for w in terms if w not in ranges}
        tuned = {w: WeightRange(float(start[w]), float(lo), float(hi)) if not frozen
                 else GORGO_RANGES.get(w, WeightRange(float(start[w]), float(lo), float(hi)))
                 for w, (lo, hi) in ranges.items()}
        es = OnePlusOneES(tuned, window=window, hop=hop, sigma0=sigma0, sigma_min=sigma_min, seed=seed,
                          frozen={w: float(start[w]) for w in ranges} if frozen else None, judge=judge)
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
