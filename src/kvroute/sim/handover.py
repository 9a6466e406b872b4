"""Migration between simulated engines, the engine's side (split out of sim/engine.py, issue 22).

CascadeInfer's length stages and Llumnix-like rebalancing (driven by sim/migration.py) need
three things of an engine, all idle unless used: a context ``limit`` (a decode jump stops at the
step where a sequence passes it, and ``on_limit`` hears of it), ``depart`` (a decoding sequence
leaves at the next step boundary, releasing its KV) and ``adopt`` (a migrated sequence joins the
decode batch at the next step boundary with its KV already present, no prefill). The limit's
check after each step is the step loop's (sim/engine.py, ``on_limit``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvroute.perf.profile import HardwareProfile
from kvroute.sim.batch import Batch
from kvroute.sim.events import Scheduler
from kvroute.sim.seq import DECODE, Seq, steps_done


class Handover(Batch):
    """An engine's migration interface (see the module docstring)."""

    def __init__(self, profile: HardwareProfile, loop: Scheduler,
                 on_first_token: Callable[[Seq, float], None], on_finish: Callable[[Seq, float], None]):
        super().__init__(profile, loop, on_first_token, on_finish)
        # None / empty when unused, so they cost one test per step
        self.limit: int | None = None  # largest context this engine's stage serves
        self.leaving: list[tuple[Seq, Callable[[Seq, int], None]]] = []
        self.incoming: list[tuple[Seq, int]] = []
        self.reserved = 0  # KV tokens held for migrations on their way in

    def context(self, seq: Seq) -> int:
        """A decoding sequence's KV tokens now (mid-jump included); 0 when it does not decode here."""
        if seq.state != DECODE or self.decoding.get(seq.order) is not seq:
            return 0
        jump = self._jump
        done = steps_done(jump, self.loop.now - jump[0]) if jump is not None else 0
        return seq.a + self.steps + done

    def reserve(self, tokens: int) -> None:
        """Hold ``tokens`` of KV for a migration on its way in (negative: release them)."""
        self.reserved += tokens
        self.used += tokens

    def depart(self, seq: Seq, then: Callable[[Seq, int], None]) -> None:
        """Let a decoding sequence leave at the next step boundary; ``then(seq, context)`` runs
        once its KV is released (not at all if it finished or was preempted first)."""
        self.leaving.append((seq, then))
        if not self._busy:
            self._depart_leaving()
        elif self._jump is not None:
            self._interrupt(self._jump)

    def _depart_leaving(self) -> None:
        leaving, self.leaving = self.leaving, []
        for seq, then in leaving:
            if seq.state != DECODE or self.decoding.get(seq.order) is not seq:
                continue
            self.changes += 1
            ctx = seq.a + self.steps
            produced = seq.generated + ctx - seq.prompt + 1  # tokens generated so far
            self._release(seq)
            seq.generated = produced - 1  # at the target the carried KV counts as its prompt
            seq.prompt = ctx
            seq.moving = False
            then(seq, ctx)

    def adopt(self, seq: Seq, ctx: int) -> None:
        """Take over a migrated sequence whose ``ctx`` tokens of KV arrived; it decodes from the
        next step boundary."""
        self.incoming.append((seq, ctx))
        self.changes += 1
        self._wake()

    def _adopt_incoming(self) -> None:
        incoming, self.incoming = self.incoming, []
        now = self.loop.now
        for seq, ctx in incoming:
            self._order += 1
            seq.order = self._order
            seq.state = DECODE
            seq.refs = 0
            seq.private = ctx
            self.used += ctx
            seq.a = ctx - self.steps
            self.ctx_a += seq.a
            self.ctx_a2 += seq.a * seq.a
            self.decoding[seq.order] = seq
            self._schedule_finish(seq, now)
