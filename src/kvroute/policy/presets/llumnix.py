"""A Llumnix-like baseline: memory-balancing dispatch, with migration in the simulator.

Llumnix (OSDI '24, the inter-instance scheduler CascadeInfer compares against) dispatches each
request to the instance with the most free memory per running request ("freeness") and migrates
running requests from the most to the least loaded instances. kvroute's dispatch: free KV tokens
(probed usage, minus the prefill tokens dispatched since) divided by batch size + 1, largest
wins. The migration half runs in the simulator (``sim/migration.py``, ``migration = "memory"``):
periodically the most loaded instances hand their newest sequence to the least loaded ones.
*Choices*: Llumnix's exact freeness formula and thresholds are not restated by the CascadeInfer
paper; these are kvroute's reading of "memory balancing with migration".
"""

from __future__ import annotations

from pydantic import Field

from kvroute.model import Decision, Endpoint, Request
from kvroute.policy.base import Policy, View, argmax, explain
from kvroute.policy.params import PolicyParams


class LlumnixParams(PolicyParams):
    """Dispatch has no constants; these drive the simulator's migration."""

    rebalance_interval_s: float = Field(1.0, gt=0, description="simulator: seconds between rebalancing rounds")
    imbalance: float = Field(0.1, ge=0, le=1, description="simulator: migrate while the KV usage gap between "
                             "the most and least loaded instance exceeds this share of capacity")
    transfer_gb_s: float = Field(25.0, gt=0, description="simulator: KV transfer bandwidth per migration, GB/s")
    max_transfers: int = Field(3, ge=1, description="simulator: concurrent KV transfers per instance")


class LlumnixLike(Policy):
    """Most free KV memory per running request (Llumnix's freeness), with migration (simulator)."""

    name = "llumnix"
    source = "Llumnix (Sun et al., OSDI '24) as CascadeInfer's baseline: memory balancing with migration"
    Params = LlumnixParams
    params: LlumnixParams
    migration = "memory"

    @property
    def reads_kv_usage(self) -> bool:
        """Freeness reads the probed KV usage."""
        return True

    @property
    def reads_prefill_backlog(self) -> bool:
        """And the prefill tokens dispatched since."""
        return True

    def choose(self, req: Request, eps: list[Endpoint], view: View) -> Decision:
        """argmax free tokens / (batch + 1)."""
        values = [((e.kv_blocks * e.block_size) * (1.0 - e.kv_usage) - e.queued_prefill_tokens) / (e.batch_size + 1)
                  for e in eps]
        ep = argmax(eps, values, self.rng)
        return Decision.dispatch(ep.id, "freeness", scores=explain(eps, values))
