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
admission budget (sim/sglang_admission.py) shows at the next 40th decode step. ``num_running_reqs``
is written by the same two calls (``running_bs``: the decode batch, ``len(running_batch.reqs)``),
so a probe's running count is as old as its queue count.

SkyWalker's selective pushing reads this gauge and nothing else (its "pending" signal, §3.3):
skypilot ``serve-multi-region-lb`` ``sky/serve/load_balancer.py``, ``_probe_ie_queue`` marks a
replica available iff the ``sglang:num_queue_reqs`` (or ``vllm:num_requests_waiting``) it scraped
every 0.1 s is 0, and with that indicator on ``ClientPool.pre_execute_hook`` returns before its
``max_concurrent_requests`` check, so requests sent since the last probe are not counted; the one
limit between probes is the 10 ms queue processor (policy/pacing.py).

vLLM differs: its ``SchedulerStats.num_waiting_reqs`` (``vllm/v1/core/sched/scheduler.py``,
``make_stats``) is built after every engine step, a lag of at most one step; the live queue
(``Batch.queued``) is kept for it.

A profile switches it on with ``waiting_gauge: sglang``; the L4 profile, which runs SGLang's
admission, does (issue 21). What it costs SkyWalker where replicas run out of memory: on the
deeply overloaded Mooncake replay of tests/test_pacing.py (8 L4s, TTFT p90 ~1,200 s for every
policy) its pending gate sends the paced stream into a replica whose held queue the gauge hides
for up to 40 decode steps, and it reaches 0.57 req/s against round robin's 0.67 (0.72 with a live
queue); that test pins a live queue, the signal issue 7's pacing criterion was written for.
Kept out of the engine: :func:`kvroute.sim.sglang_admission.install` sets the engine's ``gauge``;
the step loop calls :meth:`SGLangQueueGauge.passed` after each admission pass, and the probe
(sim/balancer.py) calls :meth:`SGLangQueueGauge.read` and reads :attr:`SGLangQueueGauge.running`, as
does an emulated SGLang engine's /metrics (emulator/server.py).
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

    decoding: dict  # the decode batch (SGLang's running_batch)


class SGLangQueueGauge:
    """``num_queue_reqs`` of one simulated SGLang engine: the waiting count as of the last
    prefill-batch formation or decode log (see the module docstring)."""

    __slots__ = ("engine", "value", "running", "settled", "settled_running", "logged", "interval")

    def __init__(self, engine: Stepping, interval: int = DECODE_LOG_INTERVAL):
        self.engine = engine
        self.value = 0
        self.running = 0  # num_running_reqs, written by the same two calls: the decode batch's size
        self.settled = 0  # the queue left by the last admission pass: what it is until an arrival
        self.settled_running = 0  # the batch that pass left
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
            self.value, self.running = self.settled, self.settled_running
        self.settled, self.settled_running = engine.queued, len(engine.decoding)
        if engine.prefilling:
            self.value, self.running = self.settled, self.settled_running
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
                self.value, self.running = self.settled, self.settled_running
                self.logged = steps
        return self.value
