"""Filters: keep the candidates that pass (a preset's ``filters``, a rule's ``among``)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from kvroute.model import Endpoint, Request
from kvroute.policy.catalog import new_scorer, register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Filter


@register_plugin
class Residency(Filter):
    """Endpoints in the request's residency zone (also one of the hard filters every policy runs)."""

    name = "residency"

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """``eps`` in the request's zone; all of them when the request names none."""
        zone = st.req.residency
        return eps if zone is None else [e for e in eps if e.zone == zone]


@register_plugin
class LowQueue(Filter):
    """Endpoints with at most ``max_waiting`` waiting requests; all of them when none has so few
    (llm-d's low-queue filter: a soft preference, never a reason to refuse)."""

    name = "low_queue"
    inputs = frozenset({"load"})

    def __init__(self, max_waiting: int = 0):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The endpoints at or under ``max_waiting`` waiting, or all of ``eps`` when none is."""
        limit = self.max_waiting
        kept = [e for e in eps if e.waiting <= limit]
        return kept or eps


@register_plugin
class BestPrefix(Filter):
    """The endpoints holding the longest cached prefix of the prompt (none when nobody holds any)."""

    name = "best_prefix"
    inputs = frozenset({"prefix"})

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The endpoints tied for the longest match; empty when no endpoint matched a block."""
        best = st.best_match(eps)
        if not best:
            return []
        get = st.matches.get
        return [e for e in eps if get(e.id, 0) == best]


