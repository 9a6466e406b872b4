"""Replica speed as plugins: ``SpeedPlugin`` feeds the per-replica fit (:mod:`.fit`: prefill work at
dispatch, TTFT at first token, decode time at completion); ``SpeedLMetric`` (scorer
``lmetric_speed``) is LMetric's score with each factor scaled by the replica's learned slowness.
``state()`` is exported under ``lmetric_speed.``.
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.adaptive.replica_speed.datasheet import prior_times
from kvroute.policy.adaptive.replica_speed.detour import OUTSIDE_S, detour
from kvroute.policy.adaptive.replica_speed.fit import DEFAULT_HALFLIFE, SpeedFit
from kvroute.policy.adaptive.replica_speed.prior import prior_factors, prior_predict
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import DecisionState, Scorer
from kvroute.policy.shared import shared


def speed_fit(shared_fit: str, min_samples: int, halflife: int, spread: float, z: float) -> SpeedFit:
    """The replica-speed fit for these settings: with a ``shared_fit`` name, the one every plugin of the policy
    giving the same name and settings uses (:mod:`kvroute.policy.shared`) — each event is then learned once,
    however many copies hear it (the fit consumes a request's record at its first hearing); else a new one."""
    def make() -> SpeedFit:
        return SpeedFit(min_samples=min_samples, halflife=halflife, spread=spread, z=z)
    key = ("lmetric_speed", shared_fit, min_samples, halflife, spread, z)
    return shared(key, make) if shared_fit else make()


class SpeedPlugin(Lifecycle):
    """Feeds the replica-speed fit from the Router's lifecycle events."""

    name = "lmetric_speed"

    def __init__(self, fit: SpeedFit):
        self.fit = fit

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Remember the prefill work queued on the replica (this request's included) and the RTT."""
        self.fit.dispatched(req.id, endpoint.id, endpoint.queued_prefill_tokens, endpoint.rtt_s)

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """One prefill observation."""
        self.fit.first_token(req_id, ttft_s)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """One decode observation."""
        self.fit.finished(req_id, endpoint_id, e2e_s, output_tokens)

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """No observation."""
        self.fit.forget(req_id)

    def state(self) -> dict[str, float]:
        """Per replica: learned times, factors, observations; ``mixed``."""
        return self.fit.state()


@register_plugin
class SpeedLMetric(Scorer, SpeedPlugin):
    """LMetric §4's P-tokens × BS on hardware learned online: (queued prefill + new prefill) ×
    prefill factor × (batch + 1) × decode factor, the factors being each replica's measured prefill
    and decode time over the fleet's median (:class:`~.fit.SpeedFit`; all 1 unless the measured
    prefill and decode times both spread past ``spread``, and then it equals ``lmetric``).

    On equal load the score scales with both times, so at balance a replica k× faster at both
    carries k× the load (the score grows as load², LMetric's two factors each growing with it).
    ``learn: false`` learns nothing and is LMetric's score as is (``auto``'s ``speed: false``, for
    its trust region as for its incumbent).

    ``live_batch``: the batch term counts at least the requests this load balancer has in flight on
    the replica (dispatched, not finished: its own accounting, always current) — max(probed running +
    waiting + dispatched since the probe, in flight). An SGLang engine writes its running and
    waiting gauges only when it forms a prefill batch or every 40th decode step
    (sim/queue_gauge.py), so a probe every 100 ms can read a batch seconds old, and the dispatches
    counted since the probe start again from 0 at every probe: the requests sent between the
    gauge's last write and the probe vanish from the batch term. Behind one load balancer the count
    in flight is the replica's batch (plus requests on the wire); behind several the probe still
    carries the others' share.

    ``ttft_pick`` (on a fleet judged mixed only): among the replicas this score ranks within
    ``near`` × its best, the one with the least predicted TTFT (RTT + the replica's learned line of
    TTFT on queued prefill work, :meth:`~.fit.SpeedFit.predict_ttft`) — the score keeps each
    replica's load in proportion to its speed (TPOT, stability), the prediction picks among the
    replicas it judges near-equal the one that answers first. On 2 A100 + 6 L4 the score alone
    sends an L4 a 3,000-token prompt (~1.5 s there, ~0.4 s on an A100) whenever the A100s' batch
    factor outweighs their speed; llm-d's predicted TTFT alone (its profile as an oracle) keeps the
    L4s idle at half the knee but overloads the A100s' decode past it (TPOT SLO missed at 70 %,
    unstable at 90 %). Replicas outside the near set rank after every one inside it.

    ``slo_tpot_ms`` (0: none): the user's TPOT objective; with ``detour``, a slow replica takes only first tokens
    that are not tail ones while the fast ones have TPOT headroom at their count in flight, and a replica outside
    the near set only while its measured p90 time per output token is within it (:func:`~.detour.detour_slo`).

    ``shared_fit``: a name; the ``lmetric_speed`` copies of one policy that give the same name and the same
    fit settings (``min_samples``, ``halflife``, ``spread``, ``z``, ``learn``) learn into one
    :class:`~.fit.SpeedFit` (:mod:`kvroute.policy.shared`) — ``auto``'s incumbent and its trust regions, which
    hear the same events and so learned equal fits, one refresh per event instead of one per copy. Every copy
    sharing a fit must hear the lifecycle events (a rule's scorer, or a ``near_best`` / ``uniform_fleet``
    forwarding them): one that does not would read what the others learn. Empty (default): a fit of its own."""

    name = "lmetric_speed"
    inputs = frozenset({"prefix", "prefill_backlog", "load"})

    def __init__(self, min_samples: int = 16, halflife: int = DEFAULT_HALFLIFE, spread: float = 1.5,
                 z: float = 2.0, learn: bool = True, live_batch: bool = False, ttft_pick: bool = False,
                 near: float = 2.0, detour: bool = False, shared_fit: str = "", slo_tpot_ms: float = 0.0):
        SpeedPlugin.__init__(self, speed_fit(shared_fit if learn else "", min_samples, halflife, spread, z))
        if near < 1:
            raise ValueError(f"near must be >= 1, got {near}")
        if slo_tpot_ms < 0:
            raise ValueError(f"slo_tpot_ms must be >= 0, got {slo_tpot_ms}")
        self.slo_tpot_s = slo_tpot_ms / 1000.0
        self.learn, self.live_batch, self.ttft_pick, self.near, self.detour = learn, live_batch, ttft_pick, near, detour
        self.dispatches = 0
        self.floored = 0  # dispatches whose target counted more requests in flight than its probe showed
        # caches of pure functions of the candidates' declared accelerators (and of the fit's version)
        self._declared: tuple[tuple[tuple[str, str], ...], dict[str, tuple[float, float]]] = ((), {})
        self._prior_cache: tuple[object, tuple[dict[str, float], dict[str, float]]] = (None, ({}, {}))

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Learns only with ``learn``; counts how often the in-flight floor was above the probed batch."""
        if self.live_batch:
            self.dispatches += 1
            # both counts include this request (the Router counted it before telling the plugins)
            self.floored += endpoint.inflight > endpoint.running + endpoint.waiting + endpoint.dispatched_since_probe
        if self.learn:
            SpeedPlugin.on_dispatched(self, req, endpoint, new_prefill_tokens)

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Learns only with ``learn``."""
        if self.learn:
            SpeedPlugin.on_first_token(self, req_id, endpoint_id, ttft_s)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """Learns only with ``learn``."""
        if self.learn:
            SpeedPlugin.on_finished(self, req_id, endpoint_id, e2e_s, output_tokens)

    def state(self) -> dict[str, float]:
        """The fit's state; with ``live_batch``, ``batch_floor_share``: the share of dispatches whose target
        had more of this load balancer's requests in flight than its probe showed (a gauge behind)."""
        out = self.fit.state()
        prior = self._declared[1] if self.learn else {}
        if prior:  # the declared accelerators differ: the factors in use are those the prior completes
            out["prior"] = out["mixed"] = 1.0
            pf, df = self._factors(prior)
            for ep in prior:
                out[f"{ep}.prefill_factor"], out[f"{ep}.decode_factor"] = pf.get(ep, 1.0), df.get(ep, 1.0)
        if self.live_batch:
            out["batch_floor_share"] = round(self.floored / self.dispatches, 4) if self.dispatches else 0.0
        return out

    def prior(self, eps: list[Endpoint]) -> dict[str, tuple[float, float]]:
        """The datasheet prior of ``eps`` (:func:`~.datasheet.prior_times`): empty unless their declared
        accelerators differ past ``spread`` in compute and bandwidth alike, or with ``learn: false``."""
        key = tuple((e.id, e.accelerator) for e in eps if e.accelerator is not None) if self.learn else ()
        if key != self._declared[0]:
            self._declared = (key, prior_times(dict(key), self.fit.spread))
        return self._declared[1]

    def _factors(self, prior: dict[str, tuple[float, float]]) -> tuple[dict[str, float], dict[str, float]]:
        """The factors the prior completes (:func:`~.prior.prior_factors`), recomputed only after an observation."""
        key = (self._declared[0], self.fit.version)
        if self._prior_cache[0] != key:
            self._prior_cache = (key, prior_factors(self.fit, prior))
        return self._prior_cache[1]

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """LMetric's score per endpoint, times its prefill and decode factors; lower is better."""
        prior = self.prior(eps)
        pf, df = self._factors(prior) if prior else self.fit.factors()
        base: list[float]
        if self.live_batch:
            base = [(e.queued_prefill_tokens + n) * (max(e.running + e.waiting + e.dispatched_since_probe,
                                                         e.inflight) + 1)
                    for n, e in zip(st.new_prefill(eps), eps)]
        else:
            base = st.lmetric(eps)  # LMetric's score, computed once per decision (shared: not modified)
        if not pf and not df:
            return base
        scaled = [b * pf.get(e.id, 1.0) * df.get(e.id, 1.0) for b, e in zip(base, eps)]
        if not self.ttft_pick:
            return scaled
        limit = self.near * min(scaled)
        work = [(e.id, float(e.queued_prefill_tokens + n)) for n, e in zip(st.new_prefill(eps), eps)]
        predicted = prior_predict(self.fit, work, prior) if prior else self.fit.predict_ttft(work)
        if predicted is None:  # the prior alone: no replica measured yet, no seconds to compare
            return scaled
        ttft = [t + e.rtt_s for t, e in zip(predicted, eps)]
        if self.detour:
            return detour(self.fit, eps, ttft, scaled, limit, df, self.slo_tpot_s)
        # seconds; a replica the score ranks out of the near set goes after every one inside it
        return [t + (0.0 if v <= limit else OUTSIDE_S) for t, v in zip(ttft, scaled)]

