"""The detour of ``lmetric_speed``'s TTFT pick (policy/adaptive/replica_speed/detour.py): a request whose
first token would come late where the speed-scaled score sends it goes where it comes soon, while its
predicted TPOT there is no worse; and the per-replica TPOT line it reads (``SpeedFit.tpot_at``)."""

from __future__ import annotations

import pytest

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed import SpeedFit
from kvroute.policy.adaptive.replica_speed.detour import OUTSIDE_S, detour


def _complete(fit: SpeedFit, ep: str, i: int, ttft: float, tpot: float, inflight: int, out: int = 101) -> None:
    rid = f"{ep}-{i}"
    fit.dispatched(rid, ep, 1000, 0.0, inflight)
    fit.first_token(rid, ttft)
    fit.finished(rid, ep, ttft + tpot * (out - 1), out)


def _fleet() -> SpeedFit:
    """fast: TPOT 10 ms + 2 ms per request in flight; slow: 50 ms flat; every TTFT 0.3 s (the mean wait)."""
    fit = SpeedFit(min_samples=2)
    for i in range(8):
        _complete(fit, "fast", i, 0.3, 0.010 + 0.002 * (i * 4 + 1), i * 4 + 1)
        _complete(fit, "slow", i, 0.3, 0.050, 1 + i % 2)
    return fit


def test_the_tpot_line_is_fitted_on_the_requests_in_flight_at_dispatch():
    fit = _fleet()
    assert fit.tpot_at("fast", 11) == pytest.approx(0.032, rel=1e-6)
    assert fit.tpot_at("slow", 3) == pytest.approx(0.050, rel=1e-6)
    assert fit.tpot_at("new", 1) is None and fit.mean_wait_s() == pytest.approx(0.3)


@pytest.mark.parametrize(("fast_inflight", "ttft", "chosen"), [
    (10, [0.5, 1.7], "fast"),   # long prompt, late on slow: fast's TPOT at 11 (32 ms) <= slow's 50 ms
    (25, [0.5, 1.7], "slow"),   # fast at 26 in flight: 62 ms > 50 ms — the detour would slow its decode
    (10, [0.22, 0.48], "slow"),  # short prompt: slow is not late (0.48 <= 0.22 + 0.3): the near set's pick
])
def test_a_late_request_detours_only_while_its_decode_is_no_slower(fast_inflight, ttft, chosen):
    fit = _fleet()
    eps = [Endpoint("fast", inflight=fast_inflight), Endpoint("slow", inflight=0)]
    scaled = [10.0, 1.0]  # the score puts fast out of the near set (limit 2)
    values = detour(fit, eps, ttft, scaled, 2.0, {})
    assert ["fast", "slow"][values.index(min(values))] == chosen


def test_before_any_completion_the_detour_is_unbounded_and_tiers_keep_their_order():
    fit = SpeedFit(min_samples=2)
    fit.dispatched("r", "fast", 100, 0.0, 1)
    fit.first_token("r", 0.2)
    eps = [Endpoint("fast", inflight=30), Endpoint("slow"), Endpoint("far")]
    values = detour(fit, eps, [0.3, 1.5, 2.0], [10.0, 1.0, 50.0], 2.0, {})
    assert values[0] == pytest.approx(0.3 + OUTSIDE_S)  # out of the near set, soon, nothing known of TPOT
    assert values[1] == pytest.approx(1.5 + 2 * OUTSIDE_S)  # the near set's pick, late
    assert values[2] == pytest.approx(2.0 + 3 * OUTSIDE_S)
