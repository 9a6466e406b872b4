"""Length-aware stage partition, CascadeInfer §4.2: the exact DP and the two-phase heuristic.

A plan splits E instances into consecutive stages; stage s serves sequence lengths [lo_s, hi_s)
with k_s instances. Its quality is Σ_s k_s·Q^{n_s/k_s} + Σ_cuts c_cut (lower is better), where

* n_s is the subset of the planning set whose sequence length lies in the range. The set is the
  requests of one planning period — "CascadeInfer collects request statistics over the period
  (input and output lengths)", the problem is posed "given E instances and a set of requests" and
  the quality is "the total QoE of all instances processing all requests" (§4.2) — each request
  once, as (input length, length at one moment of its life, final length) (``period_set``), with
  its input length counted only where it lies in the range (its prefill ran there; a migrated
  sequence brings its KV). *Choice*: a sequence grows across stages, and the paper says only
  "requests whose sequence lengths lie in [l', l]"; one moment drawn uniformly over the request's
  time in the system puts it in each stage with the share of its life it spends there.
* n_s/k divides the set among k instances as the paper's footnote does: sort by length, start at
  the (k/2)-th element and take every k-th; Q^{…} is the batch QoE of Eq. (1).
* c_cut is the delay of moving every request of the set whose life straddles the cut: its KV at
  the cut (cut·bytes per token ÷ bandwidth), divided by its output tokens so that it is in the
  unit of the QoE (normalized latency). *Choice*: the paper gives "volume of transferred tokens
  and system bandwidth", not the unit.

Lengths are bucketed into exponentially growing tiers (cut candidates at min_cut·2^i), which makes
the candidate cuts O(log L). ``exact`` solves the recursion
f[s,e,l] = min_{e',l'} f[s−1,e',l'] + (e−e')·Q^{n_{l',l}/(e−e')} + c_{l'}; since the best plan
is the minimum over every stage count s, the stage count is carried as the plan's length rather
than as a table dimension (the same minimum, E times fewer cells). ``heuristic`` is the paper's
fast path: a DP that gives every stage exactly one instance, then greedy merges of adjacent
stages by largest positive gain.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.cascade.qoe import QoEModel


@dataclass(frozen=True)
class Stage:
    """``instances`` instances serving sequence lengths [lo, hi)."""

    instances: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Plan:
    """Stages in length order and the plan's predicted quality (lower is better)."""

    stages: tuple[Stage, ...]
    cost: float

    @property
    def sizes(self) -> list[int]:
        """Instances per stage."""
        return [s.instances for s in self.stages]

    @property
    def bounds(self) -> list[int]:
        """Upper length bound of every stage but the last."""
        return [s.hi for s in self.stages[:-1]]


def cut_points(max_len: int, min_cut: int = 1, per_octave: int = 1) -> list[int]:
    """0, then min_cut·2^(i/per_octave) up to the first that covers ``max_len``: the exponential
    tiers ([1, 2), [2, 4), … as §4.2 writes them; ``per_octave`` > 1 splits each doubling)."""
    cuts, i = [0], 0
    while True:
        c = int(round(min_cut * 2 ** (i / per_octave)))
        if c > cuts[-1]:
            cuts.append(c)
        if c >= max_len:
            return cuts
        i += 1


Running = tuple[int, int, int]  # (input length, current length, final length) of a running sequence


def period_set(requests: Sequence[tuple[int, int]], seed: int = 0,
               prefill_tokens: Callable[[int], float] | None = None) -> list[Running]:
    """The planning set (§4.2): every (input, output) request of the period once, at one moment of
    its life drawn uniformly over its time in the system — prefilling (current length = input) for
    ``prefill_tokens(input)`` decode steps (the prefill's time in decode steps; none when not
    given), then one step per output token."""
    rng = random.Random(seed)
    out = []
    for i, o in requests:
        o = max(1, o)
        pre = prefill_tokens(i) if prefill_tokens else 0.0
        at = rng.random() * (o + pre) - pre
        out.append((i, i + max(0, int(at)), i + o))
    return out


def concurrency(rate: float, mean_output: float, tpot_of: Callable[[float], float], instances: int,
                cap: float) -> float:
    """Sequences in flight by Little's law, N = rate·E[O]·TPOT(N/instances), solved by fixed-point
    iteration (``tpot_of`` maps a per-instance batch to seconds per token); at most ``cap``."""
    n = 1.0
    for _ in range(50):
        nxt = min(cap, rate * mean_output * tpot_of(n / instances))
        if math.isclose(nxt, n, rel_tol=1e-3):
            return nxt
        n = nxt
    return n


