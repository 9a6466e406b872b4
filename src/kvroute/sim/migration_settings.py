"""The simulator-only settings of the presets whose sequences move between engines
(``cascadeinfer``, ``llumnix``): planning, range refinement, bid-ask, transfers.

They used to be parameters of the presets, which made the pure policy layer carry knobs only
the simulator reads (issue 18); a gateway routes with the same presets and never plans or
migrates. A scenario gives them per policy under ``simulator:``::

    policies:
      - {preset: cascadeinfer, simulator: {layout: dp, replan_interval_s: 60}}

and, so that older scenario files keep working, the same keys under ``params`` are moved here
(:func:`split`) before the policy is built; the run's label is unchanged either way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from kvroute.schema import StrictModel


class MigrationSettings(StrictModel):
    """How the simulator plans CascadeInfer's stages and moves sequences (CascadeInfer §4.2-4.4,
    §5; Llumnix-like memory balancing)."""

    layout: Literal["dp", "heuristic", "chain", "no_pipeline"] = Field(
        "heuristic", description="planning when the preset names no stage_sizes: exact DP, the two-phase "
        "heuristic (§4.2), one instance per stage, or one stage")
    max_stage_instances: int | None = Field(
        None, ge=1, description="plans give no stage more instances than this (§6.1 reports stages of 1 to 4 "
        "instances); unset: no limit")
    stages: tuple[int, int] | None = Field(
        None, description="[fewest, most] stages a plan may have (§6.1 reports pipelines of 4 to 6 stages); "
        "unset: any number")
    replan_interval_s: float | None = Field(
        None, gt=0, description="re-plan every this many seconds from the lengths of the requests that "
        "finished in the period (§4.2: planning \"runs at initialization and periodically thereafter\"); "
        "also the size of the start-up plan's set (rate × period requests); unset: plan once at start-up, "
        "on 60 s of requests")
    refinement: Literal["adaptive", "equal_count", "equal_memory", "off"] = Field(
        "adaptive", description="range refinement (§4.3): the QoE split, the naive equal-count or equal-memory "
        "split, or fixed boundaries")
    refine_interval_s: float = Field(5.0, gt=0, description="seconds between range refinements")
    bidask: Literal["full", "handover", "off"] = Field(
        "full", description="(§4.4) bid-ask hand-over and intra-stage rebalancing; bid-ask hand-over only; or "
        "hand-over to the least loaded successor and no rebalancing")
    rebalance_interval_s: float = Field(1.0, gt=0, description="seconds between overload checks (and Llumnix-like "
                                        "rebalancing rounds)")
    migrate: bool = Field(True, description="llumnix: migrate running sequences between instances (Llumnix's "
                          "ENABLE_MIGRATION; its project's default configuration has it off, "
                          "llumnix/config/default.py); false: dispatch only")
    imbalance: float = Field(0.1, ge=0, le=1, description="llumnix: migrate while the KV demand gap between the "
                             "most and least loaded instance exceeds this share of capacity")
    transfer_gb_s: float = Field(25.0, gt=0, description="KV transfer bandwidth per migration, GB/s")
    max_transfers: int = Field(3, ge=1, description="concurrent KV transfers per instance (CascadeInfer §5: 3)")

    @field_validator("stages")
    @classmethod
    def _stage_range(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and not 1 <= v[0] <= v[1]:
            raise ValueError(f"must be [fewest, most] with 1 <= fewest <= most, got {list(v)}")
        return v


KEYS = frozenset(MigrationSettings.model_fields)


def split(params: dict[str, Any] | None, simulator: dict[str, Any] | None = None,
          where: str = "simulator") -> tuple[dict[str, Any] | None, MigrationSettings]:
    """The policy's own params and the simulator settings, from a policy entry's ``params`` (older
    files put the settings there) and ``simulator``; a bad setting raises ValueError naming it."""
    own = {k: v for k, v in (params or {}).items() if k not in KEYS}
    sim = {k: v for k, v in (params or {}).items() if k in KEYS}
    sim.update(simulator or {})
    try:
        settings = MigrationSettings(**sim)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(x) for x in e["loc"])
        raise ValueError(f"{where}.{loc}: {e['msg'].removeprefix('Value error, ')}") from None
    return (own or None) if params is not None else None, settings
