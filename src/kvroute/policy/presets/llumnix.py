"""A Llumnix-like baseline: memory-balancing dispatch, with migration in the simulator.

Llumnix (OSDI '24, the inter-instance scheduler CascadeInfer compares against) dispatches each
request to the instance with the most free memory per running request ("freeness") and migrates
running requests from the most to the least loaded instances. kvroute's dispatch: free KV tokens
(probed usage, minus the prefill tokens dispatched since) divided by batch size + 1, largest
wins (Llumnix's 'load' dispatch on its 'remaining_steps' metric: free KV blocks per request). The
migration half runs in the simulator (``sim/migration.py``, on unless the policy's ``simulator:``
sets ``migrate: false``, the Llumnix project's default configuration): periodically the most
loaded instances hand their newest sequence to the least loaded ones. *Choices*: Llumnix's exact
freeness formula and thresholds are not restated by the CascadeInfer paper; these are kvroute's
reading of "memory balancing with migration".
"""

from __future__ import annotations

from kvroute.model import Endpoint
from kvroute.policy.catalog import register_plugin, register_preset
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import DecisionState, Scorer


@register_plugin
class Freeness(Scorer):
    """Free KV tokens per running request, (capacity·(1 − usage) − queued prefill) / (batch + 1)."""

    name = "freeness"
    inputs = frozenset({"kv_usage", "prefill_backlog", "load"})
    lower_is_better = False

    def values(self, st: DecisionState, eps: list[Endpoint]) -> list[float]:
        """Free KV tokens left after queued prefill, per running request plus one; higher is better."""
        return [((e.kv_blocks * e.block_size) * (1.0 - e.kv_usage) - e.queued_prefill_tokens) / (e.batch_size + 1)
                for e in eps]


@register_preset("llumnix", source="Llumnix (Sun et al., OSDI '24) as CascadeInfer's baseline: memory "
                 "balancing with migration", score={"freeness": 1}, branch="freeness")
class LlumnixParams(PolicyParams):
    """Most free KV memory per running request (Llumnix's freeness); migration in the simulator
    (its settings: a scenario policy's ``simulator:``, ``sim/migration_settings.py``)."""
