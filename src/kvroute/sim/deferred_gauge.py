"""llama-server's waiting gauge: what a /metrics probe of a llama-server reads as "waiting".

llama-server exports ``llamacpp:requests_deferred`` = the size of its deferred-task queue and
``llamacpp:requests_processing`` = the slots processing a task (the llama.cpp that llama-cpp-python
0.3.36 vendors, tools/server/server-context.cpp ``SERVER_TASK_TYPE_METRICS``:
``queue_tasks.queue_tasks_deferred_size()``). A task is deferred only when its engine loop took it
up and found no free slot (``process_single_task``: ``get_available_slot`` gave none,
``queue_tasks.defer``); a slot's release moves one deferred task back to the front of the task
queue (server-queue.cpp ``pop_deferred_task``). The loop takes tasks up only between steps
(``process_new_tasks``; while a step computes, a completion task is declined and stays queued),
and the metrics task is answered during a step. So a request that arrived during a step and will
take a free slot at its end counts as neither deferred nor processing.

In the simulated engine: waiting = the sequences an admission pass left waiting (no free slot),
less those gone since; running = the batch (prefilling and decoding). Issue 21g: with the
engine's live queue instead, a warm turn arriving during a 0.5 s cold prefill step showed its
replica as "waiting", and SkyWalker's pending gate (policy/admission.py) sent it to a replica
without its history, which the live gateway in front of llama-server never did (21h's stored
run: every conversation stayed on one replica live; in the simulator 20-30 of 320 requests
per repeat went elsewhere).

A profile switches it on with ``waiting_gauge: llama_server`` (`kvroute calibrate` writes it for
llama-server).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from kvroute.sim.seq import Seq


class Slots(Protocol):
    """What the gauge reads of its engine (sim/batch.py's ``Batch``, which holds the gauge)."""

    waiting: deque[Seq]
    prefilling: list[Seq]
    decoding: dict

    @property
    def running(self) -> int:
        """Sequences in the running batch."""


class DeferredGauge:
    """``requests_deferred`` / ``requests_processing`` of one simulated llama-server (see the module
    docstring)."""

    __slots__ = ("engine", "deferred")

    def __init__(self, engine: Slots):
        self.engine = engine
        self.deferred = 0  # left waiting by the last admission pass: found no slot

    def passed(self) -> None:
        """An admission pass ended: what still waits found no free slot."""
        self.deferred = len(self.engine.waiting)

    def read(self, now: float) -> int:
        """The deferred count a probe reads now (arrivals since the last pass are not deferred yet)."""
        return min(self.deferred, len(self.engine.waiting))

    @property
    def running(self) -> int:
        """The slots processing a task."""
        return self.engine.running
