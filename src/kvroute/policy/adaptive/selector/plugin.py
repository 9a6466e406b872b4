"""Online choice between two routing rules by the TTFTs they produce: explore both, keep the better.

``auto`` has two cost functions that each win somewhere — GORGO's additive cost (uncached plus
queued tokens) and LMetric's multiplicative score — and nothing it can observe up front says which
fits a deployment. So it measures: the ``ttft_selector`` condition routes by one rule for a block
of ``window`` dispatches, then by the other, compares the p90 of the TTFTs each block's requests
measured (the runtime's first-token times, as GORGO v2's tuner uses), and serves the winner for
``exploit`` blocks before measuring again, so a change of traffic is followed.

Guard against reward hacking (GORGO v2 §4: a tuner scoring TTFT alone learned to send everything
to the nearest replica, best TTFT and worst end-to-end latency): a rule wins on TTFT only if its
requests' mean end-to-end latency is not more than ``e2e_slack`` worse than the other's.

Pure: no clock, no randomness; the outcome depends only on the events' order.
"""

from __future__ import annotations

from kvroute.model import Endpoint, Request
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import Condition, DecisionState

A, B = 1, 0  # A: the guarded rule holds; B: fall through to the next rule


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))] if s else float("inf")


@register_plugin
class TTFTSelector(Condition, Lifecycle):
    """Holds while the rule it guards is the one serving: alternately explored, then the faster one kept."""

    name = "ttft_selector"
    inputs = frozenset()

    def __init__(self, window: int = 64, exploit: int = 8, e2e_slack: float = 0.1):
        if window < 8 or exploit < 1:
            raise ValueError("ttft_selector: window must be ≥ 8 and exploit ≥ 1")
        self.window, self.exploit, self.e2e_slack = window, exploit, e2e_slack
        self.arm = A  # the rule serving now
        self.best = A  # the last round's winner (served while a round's answers are awaited)
        self.phase = "explore"  # explore → wait (for the answers) → exploit → explore ...
        self.explore = [A, B]  # blocks still to measure this round, the current one first
        self.exploit_until = 0
        self.left = window  # dispatches left in the current block
        self.block = 0  # block number; a request is scored in the block it was dispatched in
        self.asked: str | None = None  # the last request the condition was consulted for
        self.owner: dict[str, tuple[int, int]] = {}  # req id → (block, arm)
        self.ttft: dict[int, list[float]] = {A: [], B: []}
        self.e2e: dict[int, list[float]] = {A: [], B: []}
        self.measured = {0: A}  # the blocks of this round's exploration → the rule each served
        self.wins = {A: 0, B: 0}
        self.rounds = 0

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when the guarded rule serves now (the request is marked as this condition's when
        the dispatch is committed: deciding changes nothing)."""
        rid = st.req.id
        st.defer(lambda: setattr(self, "asked", rid))
        return self.arm == A

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Count the dispatch in the current block when this condition chose its rule."""
        if self.asked != req.id:
            return  # an earlier rule decided (hotspot, several regions): not ours to score
        self.owner[req.id] = (self.block, self.arm)
        self.left -= 1
        if self.left <= 0:
            self._next_block()

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Score the TTFT for the rule that routed the request, if its block is being measured."""
        blk_arm = self.owner.get(req_id)
        if blk_arm is not None and self.measured.get(blk_arm[0]) == blk_arm[1]:
            self.ttft[blk_arm[1]].append(ttft_s)

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """The guard's sample: end-to-end latency per rule."""
        blk_arm = self.owner.pop(req_id, None)
        if blk_arm is not None and self.measured.get(blk_arm[0]) == blk_arm[1]:
            self.e2e[blk_arm[1]].append(e2e_s)
        self._maybe_decide()

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """No sample will come."""
        self.owner.pop(req_id, None)

    def _next_block(self) -> None:
        """A block ended: measure the next rule, wait for the answers, or re-explore after exploiting."""
        self.block += 1
        self.left = self.window
        if self.phase == "explore":
            self.explore.pop(0)
            if self.explore:
                self.arm = self.explore[0]
                self.measured[self.block] = self.arm
            else:
                self.phase, self.arm = "wait", self.best  # until both blocks' requests have answered
        elif self.phase == "exploit" and self.block >= self.exploit_until:
            self.phase, self.explore, self.arm = "explore", [A, B], A
            self.ttft, self.e2e = {A: [], B: []}, {A: [], B: []}
            self.measured = {self.block: A}

    def _maybe_decide(self) -> None:
        """Once enough of both measured blocks answered: keep the faster rule, unless the guard objects."""
        if self.phase != "wait":
            return
        half = self.window // 2
        if min(len(self.ttft[A]), len(self.ttft[B]), len(self.e2e[A]), len(self.e2e[B])) < half:
            return
        p = {A: _p90(self.ttft[A]), B: _p90(self.ttft[B])}
        e = {k: sum(v) / len(v) for k, v in self.e2e.items()}
        best = A if p[A] <= p[B] else B
        other = B if best == A else A
        if e[best] > (1 + self.e2e_slack) * e[other]:
            best = other  # faster first tokens bought with slower answers: the guard refuses
        self.best = self.arm = best
        self.wins[best] += 1
        self.rounds += 1
        self.phase, self.exploit_until = "exploit", self.block + self.exploit
        self.measured = {}

    def state(self) -> dict[str, float]:
        """The rule serving (1: the guarded one), rounds decided and each rule's wins."""
        return {"serving_guarded": float(self.arm == A), "rounds": float(self.rounds),
                "wins_guarded": float(self.wins[A]), "wins_other": float(self.wins[B])}
