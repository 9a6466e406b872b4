"""An endpoint: a replica (an engine) or a peer load balancer, with its load indicators.

Indicators come from three producers, kept apart so a reader knows how fresh each is:

* static capacity, from configuration;
* probed state (running, waiting, KV usage, RTT, health), refreshed by probes and therefore
  stale by up to one probe interval;
* router-side accounting (in-flight requests and tokens, queued prefill tokens), changed by the
  :class:`~kvroute.policy.router.Router` at dispatch and undone on every exit, so it is always
  current — the defence against bursts landing on one replica between two probes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class EndpointKind(str, Enum):
    """What an endpoint stands for: an engine replica or another region's load balancer."""

    REPLICA = "replica"
    PEER = "peer"  # another region's load balancer (two-layer routing)


@dataclass(slots=True)
class Endpoint:
    """A replica or peer load balancer as a policy sees it: static capacity, the last probe's readings and the
    router's own in-flight accounting. The simulator and the gateway fill the same fields."""

    id: str
    region: str = "local"
    kind: EndpointKind = EndpointKind.REPLICA
    zone: str | None = None  # residency zone; defaults to the region
    weight: float = 1.0
    # prefill/decode disaggregation (policy/pd.py): "prefill" engines only prefill and hand the KV
    # to a "decode" engine; "mixed" engines do both (every engine of an aggregated fleet)
    role: str = "mixed"
    # the replica's hardware profile when the runtime knows it (the simulator: its HardwareProfile; a
    # profile name works too); None = unknown. The llm_d predictor models the replica with it.
    profile: Any = None  # Any, not object: mypyc's dataclasses cannot name `object` (compiled build)
    # the accelerator the deployment declares for it (a key of policy/adaptive/replica_speed/datasheet.py:
    # the config's replicas[].accelerator, a node's nvidia.com/gpu.product); None = not declared. Unlike
    # ``profile`` it is what a live gateway knows: `auto` reads its datasheet numbers as a speed prior.
    accelerator: str | None = None
    # static capacity
    kv_blocks: int = 0  # 0 = unknown
    block_size: int = 16
    max_running: int = 256
    # probed state
    running: int = 0
    waiting: int = 0  # pending: admitted by the engine but not yet in its running batch
    kv_usage: float = 0.0  # 0..1
    rtt_s: float = 0.0
    healthy: bool = True
    circuit_open: bool = False
    warming: bool = False  # joined, or came back with an empty cache, while others hold theirs
    probe_age_s: float = 0.0
    # peer load balancers only (SkyWalker's /conf): LB queue length and non-full replicas
    peer_queue: int = 0
    peer_available: int = 0
    # router-side accounting (always current)
    inflight: int = 0
    inflight_tokens: int = 0  # prompt tokens of requests dispatched and not finished
    queued_prefill_tokens: int = 0  # new prefill tokens dispatched and not yet past first token
    dispatched_since_probe: int = 0

    def __post_init__(self) -> None:
        if self.zone is None:
            self.zone = self.region

    @property
    def routable(self) -> bool:
        """Healthy and its circuit breaker closed: policies may send to it."""
        return self.healthy and not self.circuit_open

    @property
    def batch_size(self) -> int:
        """Engine batch size (running + waiting) as last probed, plus what was sent since.

        This is LMetric's BS indicator; adding the router's dispatches since the probe keeps it
        from going stale within a burst.
        """
        return self.running + self.waiting + self.dispatched_since_probe

    def apply_probe(self, running: int, waiting: int, kv_usage: float | None = None) -> None:
        """Take a probe's running / waiting / KV usage (clamped to [0, 1]); the dispatches counted since the
        last probe start again from 0."""
        self.running = running
        self.waiting = waiting
        if kv_usage is not None:
            self.kv_usage = min(1.0, max(0.0, kv_usage))
        self.probe_age_s = 0.0
        self.dispatched_since_probe = 0