@register_plugin
class CachedWithinSpread(Filter):
    """Endpoints holding some of the prefix whose batch is at most mean + ``std_factor`` × σ of
    the candidates' batch sizes (AIBrix's prefix-cache router)."""

    name = "cached_within_spread"
    inputs = frozenset({"prefix", "load"})

    def __init__(self, std_factor: float = 1.0):
        if std_factor < 0:
            raise ValueError(f"std_factor must be >= 0, got {std_factor}")
        self.std_factor = std_factor

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The matching endpoints whose batch is within the spread limit; empty without any match."""
        matches = st.matches
        if not matches:
            return []
        loads = [e.running + e.waiting + e.dispatched_since_probe for e in eps]  # batch_size, inlined
        limit = statistics.fmean(loads) + self.std_factor * statistics.pstdev(loads)
        return [e for e, b in zip(eps, loads) if e.id in matches and b <= limit]


@register_plugin
class NearBest(Filter, Lifecycle):
    """Endpoints whose ``scorer`` value is within ``factor`` × the best one's: a trust region around
    another rule's choice. ``auto`` lets GORGO's cost choose only among the replicas LMetric's score
    ranks near its best, so trialling the challenger can never send a request where the incumbent
    judges it far worse (a hot prefix's cached replica with a long queue) — safe exploration.

    ``scorer`` is a name or ``{name: {argument: value}}`` — the trust region must judge with the
    same settings as the rule it guards (``auto`` passes its ``speed`` / ``speed_spread`` on). A
    scorer that learns (``lmetric_speed``) hears the lifecycle events through this filter, so it
    learns what the rule's own copy learns; its state is exported by that copy, not repeated here."""

    name = "near_best"
    inputs = frozenset({"prefix", "prefill_backlog", "load"})

    def __init__(self, scorer: str | Mapping[str, Mapping[str, Any] | None] = "lmetric", factor: float = 2.0):
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        if isinstance(scorer, Mapping):
            if len(scorer) != 1:
                raise ValueError(f"scorer: expected a name or {{name: {{argument: value}}}}, got {scorer!r}")
            ((name, args),) = scorer.items()
        else:
            name, args = scorer, None
        self.scorer, self.factor = new_scorer(name, dict(args) if args else None), factor
        if not self.scorer.lower_is_better:
            raise ValueError(f"near_best: scorer {name!r} is higher-is-better; it needs a cost")
        self._hears = self.scorer if isinstance(self.scorer, Lifecycle) else None

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Forwarded to a scorer that learns."""
        if self._hears is not None:
            self._hears.on_dispatched(req, endpoint, new_prefill_tokens)

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Forwarded to a scorer that learns."""
        if self._hears is not None:
            self._hears.on_first_token(req_id, endpoint_id, ttft_s)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Forwarded to a scorer that learns."""
        if self._hears is not None:
            self._hears.on_finished(req_id, endpoint_id, e2e_s, output_tokens)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """Forwarded to a scorer that learns."""
        if self._hears is not None:
            self._hears.on_failed(req_id, endpoint_id)

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """``eps`` scoring at most ``factor`` × the lowest score (all of them when every score is 0)."""
        values = self.scorer.values(st, eps)
        limit = self.factor * min(values)
        return [e for e, v in zip(eps, values) if v <= limit] if limit > 0 else \
            [e for e, v in zip(eps, values) if v <= 0]


@register_plugin
class LocalFirst(Filter):
    """Across regions, the nearest region's free replicas while one is free; every candidate otherwise.

    Several load balancers that may each send anywhere (GORGO v1's distributed mode) learn of one
    another's requests on a replica only from its probe, and an SGLang engine's queue gauge can be
    40 decode steps old (``sim/queue_gauge.py``): a remote replica that looks idle to every LB draws
    all of them within one probe interval (herding on stale load information). Serving from the
    nearest region first — SkyWalker §3.2 forwards only when no local replica is available, GORGO
    v1 §3.3 serves locally while the local region can admit — leaves most of a replica's load to one
    LB, which accounts for it exactly, and saves the round trip. A nearby replica is *free* when
    this LB has no prefill of its own queued there (``queued_prefill_tokens``: dispatched, no first
    token yet), its last probe showed nothing waiting (a request sent there starts its prefill at
    once), and its batch — max(probed running + waiting + dispatched since the probe, this LB's
    requests in flight), as ``auto``'s LMetric score counts it — is no larger than every farther
    replica's: staying near never makes a nearby replica the most loaded one, so the decode batches
    (and the time per output token, which grows with them) stay within the range the other
    regions already run. When no nearby replica is free every candidate competes, so the other
    regions' capacity is still used. Regions are told apart by measured probe RTTs (``ms``, as
    ``rtt_spread_above``); candidates within ``ms`` of each other — one region — are all kept.
    ``on: false`` disables it.
    """

    name = "local_first"
    inputs = frozenset({"rtt", "load", "prefill_backlog"})

    def __init__(self, ms: float = 10.0, on: bool = True):
        if ms < 0:
            raise ValueError(f"ms must be >= 0, got {ms}")
        self.ms, self.on = ms, on

    def filter(self, st: DecisionState, eps: list[Endpoint]) -> list[Endpoint]:
        """The nearest region's free endpoints, or all of ``eps`` when they sit in one region or none is free."""
        if not self.on or len(eps) < 2:
            return eps
        rtts = [e.rtt_s for e in eps]
        near = min(rtts) + self.ms / 1000.0
        if max(rtts) <= near:  # one region: nothing is farther, no batch is computed (decision cost, docs/hot-path.md)
            return eps
        # the cheap tests first: only a nearby replica with nothing waiting can be free
        free = [e for e, r in zip(eps, rtts) if r <= near and not e.waiting and not e.queued_prefill_tokens]
        if not free:
            return eps
        far = [e for e, r in zip(eps, rtts) if r > near]
        if not far:  # (a NaN RTT first in the list makes max() NaN)
            return eps
        # the largest batch (max(probed, in flight)) farther away: the max of either term's max
        limit = max(max([e.running + e.waiting + e.dispatched_since_probe for e in far]),
                    max([e.inflight for e in far]))
        free = [e for e in free if e.running + e.waiting + e.dispatched_since_probe <= limit and e.inflight <= limit]
        return free or eps
