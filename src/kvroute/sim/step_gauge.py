"""vLLM's waiting and running gauges: what a /metrics probe of a vLLM (v1) engine reads.

vLLM 0.32's engine core (``vllm/v1/engine/core.py``) runs ``run_busy_loop``: take the requests in
its input queue into the scheduler (``_process_input_queue``: between steps only; a request the
API server sends during a step waits in that queue, not in the scheduler), then ``step``:
``schedule()``, execute the model, ``update_from_output``. The last builds the step's
``SchedulerStats`` (``vllm/v1/core/sched/scheduler.py`` ``make_stats``: ``num_waiting_reqs`` and
``num_running_reqs`` from ``get_request_counts``) and sends them with the step's outputs; the API
server's Prometheus logger sets ``vllm:num_requests_waiting`` / ``_running`` from them
(``vllm/v1/metrics/loggers.py``). So the gauges a probe reads are those of the last finished step:
waiting = the requests that step's schedule left waiting (no token budget, batch slot or KV for
them), running = its batch less what finished in it. A request that arrives during a step and is
scheduled at the next one never shows as waiting. An idle engine publishes nothing until it
steps again.

The simulated engine's live queue (``Batch.queued``) counts such an arrival as waiting until the
step ends. On two vLLM CPU engines a cold prefill step of a ~1,600-token prompt lasts 0.2-0.5 s,
and SkyWalker's pending gate (policy/admission.py: available iff waiting is 0) then sent a
conversation's next turn to a replica without its history whenever it arrived during such a step
(issue 21l); the same was found for llama-server's gauge (sim/deferred_gauge.py, issue 21g).

A profile switches it on with ``waiting_gauge: vllm`` (`kvroute calibrate` writes it for engines that
export vLLM's ``cache_config_info``). Bundled profiles keep ``live``.
"""

from __future__ import annotations

from typing import Protocol


class Stepping(Protocol):
    """What the gauge reads of its engine (sim/batch.py's ``Batch``)."""

    @property
    def queued(self) -> int:
        """Sequences waiting for admission."""

    @property
    def running(self) -> int:
        """Sequences in the running batch."""


class VLLMStatsGauge:
    """``num_requests_waiting`` / ``num_requests_running`` of one simulated vLLM engine (see the module
    docstring). The step loop calls :meth:`passed` after each admission pass (the schedule) and
    :meth:`stepped` when the step (or decode jump) it planned ends; probes call :meth:`read`."""

    __slots__ = ("engine", "pending", "waiting", "running")

    def __init__(self, engine: Stepping):
        self.engine = engine
        self.pending = 0  # left waiting by the schedule of the step in progress
        self.waiting = 0  # as of the last finished step
        self.running = 0  # ditto: its batch less what finished in it

    def passed(self) -> None:
        """A schedule ended: what still waits was left out of the step it planned."""
        self.pending = self.engine.queued

    def stepped(self) -> None:
        """The planned step ended: its stats are published (waiting as its schedule left it, less
        any gone since; running after its finishes)."""
        self.waiting = min(self.pending, self.engine.queued)
        self.running = self.engine.running

    def read(self, now: float) -> int:
        """The waiting count a probe reads now (``now``: unused, the gauge changes only at step ends)."""
        return self.waiting
