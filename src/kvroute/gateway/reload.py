"""What a config reload changes in place (``Runtime.reconfigure`` decides what changed): a kept
replica's address, events, region and weight, and the settings live objects copied at start —
breaker thresholds, stall detection, API keys. Requests in flight are untouched."""

from __future__ import annotations

from time import monotonic
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.gateway.upstream import UpstreamPool

if TYPE_CHECKING:
    from kvroute.gateway.config import GatewayConfig
    from kvroute.gateway.replica import Upstream
    from kvroute.replicas import ReplicaConfig


class Runtime(Protocol):
    """What a reload touches of ``gateway/runtime.py``'s Runtime (a protocol, so that this module
    does not import the runtime that calls it)."""

    upstreams: dict[str, Upstream]
    config: GatewayConfig
    stalls: Any
    keys: Any

    def follow_events(self, rc: ReplicaConfig) -> None:
        """Subscribe to the replica's KV events (or stop following them)."""


def update_replica(rt: Runtime, rc: ReplicaConfig) -> str:
    """Apply a kept replica's new config (a new address gets a new pool, new event settings a new
    subscription; its in-flight requests finish on the old connections); says what changed."""
    up = rt.upstreams[rc.name]
    if rc.url != up.config.url:
        up.pool.close()
        up.pool = UpstreamPool(rc.url, tls=rc.tls_context())
    if rc.kv_events != up.config.kv_events:
        rt.follow_events(rc)
    up.config, up.engine = rc, rc.engine
    up.endpoint.region, up.endpoint.weight = rc.region, rc.weight
    up.endpoint.zone = rc.zone or rc.region
    return f"updated {rc.name}"


def retune(rt: Runtime, new: GatewayConfig) -> list[str]:
    """Copy the reloaded breaker, stall and auth settings into the live objects; what changed."""
    changes = []
    if new.breaker != rt.config.breaker:
        bc = new.breaker
        for up in rt.upstreams.values():
            up.breaker.threshold, up.breaker.cooldown_s, up.breaker.successes_to_close = (
                bc.failures, bc.cooldown_s, bc.successes)
        changes.append("breaker thresholds")
    if new.stall != rt.config.stall:
        detector = rt.stalls.detector
        detector.factor, detector.min_s, detector.max_s = new.stall.factor, new.stall.min_s, new.stall.max_s
        changes.append("stall detection")
    if new.auth != rt.config.auth:
        rt.keys = new.auth.key_ring(monotonic()).keeping_usage_of(rt.keys)
        changes.append("api keys")
    return changes
