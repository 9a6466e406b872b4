"""Request-lifecycle hooks for stateful policy plugins.

A plugin that learns from what happens to the requests it routed (an online tuner, a
calibrated cost model, a hotspot detector) subclasses :class:`Lifecycle` and overrides the
events it needs. The :class:`~kvroute.policy.router.Router` delivers them, identically in the
simulator and in the gateway:

* ``on_dispatched`` right after the Router committed a dispatch;
* ``on_first_token`` when the request's first token reached the load balancer, with the TTFT
  the runtime measured from when the request reached the load balancer (LB queueing
  included): the simulated clock in the simulator, the monotonic clock in the gateway;
* then exactly one of ``on_finished`` (completed, with its measured end-to-end latency) or
  ``on_failed`` (the endpoint did not complete it: it failed or refused it, the client went
  away, or the request was re-routed to another endpoint).

The policy layer stays pure: a plugin never reads a clock; times arrive as arguments.
"""

from __future__ import annotations

from typing import ClassVar

from kvroute.model import Endpoint, Request


class Lifecycle:
    """Base of plugins that observe requests after the decision; every method is a no-op."""

    name: ClassVar[str] = ""  # the prefix of this plugin's keys in ``Router.policy_state``

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """The Router committed ``req`` to ``endpoint`` (whose counters already include it);
        ``new_prefill_tokens`` is its prompt minus the prefix the index believes cached there."""

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """The first token of ``req_id`` arrived after ``ttft_s`` seconds (LB queueing included)."""

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """``req_id`` completed after ``e2e_s`` seconds with ``output_tokens`` tokens (0: unknown)."""

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """``req_id`` left ``endpoint_id`` without completing (failed, refused, cancelled, re-routed)."""

    def state(self) -> dict[str, float]:
        """Numeric state worth exporting (weights, σ, a window's p95): /metrics and simulate's JSON."""
        return {}
