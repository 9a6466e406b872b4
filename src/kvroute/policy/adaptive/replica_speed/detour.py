"""The detour of ``lmetric_speed``'s TTFT pick (``detour``; ``auto``'s ``speed_detour``): on a fleet judged
mixed, a request the speed-scaled score would leave to a replica where its first token comes late goes to
one where it comes soon, unless that would make its decode slower.

The scaled score keeps each replica's load in proportion to its speed, which is what keeps TPOT and
stability; among the replicas it ranks within ``near`` × its best, the TTFT pick takes the one whose first
token the learned lines predict soonest. On 2 A100 + 6 L4 that near set is often the idle L4s alone — the
A100s' batch factor puts them out of it — and then a 3,500-token prompt waits ~1.7 s on an L4 for a first
token an A100 would give in ~0.5 s (seed 0 at 70 % of the knee: 113 of 800 requests on the L4s, their TTFT
p50 0.97 s; those are the TTFT tail). The load the score wants on the L4s can as well be their share of
the *short* prompts, which an L4 prefills about as fast as an A100 a long one. So:

* a replica is **late** for this request when its predicted TTFT (RTT + learned line, :mod:`.fit`)
  exceeds the soonest one's by more than the fleet's mean TTFT − RTT (``SpeedFit.mean_wait_s``: a request
  sent there would wait a whole typical wait more than it must — a tail request);
* the pick is, in order: a replica of the near set that is not late (as before); else one outside it that
  is not late and whose **predicted TPOT** with this request added — its own fitted line of time per
  output token on the requests in flight at dispatch (``SpeedFit.tpot_at``) — is no worse than on the
  replica the near set would have picked; else the near set's (late) pick; else the rest.

The TPOT condition bounds the detour without a constant: a fast replica takes the long prompt only
while the request's decode there is predicted no slower than on the slow replica the score chose, so the
fast replicas' TPOT stays at the slow ones' at most. Without it (every late request detoured) the A100s'
TPOT p90 reached 106 ms at 90 % of the knee and goodput fell 10 % (3.73 → 3.36 req/s); measurements in
docs/auto.md. A replica without 3 completions is read at its decode factor × the fleet's median decode
time; before any completion the detour is unbounded (the warm-up: the fast replicas are idle). Pure.
"""

from __future__ import annotations

from statistics import median

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed.fit import SpeedFit

OUTSIDE_S = 1e6  # added per tier to a predicted TTFT (seconds) that a better tier outranks


def detour(fit: SpeedFit, eps: list[Endpoint], ttft: list[float], scaled: list[float], limit: float,
           decode_factor: dict[str, float]) -> list[float]:
    """Values (lower is better) ranking ``eps`` as the module says: ``ttft`` the predicted TTFTs (seconds),
    ``scaled`` the speed-scaled scores, ``limit`` the near set's bound on them."""
    first = min(ttft) + fit.mean_wait_s()
    near = [v <= limit for v in scaled]
    pick = min(range(len(eps)), key=lambda i: ttft[i] + (0.0 if near[i] else OUTSIDE_S))
    dec = fit.decode_s()
    mid = median(dec.values()) if dec else None

    def tpot(e: Endpoint) -> float | None:
        t = fit.tpot_at(e.id, e.inflight + 1)
        return t if t is not None or mid is None else mid * decode_factor.get(e.id, 1.0)

    mine = tpot(eps[pick])
    out = []
    for e, t, n in zip(eps, ttft, near):
        soon = t <= first
        if n and soon:
            out.append(t)
        elif soon and (mine is None or ((tp := tpot(e)) is not None and tp <= mine)):
            out.append(t + OUTSIDE_S)
        else:
            out.append(t + (2 if n else 3) * OUTSIDE_S)
    return out
