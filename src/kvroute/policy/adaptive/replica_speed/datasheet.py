"""A replica's declared accelerator, read as a speed prior from the vendor's public datasheet.

Before a load balancer has measured a replica, it can still know what the replica runs on: the
deployment declares it (the gateway's ``replicas[].accelerator``, a scenario's
``replicas[].accelerator``; on Kubernetes the node label ``nvidia.com/gpu.product`` that NVIDIA
GPU feature discovery writes). The datasheet gives two numbers per accelerator that bound an LLM
engine's two phases:

* **prefill** is compute-bound (a prompt's tokens go through the weights as one large matrix
  product): its time per token scales as 1 / peak dense BF16 tensor TFLOPS;
* **decode** is memory-bound at the batch sizes serving runs (every step reads all weights and
  the batch's KV cache): its time per token scales as 1 / HBM (or GDDR) bandwidth.

Only ratios between replicas are used (``lmetric_speed`` scales each replica's score by its time
over the fleet's median), and only as a prior: each replica's own measured times replace it as
soon as it has the observations a standard error needs (:class:`~.fit.SpeedFit`). Peak numbers
are not achieved ones — a real engine reaches perhaps 40–70 % of peak FLOPs in prefill and 60–90 %
of peak bandwidth in decode, and that fraction differs between generations — so the prior is
right in direction and rough in size. It is not the simulator's step-time model: the bundled
profiles are fitted to published TTFTs and ITLs (``src/kvroute/profiles/``), and their A100 ÷ L4
ratios (prefill ~5.2× per token, decode ~4.2× per step at batch 1: 50.4 vs 12.0 ms) differ from
the datasheets' (2.6× and 6.8×); docs/auto.md compares them.

Dense numbers are the datasheets' dense BF16 tensor figures, or their sparse ("with sparsity")
figures halved where only those are printed, as the datasheets' footnotes say. Sources, one per
accelerator, in ``SOURCES``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One accelerator's datasheet numbers: peak dense BF16 tensor TFLOPS and memory bandwidth in GB/s."""

    name: str
    bf16_tflops: float
    mem_gbps: float


_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_L4 = "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
_L40S = "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"
_A10 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"

# key → (numbers, source). BF16 dense = the datasheet's sparse BF16 tensor figure / 2 where it only
# prints the sparse one first (L4 242, H100 SXM 1,979, H100 PCIe 1,513, H200 1,979); A100 312 and A10 125
# and L40S 362.05 are printed dense.
ACCELERATORS: dict[str, Accelerator] = {
    "a100-40gb": Accelerator("NVIDIA A100 40GB", 312.0, 1555.0),           # A100 datasheet: BF16 312, 1,555 GB/s
    "a100-80gb-pcie": Accelerator("NVIDIA A100 80GB PCIe", 312.0, 1935.0),  # A100 datasheet: 1,935 GB/s
    "a100-80gb": Accelerator("NVIDIA A100 80GB SXM", 312.0, 2039.0),       # A100 datasheet: 2,039 GB/s
    "h100-pcie": Accelerator("NVIDIA H100 PCIe", 756.5, 2000.0),           # H100 datasheet: 1,513 sparse, 2 TB/s
    "h100": Accelerator("NVIDIA H100 SXM", 989.5, 3350.0),                 # H100 datasheet: 1,979 sparse, 3.35 TB/s
    "h200": Accelerator("NVIDIA H200 SXM", 989.5, 4800.0),                 # H200 page: 1,979 sparse, 4.8 TB/s
    "l4": Accelerator("NVIDIA L4", 121.0, 300.0),                          # L4 datasheet: 242 sparse, 300 GB/s
    "l40s": Accelerator("NVIDIA L40S", 362.05, 864.0),                     # L40S datasheet: 362.05 dense, 864 GB/s
    "a10": Accelerator("NVIDIA A10", 125.0, 600.0),                        # A10 datasheet: 250 sparse, 600 GB/s
}

SOURCES: dict[str, str] = {
    "a100-40gb": _A100, "a100-80gb-pcie": _A100, "a100-80gb": _A100, "h100-pcie": _H100, "h100": _H100,
    "h200": _H200, "l4": _L4, "l40s": _L40S, "a10": _A10,
}

# NVIDIA GPU feature discovery's nvidia.com/gpu.product values (the product name, spaces as dashes)
ALIASES: dict[str, str] = {
    "nvidia-a100-sxm4-40gb": "a100-40gb", "nvidia-a100-pcie-40gb": "a100-40gb",
    "nvidia-a100-sxm4-80gb": "a100-80gb", "nvidia-a100-80gb-pcie": "a100-80gb-pcie",
    "nvidia-h100-80gb-hbm3": "h100", "nvidia-h100-pcie": "h100-pcie", "nvidia-h200": "h200",
    "nvidia-l4": "l4", "nvidia-l40s": "l40s", "nvidia-a10": "a10",
}


def accelerator_key(name: str) -> str:
    """The table's key for ``name`` (a key, or a ``nvidia.com/gpu.product`` label, any case); a ValueError
    naming the allowed values otherwise."""
    k = name.strip().lower().replace(" ", "-").replace("_", "-")
    k = ALIASES.get(k, k)
    if k not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; allowed: {', '.join(ACCELERATORS)} "
                         "(or their nvidia.com/gpu.product labels)")
    return k


def prior_times(accelerators: dict[str, str], spread: float) -> dict[str, tuple[float, float]]:
    """Per replica id with a declared accelerator: (prefill, decode) time in datasheet units (1 / TFLOPS,
    1 / GB/s; only their ratios mean anything) — empty unless the declared hardware differs by more than
    ``spread`` in both (the rule :class:`~.fit.SpeedFit` applies to measured times: another generation
    differs in compute and bandwidth alike; an A100 40GB beside an 80GB one is one kind)."""
    out = {}
    for rid, name in accelerators.items():
        a = ACCELERATORS.get(ALIASES.get(name, name))
        if a is not None:
            out[rid] = (1.0 / a.bf16_tflops, 1.0 / a.mem_gbps)
    if len(out) < 2:
        return {}
    pre, dec = [p for p, _ in out.values()], [d for _, d in out.values()]
    if max(pre) <= spread * min(pre) or max(dec) <= spread * min(dec):
        return {}
    return out
