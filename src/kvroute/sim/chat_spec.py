"""Scenario keys that shape the synthetic closed-loop programs: per-region program shapes (SkyWalker's
mixed tree) and each conversation's shape (SkyWalker's released replays). Split from scenario.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvroute.schema import StrictModel


class ShapeSpec(StrictModel):
    """One region's program shape (SkyWalker's mixed tree: different shapes per region)."""

    kind: Literal["chat", "tot", "mixed"] | None = Field(None, description="this region's program shape "
                                                         "(default: the workload's)")
    tree_fraction: float | None = Field(None, ge=0, le=1, description="as `workload.tree_fraction`, for this region")
    depth: int | None = Field(None, ge=1, description="as `workload.depth`, for this region")
    branching: int | None = Field(None, ge=1, description="as `workload.branching`, for this region")


class ConversationSpec(StrictModel):
    """Each synthetic conversation's or tree's shape (workload/synthetic.py ConversationShape; SkyWalker's
    released client)."""

    context: bool = Field(True, description="a system prompt and, 60 % of the time, the user's document first; "
                          "false: the first question alone (SkyWalker's sky/lbbench/workloads send only the "
                          "program's turns)")
    min_turns: int = Field(1, ge=1, le=12, description="conversations: min_turns + Geometric(end_p) turns, at most 12")
    max_output_tokens: int | None = Field(None, gt=0, description="cap each answer (default 2,048; 1,024 a tree node)")
    question_mean: float | None = Field(None, gt=0, description="mean tokens of a conversation's user question "
                                        "(log-normal, σ 0.9; default: median 120, mean ~180)")
    end_p: float = Field(0.35, gt=0, le=1, description="chance a conversation ends after each turn past "
                         "min_turns (turns = min_turns + Geometric(end_p); mean extra turns (1 - end_p) / end_p)")
    same_branches: bool = Field(False, description="trees of thought: a node's branches send one prompt "
                                "`branching` times and get the same answer (SkyWalker's tot.py: the level's "
                                "instruction appended once, temperature 0.001); false: each branch its own")
