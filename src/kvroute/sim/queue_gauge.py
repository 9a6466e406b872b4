"""SGLang's waiting-queue gauge: what a /metrics probe of an SGLang engine reads as "waiting".

SGLang does not export its queue length live. Its scheduler writes ``num_queue_reqs``
(``len(waiting_queue)``, with ``num_running_reqs``) into the Prometheus stats only in two places
(sgl-project/sglang ``python/sglang/srt/managers/scheduler_metrics_mixin.py``):

* ``log_prefill_stats``, called from ``Scheduler.get_new_batch_prefill`` (``scheduler.py``) once a
  prefill batch is formed, i.e. when ``can_run_list`` is not empty (a new or continuing chunk);
  a pass that admits nothing returns early and logs nothing;
* ``log_decode_stats``, called from ``process_batch_result_decode``
  (``scheduler_output_processor_mixin.py``) only when ``forward_ct_decode %
  decode_log_interval == 0``; ``decode_log_interval`` defaults to 40 (``server_args.py``).

So requests that arrived after the last such pass do not show, and a queue held back by the
admission budget (sim/sglang_admission.py) shows at the next 40th decode step. SkyWalker's
selective pushing reads this gauge (its "pending" signal, §3.3).

vLLM differs: its ``SchedulerStats.num_waiting_reqs`` (``vllm/v1/core/sched/scheduler.py``,
``make_stats``) is built after every engine step, a lag of at most one step; the live queue
(``Batch.queued``) is kept for it.

A profile switches it on with ``waiting_gauge: sglang`` (off by default, also for the L4 profile
that runs SGLang's admission: with it, SkyWalker's pending gate trails round robin on the Mooncake
check of tests/test_pacing.py, 0.57 vs 0.67 req/s, and nothing tuned here may hide that).
Kept out of the engine: :func:`kvroute.sim.sglang_admission.install` sets the engine's ``gauge``;
the step loop calls :meth:`SGLangQueueGauge.passed` after each admission pass, and the probe
(sim/balancer.py) calls :meth:`SGLangQueueGauge.read`.
"""

from __future__ import annotations

from typing import Protocol

from kvroute.sim.seq import Jump, Seq, steps_done

DECODE_LOG_INTERVAL = 40  # sglang server_args.py: decode_log_interval (default)


class Stepping(Protocol):
    """What the gauge reads of its engine (sim/batch.py's ``Batch``, which holds the gauge)."""

    steps: int  # decode steps run
    prefilling: list[Seq]
    _jump: Jump | None  # the decode jump in progress

    @property
    def queued(self) -> int:
        """Sequences waiting for admission."""


class SGLangQueueGauge:
    """``num_queue_reqs`` of one simulated SGLang engine: the waiting count as of the last
    prefill-batch formation or decode log (see the module docstring)."""

    __slots__ = ("engine", "value", "settled", "logged", "interval")

    def __init__(self, engine: Stepping, interval: int = DECODE_LOG_INTERVAL):
        self.engine = engine
        self.value = 0
        self.settled = 0  # the queue left by the last admission pass: what it is until an arrival
        self.logged = 0  # the engine's decode step count when the gauge was last brought up to date
        self.interval = interval

    def _decode_log_due(self, steps: int) -> bool:
        """Whether a decode step with ``forward_ct % interval == 0`` ran since the last look."""
        return steps // self.interval > self.logged // self.interval

    def passed(self) -> None:
        """After an admission pass at a step boundary. A decode log that fell due in the steps just
        ended saw the queue the previous pass left (SGLang takes arrivals in at the top of its
        loop, after logging); a step that will run prefill chunks is a prefill batch
        (``log_prefill_stats``), which sees the queue this pass leaves."""
        engine = self.engine
        steps = engine.steps
        if self._decode_log_due(steps):
            self.value = self.settled
        self.settled = engine.queued
        if engine.prefilling:
            self.value = self.settled
        self.logged = steps

    def read(self, now: float) -> int:
        """The gauge at ``now``. Within a decode jump the queue is what the last pass left until
        an arrival, which cuts the jump at its next step (and the next pass takes it in), so a
        decode log due mid-jump shows that queue."""
        engine = self.engine
        jump = engine._jump
        if jump is not None:
            steps = engine.steps + steps_done(jump, now - jump[0])
            if self._decode_log_due(steps):
                self.value = self.settled
                self.logged = steps
        return self.value