class StageCosts:
    """Stage and cut costs over a set of profiled requests, computed once per (range, k)."""

    def __init__(self, model: QoEModel, running: Sequence[Running], cuts: Sequence[int],
                 transfer_s_per_token: float):
        """``running``: the planning set's (input, current, final) lengths; ``cuts``: candidate cuts."""
        self.model = model
        self.running = sorted(running, key=lambda r: r[1])
        self._lengths = [r[1] for r in self.running]
        self.cuts = list(cuts)
        self.transfer_s_per_token = transfer_s_per_token
        self._ranges: dict[tuple[int, int], tuple[list[float], list[float], list[float]]] = {}
        self._q: dict[tuple[int, int, int], float] = {}
        self._cut: dict[int, float] = {}

    def _fragments(self, a: int, b: int) -> tuple[list[float], list[float], list[float]]:
        key = (a, b)
        got = self._ranges.get(key)
        if got is None:
            lo, hi = self.cuts[a], self.cuts[b]
            first, last = bisect.bisect_left(self._lengths, lo), bisect.bisect_left(self._lengths, hi)
            seqs = self.running[first:last]  # sorted by current length
            ins = [float(i if i >= lo else 0) for i, _, _ in seqs]
            got = (ins, [x * x for x in ins], [float(length) for _, length, _ in seqs])
            self._ranges[key] = got
        return got

    def stage(self, a: int, b: int, k: int) -> float:
        """k·Q^{n/k} of a stage over cuts[a]..cuts[b] with k instances."""
        key = (a, b, k)
        q = self._q.get(key)
        if q is None:
            ins, ins2, lens = self._fragments(a, b)
            start = k // 2 if k // 2 < len(lens) else 0
            sub = lens[start::k]
            f = (1.0, float(len(sub)), float(sum(ins[start::k])), float(sum(ins2[start::k])), float(sum(sub)))
            q = self._q[key] = k * self.model.batch(f)
        return q

    def cut(self, j: int) -> float:
        """c at cuts[j]: moving the KV of every request straddling it, per output token."""
        if j == 0:
            return 0.0
        c = self._cut.get(j)
        if c is None:
            at = self.cuts[j]
            per = at * self.transfer_s_per_token
            c = self._cut[j] = sum(per / (f - i) for i, _, f in self.running if i < at < f)
        return c


def _plan(costs: StageCosts, pieces: list[tuple[int, int, int]]) -> Plan:
    """A plan from (k, a, b) triples in length order, with its cost."""
    cuts = costs.cuts
    cost = sum(costs.stage(a, b, k) + costs.cut(a) for k, a, b in pieces)
    return Plan(tuple(Stage(k, cuts[a], cuts[b]) for k, a, b in pieces), cost)


def exact(costs: StageCosts, instances: int, max_k: int | None = None,
          stages: tuple[int, int] | None = None) -> Plan:
    """The optimal plan over every stage count, instance split and cut (the §4.2 recursion);
    ``max_k`` caps a stage's instances, ``stages`` bounds the stage count (then the stage count
    is a table dimension, as in the paper's f[s,e,l])."""
    m = len(costs.cuts) - 1
    inf = float("inf")
    top = max_k or instances
    s_hi = stages[1] if stages else 1
    # f[s][e][j]: best cost of s stages (0 = any count, when unbounded) over e instances and cuts[0..j]
    f = [[[inf] * (m + 1) for _ in range(instances + 1)] for _ in range(s_hi + 1)]
    back: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    f[0][0][0] = 0.0
    for s in range(1, s_hi + 1) if stages else (0,):
        for e in range(1, instances + 1):
            for j in range(1, m + 1):
                best, arg = inf, None
                for e0 in range(max(0, e - top), e):
                    row = f[s - 1][e0] if stages else f[0][e0]
                    for j0 in range(j):
                        base = row[j0]
                        if base == inf:
                            continue
                        v = base + costs.stage(j0, j, e - e0) + costs.cut(j0)
                        if v < best:
                            best, arg = v, (s - 1 if stages else 0, e0, j0)
                if arg is not None:
                    f[s][e][j] = best
                    back[(s, e, j)] = arg
    if stages:
        s_best = min(range(stages[0], s_hi + 1), key=lambda k: f[k][instances][m])
        if f[s_best][instances][m] == inf:
            raise ValueError(f"no plan of {stages[0]}-{stages[1]} stages of at most {top} instances covers "
                             f"{instances} instances over {m} length tiers")
    else:
        s_best = 0
    pieces = []
    key = (s_best, instances, m)
    while key[1]:
        prev = back[key]
        pieces.append((key[1] - prev[1], prev[2], key[2]))
        key = prev
    return _plan(costs, pieces[::-1])


