"""One replica as the gateway keeps it (:class:`Upstream`), and what one attempt on it says
about its health (:class:`Outcome`, fed to its circuit breaker)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvroute.gateway.breaker import CircuitBreaker
from kvroute.gateway.probes import ProbeStreak, Reading
from kvroute.gateway.upstream import UpstreamError, UpstreamPool
from kvroute.model import Endpoint
from kvroute.replicas import ReplicaConfig


@dataclass
class Upstream:
    """One replica as the gateway keeps it: its config, the Endpoint the policy sees, breaker, connection
    pool, probe streak, last reading and the models it serves."""

    config: ReplicaConfig
    endpoint: Endpoint
    breaker: CircuitBreaker
    pool: UpstreamPool
    engine: str = "auto"
    streak: ProbeStreak = field(default_factory=ProbeStreak)
    reading: Reading | None = None  # the last successful probe
    # whether any probe of it has answered yet: until then it is not routable (Runtime._add), and the
    # first answer admits it without the healthy_after streak (Prober._read_probe)
    answered: bool = False
    restarts: int = 0
    models: frozenset[str] | None = None  # what it serves: configured, or read from /v1/models
    model_cards: list[dict[str, Any]] = field(default_factory=list)  # its /v1/models entries
    models_read_at: float = -1e9
    # what the gateway sent it, for /metrics: attempts, failed attempts, tokens
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0  # the gateway's count of served prompts (the engine's units once learned)
    completion_tokens: int = 0  # the engine's usage, else the token events streamed
    # the abort of every exchange sent to it and not over yet (gateway/proxy.py): called when its
    # probes find nothing listening, so no request keeps waiting on a replica known to be gone
    exchanges: set[Callable[[UpstreamError], None]] = field(default_factory=set)
    # adaptive probing (probes.next_probe_interval) and what probing it costs
    probe_every_s: float = 0.0
    next_probe_at: float = 0.0
    probes: int = 0
    probe_bytes: int = 0
    filtered: bool | None = None  # vLLM's filtered metrics: None untried, then whether they answer

    def starting(self, unhealthy_after: int) -> bool:
        """Not answered a probe yet, and fewer than ``unhealthy_after`` of its probes failed: its
        first answer may still come at any moment (requests that only it could take wait for it,
        ``Runtime._route``). After that many failures it is an unhealthy replica like any other."""
        return not self.answered and self.streak.fails < unhealthy_after


class Outcome(Enum):
    """What one upstream attempt says about the replica's health (fed to its breaker)."""

    OK = "ok"
    FAILED = "failed"
    NEUTRAL = "neutral"

