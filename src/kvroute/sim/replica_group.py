"""A scenario's group of identical simulated replicas (``replicas:``; split out of sim/scenario.py,
issue 21g, to keep that module under the size limit)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvroute.policy.adaptive.replica_speed.datasheet import accelerator_key
from kvroute.schema import StrictModel


class ReplicaGroup(StrictModel):
    """A group of identical simulated replicas in one region, on one hardware profile."""

    region: str = Field("local", description="region the replicas are in")
    count: int = Field(1, ge=1, description="replicas in this group (`--replicas` sets every group's)")
    profile: str = Field("l4-llama3.1-8b", description="hardware profile: a bundled name (`src/kvroute/profiles/`) "
                         "or a YAML file (`--profile`)")
    role: Literal["mixed", "prefill", "decode"] = Field(
        "mixed", description="prefill/decode disaggregation (with `pd:`): prefill engines compute prompts and hand "
        "the KV cache to decode engines (sim/disagg.py); mixed engines do both")
    max_running: int | None = Field(None, ge=1, description="the engines' limit on sequences in a batch, in place of "
                                    "the profile's (e.g. SGLang --max-running-requests, vLLM --max-num-seqs)")
    kv_blocks: int | None = Field(None, ge=1, description="the engines' KV pool in blocks, in place of the "
                                  "profile's (an engine flag, e.g. SGLang --mem-fraction-static)")
    admission: Literal["vllm", "sglang"] | None = Field(
        None, description="the engines' scheduler, in place of the profile's: `vllm` (admit what fits, preempt "
        "later) or `sglang` (reserve future output, sim/sglang_admission.py) — for a paper that ran the other engine")
    waiting_gauge: Literal["live", "sglang", "llama_server", "vllm"] | None = Field(
        None, description="what a probe reads as the engines' waiting/running counts, in place of the profile's: "
        "`live`, `sglang` (num_queue_reqs as of the last prefill batch or 40th decode step, sim/queue_gauge.py), "
        "`llama_server` (requests_deferred: found no free slot between steps, sim/deferred_gauge.py) or `vllm` (as the "
        "last finished step's schedule left them, sim/step_gauge.py)")
    host_cores: int | None = Field(None, ge=1, description="the group's replicas share one machine with this many "
                                   "cores: while n of them step at once, each step takes max(1, n / (cores - "
                                   "host_background_cores)) times its profile time (sim/host.py; unset: every "
                                   "replica has a machine of its own)")
    host_background_cores: float = Field(0.0, ge=0, description="with `host_cores`: cores' worth of CPU other "
                                         "work on that machine takes while it serves (a gateway, clients, the "
                                         "kernel), which the stepping replicas share the cores with (sim/host.py; "
                                         "`bench fidelity` measures it per live run)")
    batch_limit_known: bool = Field(True, description="whether the load balancers know these engines' batch limit "
                                    "(the profile's max_running), as a gateway given `replicas[].max_running` or "
                                    "reading it from the engine does; false: they assume none (256), as a gateway in "
                                    "front of llama-server without that field (llama.cpp exports no batch limit)")
    accelerator: str | None = Field(None, description="the accelerator the deployment declares for these "
                                    "replicas, as a gateway's `replicas[].accelerator` would (e.g. a100-80gb, l4, "
                                    "h100; policy/adaptive/replica_speed/datasheet.py lists them): `auto` reads its "
                                    "datasheet numbers as a speed prior until it has measured the replica; unset: "
                                    "not declared")

    @field_validator("accelerator")
    @classmethod
    def _accelerator(cls, v: str | None) -> str | None:
        return None if v is None else accelerator_key(v)
