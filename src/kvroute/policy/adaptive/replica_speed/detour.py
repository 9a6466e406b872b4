"""The detour of ``lmetric_speed``'s TTFT pick (``detour``; ``auto``'s ``speed_detour``): on a fleet judged
mixed, the first token's lateness is a constraint and the speed-scaled score chooses among the replicas
that meet it — so the slow replicas take the requests they serve without a late first token (the short
prompts) and the fast ones keep their capacity for the long ones.

The scaled score keeps each replica's load in proportion to its speed, which is what keeps TPOT and
stability. On 2 A100 + 6 L4 it often prefers an idle L4 to an A100 with a batch, and a 3,500-token prompt
then waits ~1.7 s on the L4 for a first token an A100 would give in ~0.5 s (seed 0 at 70 % of the knee:
113 of 800 requests on the L4s, their TTFT p50 0.97 s; those are the TTFT tail). The load the score wants
on the L4s can as well be their share of the *short* prompts, which an L4 prefills about as fast as an
A100 a long one. So:

* a replica is **late** for this request when its predicted TTFT (RTT + learned line, :mod:`.fit`)
  exceeds the soonest one's by more than the fleet's mean TTFT − RTT (``SpeedFit.mean_wait_s``: a request
  sent there would wait a whole typical wait more than it must — a tail request);
* a replica **qualifies** when the request is not late there and the score ranks it within ``near`` × its
  best (the near set), or — outside the near set — its **measured decode time per token** (the mean over
  its recent completions, ``SpeedFit.decode_s``) is no longer than that of the replica the near set would
  have picked (its soonest);
* the qualifying replicas rank by the score; then the near set's late replicas by TTFT; then the rest.

Ranking the qualifying replicas by the score rather than by TTFT (session 7; before, the soonest of the
near set went first and a replica outside it only when every near one was late) is what sends short prompts
to the idle slow replicas *before* the fast ones fill up; the long prompts that come next are late on the
slow replicas and find the fast ones with room. The decode condition bounds the detour without a constant:
a fast replica outside the near set takes a request only while the requests it served decoded no slower than
those on the slow replica the score chose. It reads what the replicas' requests measured (the mean over the
fit's half-life), not session 6's line of TPOT on the requests in flight, read at the count in flight at
dispatch: that line judged a fast replica with a batch slower than an idle slow one whenever its count
peaked, and the long prompts arriving then went to the slow ones (70 % of the knee, 9 seeds: TTFT p99
1.34 s with the line and the TTFT order, 1.19 s with the line and the score's order, 1.08 s now). A
replica without 2 completions is read at its decode factor × the fleet's median measured time; before any
completion the detour is unbounded (the warm-up: the fast replicas are idle). Without any decode condition
(every late request detoured) the A100s' TPOT p90 reached 106 ms at 90 % of the knee and goodput fell 10 %
(3.73 → 3.36 req/s). The price: at 90 % of the knee goodput 1.2 % lower over 9 seeds (3.65 against 3.70
req/s; up to 5 % in one seed). Measurements in docs/auto.md.

**With a TPOT SLO** (``slo_tpot_s`` > 0; ``auto``'s ``slo_tpot_ms``; :func:`detour_slo`). Session 8 read the
user's objective in the decode condition — a replica outside the near set qualified while its measured 90th
percentile time per output token (:meth:`~.fit.SpeedFit.decode_p90_s`) was within it: TPOT headroom, as
llm-d's SLO scorer has it (a predicted p90 TPOT against the request's ``x-slo-tpot-ms``; llm-d's guide
*Predicted Latency based Load Balancing*). Session 9 (22y) found two faults in that rule on 2 A100 + 6 L4 at
70 % of the knee: the mean-wait margin let the L4s take 2,000–2,800-token prompts (first tokens of 0.9–1.4 s,
the whole TTFT tail) while the A100s had TPOT to spare (p90 26–55 ms; in seed 1 ``llm_d``, all on the A100s,
kept every TPOT), and a p90 measured at completion lags the load by a request's lifetime, so it cannot say
*when* the fast replicas must shed load. An A100's time per token follows its batch (a decode step grows with
the requests it serves: over 800 requests at 70 % the correlation of a request's TPOT with its replica's mean
count in flight was 0.95), and the load balancer's own count in flight is always current. So, given the SLO:

* a replica has **TPOT headroom** while the p90 time per output token predicted at its count in flight with
  this request added (:meth:`~.fit.SpeedFit.tpot_at`: a learned line of TPOT on the count, + 1.28 residual
  standard deviations) is within the SLO (unknown before 3 completions: headroom);
* a first token is **not a tail one** when it comes no later than the soonest or the fleet's p90 wait
  (:meth:`~.fit.SpeedFit.wait_p90_s`) — or, while the soonest replica has no headroom, no later than the soonest
  by a mean wait (the rule above: the fast way must shed load, the slow replicas take medium prompts);
* a replica **qualifies** when the first token is not a tail one there, it has headroom, and it is in the near
  set or its measured p90 TPOT is within the SLO; the qualifying ones rank by the score;
* a request no replica qualifies for (late on every slow replica, the fast ones without headroom) goes to the
  soonest replica whose predicted *mean* TPOT at its count is within the SLO — a long prompt stays on a fast
  replica while its requests' typical decode still meets the objective, and leaves only when it would not —
  then to the near set's by TTFT, then the rest.

Without the SLO every decision is as before. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed.fit import SpeedFit

OUTSIDE_S = 1e6  # added per tier to a predicted TTFT (seconds) that a better tier outranks


def detour(fit: SpeedFit, eps: list[Endpoint], ttft: list[float], scaled: list[float], limit: float,
           decode_factor: dict[str, float], slo_tpot_s: float = 0.0) -> list[float]:
    """Values (lower is better) ranking ``eps`` as the module says: ``ttft`` the predicted TTFTs (seconds),
    ``scaled`` the speed-scaled scores, ``limit`` the near set's bound on them, ``decode_factor`` the
    replicas' decode factors (for a replica whose decode is not measured yet), ``slo_tpot_s`` the TPOT SLO
    (0: none; given, :func:`detour_slo` ranks). The replicas that qualify rank by their score (scaled into
    [0, 1)), then the near set's late ones by TTFT, then the rest."""
    if slo_tpot_s > 0:
        return detour_slo(fit, eps, ttft, scaled, limit, decode_factor, slo_tpot_s)
    first = min(ttft) + fit.mean_wait_s()
    near = [v <= limit for v in scaled]
    pick = min(range(len(eps)), key=lambda i: ttft[i] + (0.0 if near[i] else OUTSIDE_S))
    tpot = _decode_reader(fit, decode_factor)
    bound = tpot(eps[pick])  # no worse than the near set's pick
    top = 1.0 + max(scaled)
    out = []
    for e, t, v, n in zip(eps, ttft, scaled, near):
        if t <= first and (n or bound is None or (tp := tpot(e)) is None or tp <= bound):
            out.append(v / top)
        else:
            out.append(t + (1 if n else 2) * OUTSIDE_S)
    return out


