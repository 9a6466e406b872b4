"""Online choice between two routing rules by the TTFTs they produce: an interleaved trial, kept on evidence.

``auto`` has a challenger cost — GORGO's (uncached plus queued tokens, plus the RTT across
regions) — and an incumbent, LMetric's multiplicative score, and nothing it can observe up front
says which fits a deployment. So it measures, as an online A/B test does:

* **interleaved trials.** For ``2 × window`` dispatches the two rules take turns, request by
  request, so both face the same queues, cache contents and arrival burst at the same moment. (A
  first version measured one block of ``window`` dispatches per rule; blocks at different times
  compared different traffic — a run's start against its steady state, a burst against a lull —
  and a bad rule routing a whole block alone built queues that hurt long after: on a hot prefix
  the additive cost piled the hot class onto its cached replicas for 64 dispatches in a row.)
* **evidence to switch.** The rule serving between trials (the incumbent) is replaced only when
  the challenger's mean TTFT is lower by more than ``z`` standard errors of the difference
  (Welch's statistic over the trial's answered requests). A tie or a noisy difference keeps the
  incumbent, so the selector does not flip on noise.
* **guard against reward hacking** (GORGO v2 §4: a tuner scoring TTFT alone learned to send
  everything to the nearest replica — best TTFT, worst end-to-end latency): the challenger also
  needs a mean end-to-end latency at most ``e2e_slack`` worse than the incumbent's.
* **a losing trial stops early** (futility stopping, as in sequential A/B testing): once each rule
  has ``window // 4`` (at least 8) TTFTs of the trial answered, a challenger already behind by more than ``z``
  standard errors cannot take over, so the trial ends there and the incumbent serves the rest —
  every request the challenger would still have routed is one routed by the rule the evidence
  already ranks worse (``kvroute bench auto``: rag at 70 / 90 %, trials of the additive cost
  lengthened the TTFT p99 by ~8 %). Stopping only ever keeps the incumbent, so peeking at the
  evidence can cost a late switch, never a wrong one.
* **fewer trials while the answer holds.** The incumbent then serves ``exploit`` windows; each
  trial that keeps it doubles that (up to ``exploit × 8`` windows), a switch resets it — the
  doubling schedule of online learning, so exploration's share shrinks on stable traffic and a
  change of traffic is still followed.

Pure: no clock, no randomness; the outcome depends only on the events' order.
"""

from __future__ import annotations

import math

from kvroute.model import Endpoint, Request
from kvroute.policy.catalog import register_plugin
from kvroute.policy.hooks import Lifecycle
from kvroute.policy.plugins import Condition, DecisionState

A, B = 1, 0  # A: the guarded rule (the challenger) routes; B: fall through to the next rule (the incumbent)
MAX_DOUBLINGS = 3  # exploit at most 2**3 × the base stretch between trials


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and its standard error (0 for fewer than two samples)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def welch(better: list[float], worse: list[float]) -> float:
    """How many standard errors ``better``'s mean lies below ``worse``'s (≤ 0: not below)."""
    mb, sb = mean_se(better)
    mw, sw = mean_se(worse)
    se = math.hypot(sb, sw)
    if se == 0:
        return math.inf if mb < mw else 0.0
    return (mw - mb) / se


