"""The declared-hardware prior joined with the times learned online (``lmetric_speed`` on a fleet whose
replicas declare accelerators that differ; :mod:`.datasheet`).

A replica's own measured time is used as soon as it has one (the :class:`~.fit.SpeedFit` floors: 3
first tokens for its prefill line, 2 completions for its decode time); a replica not yet measured
gets its datasheet time *calibrated* on the measured ones — its prior × the median, over the
measured replicas that declared an accelerator, of learned ÷ prior. So the prior only says how
much slower or faster than the measured replicas an unmeasured one should be, and the scale comes
from measurements. Before anything is measured the prior alone sets the factors (its units cancel
in the ratio to the median). Replicas that declared nothing count as the median (factor 1), as
every replica does without a prior. Pure.
"""

from __future__ import annotations

from statistics import median

from kvroute.policy.adaptive.replica_speed.fit import SpeedFit


def calibrated(learned: dict[str, float], prior: dict[str, float]) -> dict[str, float]:
    """Per replica: its learned time where positive, else (declared ones) its prior × the median learned ÷
    prior ratio of the replicas having both — in the prior's units when none has."""
    est = {ep: t for ep, t in learned.items() if t > 0}
    ratios = [t / prior[ep] for ep, t in est.items() if ep in prior]
    if not ratios:
        return dict(prior)
    scale = median(ratios)
    for ep, p in prior.items():
        if ep not in est:
            est[ep] = p * scale
    return est


def relative(times: dict[str, float]) -> dict[str, float]:
    """Each time over the median of all (empty when fewer than two)."""
    if len(times) < 2:
        return {}
    mid = median(times.values())
    return {ep: t / mid for ep, t in times.items()} if mid > 0 else {}


def prior_factors(fit: SpeedFit, prior: dict[str, tuple[float, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """(prefill, decode) factors per replica from the measured times, the prior filling in the unmeasured."""
    pre = calibrated(fit.prefill_s(), {ep: p for ep, (p, _) in prior.items()})
    dec = calibrated(fit.decode_s(), {ep: d for ep, (_, d) in prior.items()})
    return relative(pre), relative(dec)


def prior_predict(fit: SpeedFit, work: list[tuple[str, float]],
                  prior: dict[str, tuple[float, float]]) -> list[float] | None:
    """Predicted TTFT − RTT per ``(replica, prefill work there)``: a measured replica's own line; an
    unmeasured declared one, the measured declared replicas' lines at its work × its prior prefill time over
    theirs (median); any other, the median of those predictions. None while no declared replica has a line:
    nothing yet says how many seconds a token takes."""
    own = [fit.line_at(ep, w) for ep, w in work]
    measured = [ep for ep in prior if fit.line_at(ep, 0.0) is not None]
    if not measured:
        return None
    out: list[float | None] = []
    for (ep, w), v in zip(work, own):
        if v is None and ep in prior:
            mine = prior[ep][0]
            v = median((fit.line_at(m, w) or 0.0) * mine / prior[m][0] for m in measured)
        out.append(v)
    known = [v for v in out if v is not None]
    mid = median(known) if known else 0.0
    return [mid if v is None else v for v in out]
