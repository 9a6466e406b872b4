"""The cross-region decisions between load balancers (pure: no I/O, no clock), shared by the
simulator (``sim/balancer.py``) and the gateway (``gateway/peers.py``), which wire them to their
peers' probes and forwards.

* SkyWalker two-layer (SkyWalker §3.2): :func:`peer_router` builds the peer layer, the local
  preset over the peer load balancers with the pending gate; :func:`skywalker_peer_choice` asks it.
* GORGO distributed (GORGO v1 §3.3-3.4): :func:`gorgo_peer_choice` compares the best local cost
  with each peer's, with the ``gorgo`` preset's weights (:class:`GorgoWeights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvroute.model import Endpoint, Request
from kvroute.policy.base import hard_filter
from kvroute.policy.registry import policy_from_config
from kvroute.policy.router import Router


@dataclass(frozen=True)
class GorgoWeights:
    """GORGO's cost weights (v2 starting point unless the gorgo preset sets them)."""

    w_rtt: float = 0.5  # per ms of RTT
    t_p: float = 1.0  # per uncached prompt token
    w_queue: float = 0.1  # per queued token
    queue: str = "inflight"  # queued tokens: in flight, or prefill not yet past first token (gorgo's queue)

    @classmethod
    def of(cls, params: object) -> GorgoWeights:
        """The weights a policy's params carry, defaults for the ones it lacks."""
        d = cls()
        return cls(getattr(params, "w_rtt", d.w_rtt), getattr(params, "t_p", d.t_p),
                   getattr(params, "w_queue", d.w_queue), getattr(params, "queue", d.queue))

    def queued(self, e: Endpoint) -> int:
        """The endpoint's queued tokens as these weights count them."""
        return e.queued_prefill_tokens if self.queue == "prefill" else e.inflight_tokens

    def base(self, rtt_s: float, queued_tokens: float) -> float:
        """The prompt-independent part of :meth:`cost` (what a gateway advertises to its peers)."""
        return self.w_rtt * 1000.0 * rtt_s + self.w_queue * queued_tokens

    def cost(self, rtt_s: float, uncached_tokens: float, queued_tokens: float) -> float:
        """GORGO's cost of one endpoint, ``w_rtt·RTT_ms + w_queue·queued + t_p·uncached``: the
        sum the ``gorgo`` preset composes from its scorers (``rtt_ms``, ``inflight_tokens``,
        ``uncached_tokens``), for decisions made outside a Router (between gateways)."""
        return self.base(rtt_s, queued_tokens) + self.t_p * uncached_tokens


def gorgo_peer_choice(req: Request, local: list[Endpoint], local_matches: dict[str, int], local_backlog: int,
                      peers: list[Endpoint], peer_matches: dict[str, int], peer_base: dict[str, float],
                      w: GorgoWeights) -> str | None:
    """GORGO distributed's decision: the peer to forward ``req`` to, or None to stay local.

    Pure: ``local`` are this gateway's replicas with their probed RTT and in-flight tokens,
    ``local_backlog`` the prompt tokens waiting in its LB queue, ``peer_base`` each peer's
    advertised ``gorgo_base_cost``. Only endpoints that pass the hard filters (routable, in the
    request's residency zone, not excluded) count; a peer also needs an available replica. Ties
    stay local."""
    tokens, bt = req.prompt_tokens, req.block_tokens
    local_cost = min((w.cost(e.rtt_s, max(0, tokens - bt * local_matches.get(e.id, 0)), w.queued(e))
                      for e in hard_filter(req, local)), default=math.inf)
    local_cost += w.w_queue * local_backlog
    best, best_cost = None, local_cost
    for p in hard_filter(req, peers):
        base = peer_base.get(p.id, math.inf)
        if p.peer_available <= 0 or not math.isfinite(base):
            continue
        cost = w.cost(p.rtt_s, max(0, tokens - bt * peer_matches.get(p.id, 0)), 0) + base
        if cost < best_cost:
            best, best_cost = p.id, cost
    return best


def peer_router(policy: str | dict[str, Any], peers: list[Endpoint], seed: int, **router: Any) -> Router:
    """The peer layer of SkyWalker's two-layer routing: the local preset and params over the peer
    endpoints, with the pending gate (the peer condition) and seed + 1; its prefix index is the
    regional snapshot (what went where). ``router``: the Router's index settings."""
    return Router(policy_from_config(policy, seed + 1, overrides={"admission": "pending"}), peers, **router)


def skywalker_peer_choice(router: Router, req: Request, behind: int) -> str | None:
    """SkyWalker's second layer: the peer the preset picks among those that admit ``req`` now,
    or None. ``behind``: requests in the local queue after it. A pick is committed to
    ``router`` (the snapshot index learns the prefix went there). A forwarded request never
    goes on."""
    if req.from_peer or not router.endpoints:
        return None
    router.view.local_queue = behind
    d = router.route(req)
    return d.target if d.dispatched else None
