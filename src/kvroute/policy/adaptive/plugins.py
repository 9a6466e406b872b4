"""The adaptive cores as lifecycle plugins: what each learns from, and the state it exports.

Each class adapts one pure core (:mod:`.es_tuner`, :mod:`.ttft_fit`, :mod:`.hotspot`,
:mod:`.predictor`) to :class:`~kvroute.policy.hooks.Lifecycle`, so the Router feeds it the same
events in the simulator and the gateway, and its ``state()`` reaches ``/metrics``
(``kvroute_policy_state``) and simulate's JSON (``policy_state``).
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.es_tuner import OnePlusOneES
from kvroute.policy.adaptive.hotspot import HotspotDetector
from kvroute.policy.adaptive.ttft_fit import TTFTFit
from kvroute.policy.hooks import Lifecycle


class TunerPlugin(Lifecycle):
    """Feeds every measured TTFT to GORGO v2's (1+1)-ES; the preset reads ``es.weights``."""

    name = "es"

    def __init__(self, es: OnePlusOneES):
        self.es = es

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """One fitness sample."""
        self.es.observe(ttft_s)

    def state(self) -> dict[str, float]:
        """Weights, σ, window p95, accepted/proposed."""
        return self.es.state()


class CalibrationPlugin(Lifecycle):
    """Feeds GORGO v1's per-replica TTFT fit: features at dispatch, TTFT at first token."""

    name = "calibration"

    def __init__(self, fit: TTFTFit):
        self.fit = fit

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Remember the uncached and queued tokens (queued: before this request) and the RTT."""
        queued = endpoint.inflight_tokens - req.prompt_tokens
        self.fit.dispatched(req.id, endpoint.id, new_prefill_tokens, max(0, queued), endpoint.rtt_s)

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """One observation for the replica."""
        self.fit.first_token(req_id, ttft_s)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """No first token will come."""
        self.fit.forget(req_id)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """A request that completed without a reported first token leaves nothing behind."""
        self.fit.forget(req_id)

    def state(self) -> dict[str, float]:
        """Per replica: fitted intercept and slopes, observations."""
        return self.fit.state()


class HotspotPlugin(Lifecycle):
    """Exports LMetric's hotspot detector's counters (it learns from decisions, not events)."""

    name = "hotspot"

    def __init__(self, detector: HotspotDetector):
        self.detector = detector

    def state(self) -> dict[str, float]:
        """Alarmed and filtering classes, requests filtered."""
        return self.detector.state()


class PredictionErrorPlugin(Lifecycle):
    """Compares the predicted TTFT of each dispatched request with the measured one (LMetric
    Fig. 16's accuracy measure): mean absolute relative error and the share off by > 20 %."""

    name = "predictor"

    def __init__(self) -> None:
        self.last: tuple[str, dict[str, float]] = ("", {})  # the latest decision's predictions
        self._pending: dict[str, float] = {}
        self.n = 0
        self.abs_rel_err = 0.0
        self.over_20 = 0

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Keep the prediction made for the endpoint the request went to."""
        rid, preds = self.last
        if rid == req.id and endpoint.id in preds:
            self._pending[req.id] = preds[endpoint.id]

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Score the prediction against the measured TTFT."""
        pred = self._pending.pop(req_id, None)
        if pred is None or ttft_s <= 0:
            return
        err = abs(pred - ttft_s) / ttft_s
        self.n += 1
        self.abs_rel_err += err
        self.over_20 += err > 0.2

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """No first token will come."""
        self._pending.pop(req_id, None)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Nothing left to score."""
        self._pending.pop(req_id, None)

    def state(self) -> dict[str, float]:
        """Requests scored, mean |predicted − measured| / measured, share off by more than 20 %."""
        n = self.n
        return {"scored": float(n), "mean_abs_rel_error": self.abs_rel_err / n if n else 0.0,
                "share_over_20pct": self.over_20 / n if n else 0.0}