@register_plugin
class TTFTSelector(Condition, Lifecycle):
    """Holds while the rule it guards serves: both rules trialled interleaved, the challenger kept on evidence."""

    name = "ttft_selector"
    inputs = frozenset()

    def __init__(self, window: int = 64, exploit: int = 8, e2e_slack: float = 0.1, z: float = 2.0, scope: str = ""):
        if window < 8 or exploit < 1:
            raise ValueError("ttft_selector: window must be ≥ 8 and exploit ≥ 1")
        if z < 0:
            raise ValueError("ttft_selector: z must be ≥ 0")
        self.window, self.exploit, self.e2e_slack, self.z = window, exploit, e2e_slack, z
        self.scope = f"{scope}." if scope else ""  # names this instance's state when a policy has several
        self.incumbent = B  # the fall-through rule serves until the challenger is shown faster
        self.phase = "trial"  # trial → wait (for its answers) → exploit → trial ...
        self.arm = A  # the rule for the next dispatch
        self.trialled = 0  # dispatches in the current trial
        self.left = 0  # exploit: dispatches before the next trial
        self.kept = 0  # consecutive trials that kept the incumbent (doubles the exploit stretch)
        self.trial = 0  # trial number; a request is scored in the trial it was dispatched in
        self.asked: str | None = None  # the last request the condition was consulted for
        self.owner: dict[str, tuple[int, int]] = {}  # req id → (trial, arm)
        self.ttft: dict[int, list[float]] = {A: [], B: []}
        self.e2e: dict[int, list[float]] = {A: [], B: []}
        self.wins = {A: 0, B: 0}
        self.rounds = 0
        self.evidence = 0.0  # the last trial's statistic (challenger's lead in standard errors)
        self.stopped = 0  # trials ended early: the challenger was already behind by more than z

    def holds(self, st: DecisionState, eps: list[Endpoint]) -> bool:
        """True when the guarded rule routes this request (the request is marked as this
        condition's when the dispatch is committed: deciding changes nothing)."""
        rid = st.req.id
        st.defer(lambda: setattr(self, "asked", rid))
        return self.arm == A

    def on_dispatched(self, req: Request, endpoint: Endpoint, new_prefill_tokens: int) -> None:
        """Count the dispatch when this condition chose its rule; during a trial, alternate the rules."""
        if self.asked != req.id:
            return  # an earlier rule decided (hotspot, another regime): not ours to score
        if self.phase == "trial":
            self.owner[req.id] = (self.trial, self.arm)
            self.trialled += 1
            if self.trialled >= 2 * self.window:
                self.phase, self.arm = "wait", self.incumbent  # until enough of the trial has answered
            else:
                self.arm = A if self.trialled % 2 == 0 else B
        elif self.phase == "exploit":
            self.left -= 1
            if self.left <= 0:
                self._start_trial()

    def on_first_token(self, req_id: str, endpoint_id: str, ttft_s: float) -> None:
        """Score the TTFT for the rule that routed the request, if it belongs to the current trial."""
        tr_arm = self.owner.get(req_id)
        if tr_arm is not None and tr_arm[0] == self.trial:
            self.ttft[tr_arm[1]].append(ttft_s)
            if self.phase == "trial":
                self._maybe_stop()

    def on_finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """The guard's sample: end-to-end latency per rule; decide once the trial has answered."""
        tr_arm = self.owner.pop(req_id, None)
        if tr_arm is not None and tr_arm[0] == self.trial:
            self.e2e[tr_arm[1]].append(e2e_s)
        self._maybe_decide()

    def on_failed(self, req_id: str, endpoint_id: str) -> None:
        """No sample will come."""
        self.owner.pop(req_id, None)

    def _start_trial(self) -> None:
        self.trial += 1
        self.phase, self.arm, self.trialled = "trial", A, 0
        self.ttft, self.e2e = {A: [], B: []}, {A: [], B: []}
        self.owner = {}  # the last trial's stragglers no longer count

    def _maybe_stop(self) -> None:
        """End a trial early when the challenger is already behind by more than ``z`` standard errors."""
        inc = self.incumbent
        ch = A if inc == B else B
        if min(len(self.ttft[A]), len(self.ttft[B])) < max(8, self.window // 4):  # a Welch test needs a few
            return
        behind = welch(self.ttft[inc], self.ttft[ch])
        if behind > self.z:
            self.evidence = -behind
            self.stopped += 1
            self._keep()

    def _keep(self) -> None:
        """The incumbent stays: it serves a stretch that doubles with each trial it kept."""
        self.kept = min(MAX_DOUBLINGS, self.kept + 1)
        self.wins[self.incumbent] += 1
        self.rounds += 1
        self.phase, self.arm = "exploit", self.incumbent
        self.left = self.exploit * self.window * 2 ** self.kept

    def _maybe_decide(self) -> None:
        """Once half of each rule's trial requests answered: switch only on evidence the guard accepts."""
        if self.phase != "wait":
            return
        half = self.window // 2
        if min(len(self.ttft[A]), len(self.ttft[B]), len(self.e2e[A]), len(self.e2e[B])) < half:
            return
        inc = self.incumbent
        ch = A if inc == B else B
        self.evidence = welch(self.ttft[ch], self.ttft[inc])
        e2e_ok = mean_se(self.e2e[ch])[0] <= (1 + self.e2e_slack) * mean_se(self.e2e[inc])[0]
        if self.evidence > self.z and e2e_ok:
            self.incumbent, self.kept = ch, 0
            self.wins[self.incumbent] += 1
            self.rounds += 1
            self.phase, self.arm = "exploit", self.incumbent
            self.left = self.exploit * self.window * 2 ** self.kept
        else:
            self._keep()

    def state(self) -> dict[str, float]:
        """The rule serving (1: the guarded one), trials decided, each rule's wins, the last trial's evidence."""
        out = {"serving_guarded": float(self.arm == A), "rounds": float(self.rounds),
               "wins_guarded": float(self.wins[A]), "wins_other": float(self.wins[B]),
               "trialling": float(self.phase == "trial"), "evidence": round(max(-1e6, min(self.evidence, 1e6)), 3),
               "stopped_early": float(self.stopped)}
        return {self.scope + k: v for k, v in out.items()}
