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

**With a TPOT SLO** (``slo_tpot_s`` > 0; ``auto``'s ``slo_tpot_ms``, session 8): the decode condition reads
the user's objective instead of the near set's pick — a replica outside the near set qualifies while its
measured 90th percentile time per output token (:meth:`~.fit.SpeedFit.decode_p90_s`) is within the SLO:
it has TPOT headroom, as llm-d's SLO scorer has it (a predicted p90 TPOT against the request's
``x-slo-tpot-ms``; llm-d's guide *Predicted Latency based Load Balancing*). Without the SLO the bound
must be relative (no worse than where the score would send it) and keeps long prompts on the slow
replicas whenever a fast one's batch has grown; with it a fast replica takes them while its TPOT
leaves room. Pure.
"""

from __future__ import annotations

from statistics import median

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed.fit import SpeedFit

OUTSIDE_S = 1e6  # added per tier to a predicted TTFT (seconds) that a better tier outranks


def detour(fit: SpeedFit, eps: list[Endpoint], ttft: list[float], scaled: list[float], limit: float,
           decode_factor: dict[str, float], slo_tpot_s: float = 0.0) -> list[float]:
    """Values (lower is better) ranking ``eps`` as the module says: ``ttft`` the predicted TTFTs (seconds),
    ``scaled`` the speed-scaled scores, ``limit`` the near set's bound on them, ``decode_factor`` the
    replicas' decode factors (for a replica whose decode is not measured yet), ``slo_tpot_s`` the TPOT SLO
    (0: none). The replicas that qualify rank by their score (scaled into [0, 1)), then the near set's late
    ones by TTFT, then the rest."""
    first = min(ttft) + fit.mean_wait_s()
    near = [v <= limit for v in scaled]
    pick = min(range(len(eps)), key=lambda i: ttft[i] + (0.0 if near[i] else OUTSIDE_S))
    dec = fit.decode_s()
    mid = median(dec.values()) if dec else None

    def tpot(e: Endpoint) -> float | None:
        t = dec.get(e.id)
        return t if t is not None or mid is None else mid * decode_factor.get(e.id, 1.0)

    # with the SLO: headroom under it (the measured p90, else as above); without: no worse than the near set's pick
    p90 = fit.decode_p90_s() if slo_tpot_s > 0 else {}
    bound = slo_tpot_s if slo_tpot_s > 0 else tpot(eps[pick])

    def decode(e: Endpoint) -> float | None:
        return p90[e.id] if e.id in p90 else tpot(e)

    top = 1.0 + max(scaled)
    out = []
    for e, t, v, n in zip(eps, ttft, scaled, near):
        if t <= first and (n or bound is None or (tp := decode(e)) is None or tp <= bound):
            out.append(v / top)
        else:
            out.append(t + (1 if n else 2) * OUTSIDE_S)
    return out
