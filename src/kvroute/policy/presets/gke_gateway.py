"""GKE Gateway's LLM routing: the Gateway API inference extension's default endpoint picker.

SkyWalker §5.1 compares against "GKE Gateway" (one load balancer per region, each request
"routed to and handled by one of the clusters"). Its LLM-aware routing inside a cluster is the
endpoint picker (EPP) of kubernetes-sigs/gateway-api-inference-extension, whose default scheduling
profile is published in the InferencePool Helm chart
(``config/charts/inferencepool/templates/epp-config.yaml``, since commit ae8adbce "Adjust default
scorer weights", release v1.2.0, 2025-11): ``queue-scorer`` weight 2,
``kv-cache-utilization-scorer`` weight 2, ``prefix-cache-scorer`` weight 3, no filters, and the
max-score picker the EPP adds when a profile names none. The scorers map onto kvroute's
``queue`` (waiting requests, min–max normalised, fewer is better), ``kv_cache_util`` (1 − KV
usage) and ``prefix`` (share of the prompt cached on the endpoint).

This is the *current* default. The paper accessed GKE's docs on 2025-05-12, when the released
EPP (v0.3.0, April 2025) had no prefix scorer: a filter chain (queue below 128 → least queue →
least KV usage, random pick; ``pkg/epp/scheduling/scheduler.go``); the paper itself says GKE
Gateway "lacks prefix-aware routing". ``scorers`` lets a user drop the prefix term to get a
load-only picker closer to that description. The paper also calls GKE Gateway "general-purpose
multi-cluster load balancing" (§5.1) and GCP Gateway "not tailored for LLM workloads" (§6), so
``kvroute reproduce skywalker`` judges its GKE row on a generic gateway (round robin within each
region, Google Cloud's default endpoint policy) and shows this EPP, with and without the prefix
scorer, beside it.
"""

from __future__ import annotations

from pydantic import Field

from kvroute.policy.catalog import register_preset
from kvroute.policy.presets.weighted import WEIGHTED, WeightedParams

# weights of the inference extension's default profile (epp-config.yaml, v1.2.0 onward)
GKE_DEFAULT_SCORERS = {"queue": 2.0, "kv_cache_util": 2.0, "prefix": 3.0}


class GKEGatewayParams(WeightedParams):
    """Weighted queue / KV-utilization / prefix scorers, max-score pick (the EPP's default profile).

    The same plugins as ``weighted`` with the inference extension's published defaults pinned;
    blind pushing (the EPP dispatches every request at once unless its flow control is enabled,
    which the default configuration does not do).
    """

    scorers: dict[str, float] = Field(
        default_factory=lambda: dict(GKE_DEFAULT_SCORERS),
        description="scorer name → weight; default: the inference extension's default profile "
        "(queue 2, kv_cache_util 2, prefix 3)")


register_preset("gke_gateway", source="gateway-api-inference-extension v1.2.0 default EPP profile "
                "(epp-config.yaml: queue 2, kv-cache-utilization 2, prefix-cache 3, max-score picker)",
                **WEIGHTED)(GKEGatewayParams)
