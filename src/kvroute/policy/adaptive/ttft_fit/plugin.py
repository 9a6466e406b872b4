"""GORGO v1's calibration as plugins: ``CalibrationPlugin`` feeds the per-replica TTFT fit
(:mod:`.fit`: features at dispatch, TTFT at first token); ``CalibratedTTFT`` (scorer
``calibration``) costs each replica by its fitted model. ``state()`` is exported under
``calibration.``.
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.ttft_fit.fit import TTFTFit
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Scorer


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