def _decode_reader(fit: SpeedFit, decode_factor: dict[str, float]) -> Callable[[Endpoint], float | None]:
    """A replica's measured mean time per output token; unmeasured, its decode factor × the fleet's median
    measured one; None before any replica is measured."""
    dec = fit.decode_s()
    mid = median(dec.values()) if dec else None

    def tpot(e: Endpoint) -> float | None:
        t = dec.get(e.id)
        return t if t is not None or mid is None else mid * decode_factor.get(e.id, 1.0)
    return tpot


def detour_slo(fit: SpeedFit, eps: list[Endpoint], ttft: list[float], scaled: list[float], limit: float,
               decode_factor: dict[str, float], slo_tpot_s: float) -> list[float]:
    """:func:`detour` given the TPOT SLO (the module's last section): a replica qualifies when its first token is
    not a tail one (no later than the soonest or the fleet's p90 wait — the mean wait past the soonest while the
    soonest replica has no TPOT headroom), it has TPOT headroom at its count in flight, and it is in the near set
    or its measured p90 TPOT is within the SLO; the qualifying ones rank by score, then the soonest of those
    whose predicted mean TPOT is within the SLO, then the near set's by TTFT, then the rest."""
    soonest = min(range(len(eps)), key=lambda i: ttft[i])
    now = [fit.tpot_at(e.id, e.inflight + 1) for e in eps]  # (mean, p90) at this load, this request added
    headroom = [p is None or p[1] <= slo_tpot_s for p in now]
    if headroom[soonest]:
        first = max(ttft[soonest], fit.wait_p90_s())
    else:  # the fast way must shed load: the slow replicas take what is late by less than a typical wait
        first = ttft[soonest] + fit.mean_wait_s()
    near = [v <= limit for v in scaled]
    tpot = _decode_reader(fit, decode_factor)
    p90 = fit.decode_p90_s()

    def decode(e: Endpoint) -> float | None:
        return p90[e.id] if e.id in p90 else tpot(e)

    top = 1.0 + max(scaled)
    out = []
    for e, t, v, n, h, p in zip(eps, ttft, scaled, near, headroom, now):
        if t <= first and h and (n or (tp := decode(e)) is None or tp <= slo_tpot_s):
            out.append(v / top)
        else:
            out.append(t + (1 if p is None or p[0] <= slo_tpot_s else 2 if n else 3) * OUTSIDE_S)
    return out
