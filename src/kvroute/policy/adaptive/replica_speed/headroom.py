"""``busy_uncached_headroom``: ``busy_uncached`` (a cached turn's uncached tokens counted once more while the
candidates are busy, ``auto``'s ``busy_prefill``) — but not while the replica holding the request's longest
cached prefix has no TPOT headroom: its measured p90 time per output token (:meth:`~.fit.SpeedFit.decode_p90_s`,
read from the policy's shared replica-speed fit) above the deployment's TPOT SLO (``slo_tpot_ms``).

Why: the term keeps a conversation or a tree with its cache while every replica queues prefill, and a prefill
saved is work no queue waits for — but a replica that keeps its conversations also keeps their decodes. Behind
SkyWalker's two layers with two replicas per region (live-3region-skewed at 90 % of the knee) the term lost
TPOT attainment (seeds 0 and 2: 0.859 / 0.853 against 0.880 / 0.974 without it) and 4 % of goodput. Where that
replica's recent requests already miss the TPOT objective one time in ten, the cache it offers is paid for in
decode time, so the rule falls back to the least work alone for that decision. Without an SLO (0, the default)
it is ``busy_uncached`` exactly. Measured in docs/auto.md (session 8, 22w). Pure.
"""

from __future__ import annotations

from kvroute.model import Endpoint
from kvroute.policy.adaptive.replica_speed.fit import DEFAULT_HALFLIFE
from kvroute.policy.adaptive.replica_speed.plugin import speed_fit
from kvroute.policy.catalog import new_scorer, register_plugin
from kvroute.policy.plugins import DecisionState, Scorer


@register_plugin
class BusyUncachedHeadroom(Scorer):
    """``busy_uncached``, 0 for the decision while the best-cached candidate's measured p90 TPOT exceeds
    ``slo_tpot_ms`` (module docstring). ``shared_fit`` / ``min_samples`` / ``spread`` name the replica-speed fit
    to read (``auto``: the incumbent's, which the other copies of its score teach); this scorer learns nothing."""

    name = "busy_uncached_headroom"
    inputs = frozenset({"prefix", "prefill_backlog"})

    def __init__(self, slo_tpot_ms: float = 0.0, shared_fit: str = "", min_samples: int = 16, spread: float = 1.5):
        if slo_tpot_ms < 0:
            raise ValueError(f"slo_tpot_ms must be >= 0, got {slo_tpot_ms}")
        self.slo_tpot_s = slo_tpot_ms / 1000.0
        self.fit = speed_fit(shared_fit, min_samples, DEFAULT_HALFLIFE, spread, 2.0)
        self.busy = new_scorer("busy_uncached")  # the term itself (builtin/scorers.py)

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """``busy_uncached``'s values, or 0 everywhere while the best-cached candidate lacks TPOT headroom."""
        if self.slo_tpot_s > 0 and eps:
            got = st.matches.get
            best = max(eps, key=lambda e: got(e.id, 0))
            if got(best.id, 0) > 0 and self.fit.decode_p90_s().get(best.id, 0.0) > self.slo_tpot_s:
                return [0.0] * len(eps)
        return self.busy.values(st, eps)
