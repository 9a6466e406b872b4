"""llm-d's predicted TTFT as plugins: ``PredictedTTFT`` (scorer ``predictor``) predicts each
replica's TTFT on a step-time model (:mod:`.model`); ``PredictionErrorPlugin`` scores those
predictions against the measured TTFTs (exported under ``predictor.``).
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.perf.profile import HardwareProfile
from kvroute.policy.adaptive.predictor.model import TTFTPredictor
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Scorer
from kvroute.policy.profiles import resolve_profile


class PredictionErrorPlugin(Lifecycle):
    """Compares the predicted TTFT of each dispatched request with the measured one (LMetric
    Fig. 16's accuracy measure): mean absolute relative error and the share off by > 20 %."""

    name = "predictor"

    def __init__(self) -> None:
        # the latest decision's predictions: (request id, endpoints, values), looked up only for the
        # endpoint it is dispatched to (a dict of all of them per decision cost more than the lookup)
        self.last: tuple[str, list[Endpoint], list[float]] = ("", [], [])
        self._pending: dict[str, float] = {}
        self.n = 0
        self.abs_rel_err = 0.0
        self.over_20 = 0

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Keep the prediction made for the endpoint the request went to."""
        rid, eps, preds = self.last
        if rid == req.id:
            eid = endpoint.id
            for e, v in zip(eps, preds):
                if e.id == eid:
                    self._pending[req.id] = v
                    break

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


FALLBACK_PROFILE = "h20-qwen3-30b-a3b"  # LMetric's testbed (§6.1: H20s), for replicas of unknown hardware


@register_plugin
class PredictedTTFT(Scorer, PredictionErrorPlugin):
    """Each replica's TTFT for this request predicted on a hardware profile's step-time model
    (llm-d's latency-based scheduler, LMetric §4.6); its error against measured TTFTs is state."""

    name = "predictor"
    inputs = frozenset({"prefix", "prefill_backlog", "load", "rtt"})

    def __init__(self, profile: str | HardwareProfile | None = None):
        PredictionErrorPlugin.__init__(self)
        # a name: the runtime's profile source; None: each replica's own profile (Endpoint.profile)
        self.predictor = TTFTPredictor(resolve_profile(profile)) if profile is not None else None
        self._own: dict[int, TTFTPredictor] = {}  # id(profile object or name) → its predictor
        self._keep: list[object] = []  # the profiles keyed above, kept alive so their ids stay unique

    def __getstate__(self) -> dict[str, object]:
        # the per-profile predictors are a memo filled while deciding, not routing state: a copy
        # (the decide-purity test's pickle, a worker's task) starts without them
        state = self.__dict__.copy()
        state["_own"], state["_keep"] = {}, []
        return state

    def _own_profiles(self, eps: list[Endpoint], prompt_tokens: int, block_tokens: int,
                      matches: dict[str, int]) -> list[float]:
        """Predictions on each endpoint's own profile: one batch when they share it (the usual fleet)."""
        first = self._predictor_of(eps[0]) if eps else None
        if all(self._predictor_of(e) is first for e in eps[1:]):
            return first.predict_many(eps, prompt_tokens, block_tokens, matches) if first else []
        return [self._predictor_of(e).predict_many([e], prompt_tokens, block_tokens, matches)[0] for e in eps]

    def _predictor_of(self, ep: Endpoint) -> TTFTPredictor:
        """The replica's own profile's predictor; LMetric's H20 testbed profile when the runtime
        does not know the replica's hardware (a gateway replica with no profile)."""
        ref = ep.profile if ep.profile is not None else FALLBACK_PROFILE
        got = self._own.get(id(ref))
        if got is None:
            if not isinstance(ref, (str, HardwareProfile)):
                raise ValueError(f"endpoint {ep.id}: profile must be a name or a HardwareProfile, got {ref!r}")
            got = self._own[id(ref)] = TTFTPredictor(resolve_profile(ref))
            self._keep.append(ref)
        return got

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """The predicted TTFT per endpoint (seconds), remembered so the error can be scored once the first
        token arrives."""
        req = st.req
        if self.predictor is not None:
            preds = self.predictor.predict_many(eps, req.prompt_tokens, req.block_tokens, st.matches)
        else:
            preds = self._own_profiles(eps, req.prompt_tokens, req.block_tokens, st.matches)
        last = (req.id, eps, preds)  # scored when it is dispatched
        st.defer(lambda: setattr(self, "last", last))
        return preds
