"""The outcome of one routing decision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvroute.model.endpoint import Endpoint


class DecisionKind(str, Enum):
    DISPATCH = "dispatch"  # send to ``target`` now
    HOLD = "hold"  # keep in the load balancer's FIFO queue (selective pushing)
    NONE = "none"  # no endpoint can serve it (empty pool, all filtered, bad request)


@dataclass(slots=True)
class Decision:
    kind: DecisionKind
    target: str | None = None
    branch: str = ""  # which rule decided, e.g. "prefix-hit", "imbalance-fallback", "ring"
    reason: str = ""  # human-readable why, for HOLD / NONE
    matched_blocks: int = 0  # prefix blocks believed cached on the target
    # per-endpoint scores for explanation: kept as (endpoints, values) and turned into a dict
    # only when someone asks, since the hot path never does
    _explain: tuple[Sequence[Endpoint], Sequence[float]] | None = field(default=None, repr=False)

    @property
    def dispatched(self) -> bool:
        return self.kind is DecisionKind.DISPATCH

    @property
    def scores(self) -> dict[str, float]:
        if self._explain is None:
            return {}
        eps, values = self._explain
        return {e.id: v for e, v in zip(eps, values)}

    @classmethod
    def dispatch(cls, target: str, branch: str, matched_blocks: int = 0,
                 scores: tuple[Sequence[Endpoint], Sequence[float]] | None = None) -> Decision:
        return cls(DecisionKind.DISPATCH, target, branch, "", matched_blocks, scores)

    @classmethod
    def hold(cls, reason: str) -> Decision:
        return cls(DecisionKind.HOLD, None, "hold", reason)

    @classmethod
    def none(cls, reason: str, branch: str = "no-endpoint") -> Decision:
        return cls(DecisionKind.NONE, None, branch, reason)
