"""The outcome of one routing decision."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvroute.model.endpoint import Endpoint


class DecisionKind(str, Enum):
    """What a policy decided for one request: send it now, keep it queued at the load balancer, or refuse it."""

    DISPATCH = "dispatch"  # send to ``target`` now
    HOLD = "hold"  # keep in the load balancer's FIFO queue (selective pushing)
    NONE = "none"  # no endpoint can serve it (empty pool, all filtered, bad request)


class Branch(StrEnum):
    """Which rule decided: the ``branch`` label of ``kvroute_policy_branch`` and the simulator's
    branch counts. User presets may name their own branches; these are the built-in ones."""

    PREFIX_HIT = "prefix-hit"  # followed the cache
    PREFIX_MISS = "prefix-miss"  # too little cached: by load (SGLang, AIBrix)
    IMBALANCE = "imbalance-fallback"  # load imbalance overrode the cache
    LEAST_LOAD = "least-load"
    LEAST_REQUEST = "least-request"
    MIN_COST = "min-cost"
    MIN_SCORE = "min-score"
    MIN_PREDICTED_TTFT = "min-predicted-ttft"
    HOTSPOT_FILTERED = "hotspot-filtered"  # LMetric's detector took a hotspot's instances out
    SOFTMAX = "softmax"
    WEIGHTED = "weighted"
    LINEAR = "linear"
    JSQ = "jsq"
    ROUND_ROBIN = "rr"
    RANDOM = "random"
    POWER_OF_TWO = "p2c"
    RING = "ring"  # consistent-hash owner
    RING_OVERFLOW = "ring-overflow"  # bounded load passed the owner over
    NO_KEY = "no-key-fallback"  # no routing key (or no owner on the ring)
    HOLD = "hold"
    NO_ENDPOINT = "no-endpoint"
    BAD_REQUEST = "bad-request"
    ALL_FILTERED = "all-filtered"
    POLICY_ERROR = "policy-error"
    NO_RULE = "no-rule"  # a composed preset whose rules all declined


@dataclass(slots=True, init=False)  # __init__ written out, as Request's (model/request.py says why)
class Decision:
    """One routing decision: its kind, the chosen endpoint (for DISPATCH), which rule decided and why, and on
    request the per-endpoint scores that led to it."""

    kind: DecisionKind
    target: str | None = None
    branch: str = ""  # which rule decided: a Branch, or a user preset's own name
    reason: str = ""  # human-readable why, for HOLD / NONE
    matched_blocks: int = 0  # prefix blocks believed cached on the target
    # per-endpoint scores for explanation: kept as (endpoints, values) and turned into a dict
    # only when someone asks, since the hot path never does
    _explain: tuple[Sequence[Endpoint], Sequence[float]] | None = field(default=None, repr=False)
    # prefill/decode disaggregation (policy/pd.py): the engine that prefills while ``target``
    # decodes; None when ``target`` serves the whole request
    prefill: str | None = None
    # plugin state changes this decision implies (a round-robin cursor, a detector's window):
    # applied by Router.route when it commits the dispatch, never by a dry-run Router.decide
    effects: tuple[Callable[[], None], ...] = field(default=(), repr=False, compare=False)

    def __init__(self, kind: DecisionKind, target: str | None = None, branch: str = "", reason: str = "",
                 matched_blocks: int = 0, _explain: tuple[Sequence[Endpoint], Sequence[float]] | None = None,
                 prefill: str | None = None, effects: tuple[Callable[[], None], ...] = ()) -> None:
        self.kind = kind
        self.target = target
        self.branch = branch
        self.reason = reason
        self.matched_blocks = matched_blocks
        self._explain = _explain
        self.prefill = prefill
        self.effects = effects

    @property
    def dispatched(self) -> bool:
        """True for a DISPATCH decision (``target`` is then set)."""
        return self.kind is DecisionKind.DISPATCH

    @property
    def scores(self) -> dict[str, float]:
        """Endpoint id → the value the deciding rule compared (empty when the rule kept none), built on
        demand."""
        if self._explain is None:
            return {}
        eps, values = self._explain
        return {e.id: v for e, v in zip(eps, values)}

    @classmethod
    def dispatch(cls, target: str, branch: str, matched_blocks: int = 0,
                 scores: tuple[Sequence[Endpoint], Sequence[float]] | None = None) -> Decision:
        """Send to ``target``; ``scores`` (endpoints, values) stays unconverted until :attr:`scores` is read."""
        return cls(DecisionKind.DISPATCH, target, branch, "", matched_blocks, scores)

    @classmethod
    def hold(cls, reason: str) -> Decision:
        """Keep the request in the load balancer's queue (selective pushing) until a replica frees up."""
        return cls(DecisionKind.HOLD, None, Branch.HOLD, reason)

    @classmethod
    def none(cls, reason: str, branch: str = Branch.NO_ENDPOINT) -> Decision:
        """Refuse: no endpoint can serve the request; ``reason`` is shown to the client."""
        return cls(DecisionKind.NONE, None, branch, reason)
