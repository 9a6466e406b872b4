"""Stage range refinement, CascadeInfer §4.3, and the two naive refinements it is compared with.

At every refinement interval the boundary between a stage and its successor is recomputed from
the sequences they hold. The successor stage's sequences are merged and divided evenly by its
instance count (the set division of §4.2: sort, every k-th from the (k/2)-th), so one average
successor instance stands beside the stage's own; the merged list R, sorted by length, is split
where Q^{R[:i]} + Q^{R[i:]} is smallest (Eq. 1), and the new boundary is the length at the split.

``Refiner`` adds the paper's two stabilisers: EMA smoothing of the boundary (a low-pass filter;
*choice*: weight 0.3 for the new value, the paper gives none) and a freeze while fewer than five
sequences are observed. The naive refinements split the same merged list at equal request counts
(``equal_count``) or equal memory, i.e. summed sequence lengths (``equal_memory``).

*Choice*: kvroute refines per stage boundary (all instances of a stage share one range, as the
router needs), where the paper lets each instance refine its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.cascade.qoe import QoEModel

Item = tuple[float, float]  # (input length, sequence length) of one running sequence
MIN_OBSERVED = 5  # §4.3: no refinement with fewer than five requests


def divide(items: Sequence[Item], k: int) -> list[Item]:
    """One of ``k`` even subsets of ``items`` (§4.2's footnote): sorted by length, from the
    (k/2)-th, every k-th."""
    ordered = sorted(items, key=lambda it: it[1])
    if k <= 1:
        return ordered
    return ordered[k // 2::k]


def merged(own: Sequence[Item], successors: Sequence[Item], successor_instances: int) -> list[Item]:
    """The stage's own sequences plus one average successor instance's, sorted by length."""
    return sorted([*own, *divide(successors, max(1, successor_instances))], key=lambda it: it[1])


def adaptive_split(model: QoEModel, items: Sequence[Item]) -> float:
    """The length at b = argmin_i Q^{R[:i]} + Q^{R[i:]} (§4.3), in one pass with running sums."""
    n = len(items)
    tot = [0.0, 0.0, 0.0]
    for i, length in items:
        tot[0] += i
        tot[1] += i * i
        tot[2] += length
    left = [0.0, 0.0, 0.0]
    best, at = float("inf"), 0
    for b in range(n):  # left = R[:b], right = R[b:]
        q = (model.batch((1.0, float(b), left[0], left[1], left[2]))
             + model.batch((1.0, float(n - b), tot[0] - left[0], tot[1] - left[1], tot[2] - left[2])))
        if q < best:
            best, at = q, b
        i, length = items[b]
        left[0] += i
        left[1] += i * i
        left[2] += length
    return items[at][1]


def equal_count_split(items: Sequence[Item]) -> float:
    """Naive: as many sequences below the boundary as above it (the quantity-based policy)."""
    return items[len(items) // 2][1]


def equal_memory_split(items: Sequence[Item]) -> float:
    """Naive: as many KV tokens (summed sequence lengths) below the boundary as above it."""
    total = sum(it[1] for it in items)
    acc = 0.0
    for i, it in enumerate(items[:-1]):
        acc += it[1]
        if acc >= total / 2:  # items[:i + 1] below the boundary, the rest above
            return items[i + 1][1]
    return items[-1][1]


POLICIES = ("adaptive", "equal_count", "equal_memory")


def splitter(policy: str, model: QoEModel | None) -> Callable[[Sequence[Item]], float]:
    """The split function of a refinement policy (``adaptive`` needs the QoE model)."""
    if policy == "adaptive":
        if model is None:
            raise ValueError("adaptive refinement needs a QoE model")
        return lambda items: adaptive_split(model, items)
    if policy == "equal_count":
        return equal_count_split
    if policy == "equal_memory":
        return equal_memory_split
    raise ValueError(f"unknown refinement {policy!r}; allowed: {', '.join(POLICIES)}")


@dataclass
class Refiner:
    """One stage boundary under refinement: initialised from the offline plan, EMA-smoothed,
    frozen under low traffic, and kept between its neighbours' boundaries."""

    boundary: float
    split: Callable[[Sequence[Item]], float]
    weight: float = 0.3  # EMA weight of a new observation (choice; the paper gives none)
    min_observed: int = MIN_OBSERVED
    history: list[float] = field(default_factory=list)

    def update(self, own: Sequence[Item], successors: Sequence[Item], successor_instances: int,
               lo: float = 0.0, hi: float = float("inf")) -> float:
        """Refine from the stage's and its successors' sequences; returns the boundary."""
        items = merged(own, successors, successor_instances)
        if len(items) < self.min_observed:
            return self.boundary  # too few sequences: one arrival would swing the split
        target = self.split(items)
        b = (1 - self.weight) * self.boundary + self.weight * target
        self.boundary = min(max(b, lo + 1), hi - 1) if hi - lo > 2 else self.boundary
        self.history.append(self.boundary)
        return self.boundary