def heuristic(costs: StageCosts, instances: int, max_k: int | None = None,
              stages: tuple[int, int] | None = None) -> Plan:
    """Two phases (§4.2): one instance per stage, then greedy merges of adjacent stages.

    Phase 1 is the DP restricted to single-instance stages, with as many stages as there are
    instances (or tiers, when there are fewer tiers; *choice*: the leftover instances then join,
    one by one, the stage where an extra instance lowers the cost most). Phase 2 merges the
    adjacent pair with the largest positive gain (their costs plus the cut between them, minus
    the merged stage's cost) until no merge gains; with E ≤ a few dozen a scan per merge is as
    fast as a heap. ``max_k`` forbids merges past that many instances; ``stages`` = (fewest,
    most): merging stops at the fewest, and continues past the last gaining merge, least loss
    first, while there are more than the most; where merges stall above the most (every
    adjacent pair over ``max_k``), the DP's plan inside the envelope is returned instead.
    """
    top = max_k or instances
    stages_n = min(instances, len(costs.cuts) - 1)
    pieces = _one_per_stage(costs, stages_n)
    for _ in range(instances - stages_n):
        gains = [costs.stage(a, b, k) - costs.stage(a, b, k + 1) if k < top else -math.inf
                 for k, a, b in pieces]
        i = gains.index(max(gains))
        k, a, b = pieces[i]
        pieces[i] = (k + 1, a, b)
    fewest, most = stages or (1, len(pieces))
    while len(pieces) > fewest:
        best, at = (0.0 if len(pieces) <= most else -math.inf), -1
        for i in range(len(pieces) - 1):
            (k1, a1, b1), (k2, a2, b2) = pieces[i], pieces[i + 1]
            if k1 + k2 > top:
                continue
            gain = (costs.stage(a1, b1, k1) + costs.stage(a2, b2, k2) + costs.cut(a2)
                    - costs.stage(a1, b2, k1 + k2))
            if gain > best:
                best, at = gain, i
        if at < 0:
            break
        (k1, a1, _), (k2, _, b2) = pieces[at], pieces[at + 1]
        pieces[at:at + 2] = [(k1 + k2, a1, b2)]
    if stages and len(pieces) > most:
        # Greedy merges can stall outside the envelope (every adjacent pair would exceed max_k,
        # e.g. sizes [1, 2, 1] with max_k 2 and at most 2 stages); *choice*: the DP answers then.
        try:
            return exact(costs, instances, max_k, stages)
        except ValueError:
            pass  # nothing fits the envelope: keep the greedy plan, as without bounds
    return _plan(costs, pieces)


def _one_per_stage(costs: StageCosts, stages: int) -> list[tuple[int, int, int]]:
    """The single-instance DP: ``stages`` stages of one instance each, best cuts."""
    m = len(costs.cuts) - 1
    inf = float("inf")
    g = [[inf] * (m + 1) for _ in range(stages + 1)]
    back = [[0] * (m + 1) for _ in range(stages + 1)]
    g[0][0] = 0.0
    for s in range(1, stages + 1):
        prev, row, brow = g[s - 1], g[s], back[s]
        for j in range(s, m + 1):
            for j0 in range(s - 1, j):
                v = prev[j0] + costs.stage(j0, j, 1) + costs.cut(j0)
                if v < row[j]:
                    row[j], brow[j] = v, j0
    pieces, j = [], m
    for s in range(stages, 0, -1):
        pieces.append((1, back[s][j], j))
        j = back[s][j]
    return pieces[::-1]


def chain(costs: StageCosts, instances: int) -> Plan:
    """The chain layout (§6.5): one instance per stage, cuts placed by the single-instance DP."""
    if instances > len(costs.cuts) - 1:
        raise ValueError(f"a chain of {instances} stages needs at least {instances} length tiers, "
                         f"have {len(costs.cuts) - 1}")
    return _plan(costs, _one_per_stage(costs, instances))


def single_stage(costs: StageCosts, instances: int) -> Plan:
    """The no-pipeline layout (§6.5): every instance in one stage covering every length."""
    return _plan(costs, [(instances, 0, len(costs.cuts) - 1)])


def stage_of(bounds: Sequence[int], length: int) -> int:
    """Index of the earliest stage whose range covers ``length`` (stage s serves < bounds[s])."""
    return bisect.bisect_right(bounds, length)
