"""The constants every policy accepts (its own module, so admission and the policy base can both
import it without importing each other)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvroute.schema import StrictModel

AdmissionName = Literal["blind", "pending", "outstanding", "forward"]


def admission_field(default: AdmissionName = "blind") -> Any:
    """The ``admission`` parameter with another default (a preset that selectively pushes)."""
    return Field(default, description="blind: dispatch at once; pending: only to replicas with no "
                 "waiting requests (SkyWalker); outstanding: only below max_outstanding in-flight; forward: blind, "
                 "except that a request no replica admits (pending) is held while a peer load balancer "
                 "would take it at once, so it is forwarded there")


class PolicyParams(StrictModel):
    """Constants every preset accepts; presets extend this with their own."""

    model_config = ConfigDict(frozen=True)

    admission: AdmissionName = admission_field()
    # 10: the per-replica default of the load balancer SkyWalker builds on (skypilot-org/skypilot
    # serve-multi-region-lb, sky/serve/load_balancer.py --max-concurrent-requests); was 16, assumed
    max_outstanding: int = Field(10, ge=1, description="limit for admission=outstanding (default: "
                                 "SkyServe's load balancer, 10 per replica)")
