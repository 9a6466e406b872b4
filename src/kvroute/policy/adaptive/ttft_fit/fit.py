"""GORGO v1's calibration, online: per-replica least squares of TTFT on prefill and queue work.

GORGO v1 §4.2 (001_55e1ee0b5e0d1fc8.txt) measured its per-token prefill cost t_p offline, by a
linear regression of TTFT on input tokens (TTFT = 150.72 ms + 0.0938 ms/token, R² 0.986, N 87),
and §8 proposes tuning the weights from observed TTFTs instead. GORGO v2's code has such a
calibrate mode (TTFT ~ intercept per replica + P·uncached + Q·queued). This module fits, per
replica, by recursive least squares (exact OLS, updated in O(1) per observation)::

    TTFT − RTT ≈ a_r + b_r · uncached tokens + c_r · queued tokens

from every first token the router sees, with the uncached and queued tokens the router knew
when it dispatched that request and the RTT it had probed. ``gorgo`` with ``calibrate: true``
uses a_r, b_r, c_r (milliseconds) in place of its constant t_p and w_queue once a replica has
``min_samples`` observations.

Choices: per-replica slopes as well as intercepts (replicas may differ in hardware; GORGO's
code shares the slopes); tokens in thousands inside the fit (keeps the 3×3 normal equations
well conditioned); a weak prior (P₀ = 10⁶·I) so the first fits follow the data; negative
fitted slopes are clamped to 0 where the cost reads them (more work never makes a replica
cheaper); an optional forgetting factor (1.0 = plain least squares) for drifting deployments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

K = 1000.0  # tokens per feature unit


@dataclass(slots=True)
class _RLS:
    """Recursive least squares in 3 unknowns (intercept, uncached, queued)."""

    theta: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    P: list[list[float]] = field(default_factory=lambda: [[1e6 if i == j else 0.0 for j in range(3)]
                                                          for i in range(3)])
    n: int = 0

    def update(self, x: tuple[float, float, float], y: float, lam: float) -> None:
        P = self.P
        px = [P[i][0] * x[0] + P[i][1] * x[1] + P[i][2] * x[2] for i in range(3)]
        denom = lam + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        gain = [v / denom for v in px]
        err = y - (self.theta[0] * x[0] + self.theta[1] * x[1] + self.theta[2] * x[2])
        self.theta = [t + g * err for t, g in zip(self.theta, gain)]
        # P ← (P − gain·pxᵀ) / λ  (P stays symmetric: px = P·x)
        self.P = [[(P[i][j] - gain[i] * px[j]) / lam for j in range(3)] for i in range(3)]
        self.n += 1


@dataclass(frozen=True, slots=True)
class TTFTModel:
    """One replica's fitted TTFT model (seconds): intercept plus seconds per token of each kind."""

    intercept_s: float
    per_uncached_s: float
    per_queued_s: float
    samples: int

    def predict(self, uncached: int, queued: int) -> float:
        """TTFT beyond the RTT for a request with these uncached and queued tokens."""
        return self.intercept_s + self.per_uncached_s * uncached + self.per_queued_s * queued


class TTFTFit:
    """Per-replica online fits, fed by dispatches and first tokens (a request's features are
    remembered from its dispatch until its first token or failure)."""

    def __init__(self, min_samples: int = 8, forgetting: float = 1.0):
        if not 0.9 <= forgetting <= 1.0:
            raise ValueError(f"forgetting must be in [0.9, 1.0], got {forgetting}")
        self.min_samples = min_samples
        self.forgetting = forgetting
        self._fits: dict[str, _RLS] = {}
        self._pending: dict[str, tuple[str, int, int, float]] = {}

    def dispatched(self, req_id: str, endpoint_id: str, uncached: int, queued: int, rtt_s: float) -> None:
        """Remember what the router knew when it sent ``req_id`` to ``endpoint_id``."""
        self._pending[req_id] = (endpoint_id, uncached, queued, rtt_s)

    def first_token(self, req_id: str, ttft_s: float) -> None:
        """The measured TTFT of a dispatched request: one observation for its replica."""
        p = self._pending.pop(req_id, None)
        if p is not None:
            self.observe(p[0], p[1], p[2], ttft_s - p[3])

    def forget(self, req_id: str) -> None:
        """The request will give no first token (failed or re-routed)."""
        self._pending.pop(req_id, None)

    def observe(self, endpoint_id: str, uncached: int, queued: int, ttft_s: float) -> None:
        """One observation: TTFT beyond the RTT, with the request's uncached and queued tokens."""
        fit = self._fits.get(endpoint_id)
        if fit is None:
            fit = self._fits[endpoint_id] = _RLS()
        fit.update((1.0, uncached / K, queued / K), ttft_s, self.forgetting)

    def model(self, endpoint_id: str) -> TTFTModel | None:
        """The replica's fitted model, or None before ``min_samples`` observations."""
        fit = self._fits.get(endpoint_id)
        if fit is None or fit.n < self.min_samples:
            return None
        a, b, c = fit.theta
        return TTFTModel(a, max(0.0, b) / K, max(0.0, c) / K, fit.n)

    def state(self) -> dict[str, float]:
        """Per replica: intercept (ms), ms per uncached / queued token, observations."""
        out: dict[str, float] = {}
        for ep_id in sorted(self._fits):
            m = self.model(ep_id)
            out[f"{ep_id}.samples"] = float(self._fits[ep_id].n)
            if m is not None:
                out[f"{ep_id}.intercept_ms"] = m.intercept_s * 1000.0
                out[f"{ep_id}.ms_per_uncached_token"] = m.per_uncached_s * 1000.0
                out[f"{ep_id}.ms_per_queued_token"] = m.per_queued_s * 1000.0
        return out
