"""Acting on stalls (``gateway/outlier.py`` decides): a sweep that ejects a stalled replica and
aborts its watched attempts, and a canary that re-admits it once it progresses again.

The sweep runs every ``SWEEP_S`` (or a quarter of ``stall.min_s`` when that is shorter), so a
frozen engine is out within its threshold plus one sweep. Ejection holds the replica's breaker
open (``CircuitBreaker.hold``): the policy stops choosing it at once, and no cooldown lets it back.
Aborting an attempt closes its upstream connection with an ``UpstreamTimeout``, which the proxy
already handles: retried on another replica before any byte reached the client, continued on
another replica after.

The canary is a one-token, non-streamed completion with a prompt of a few words, sent while the
replica is out, one at a time, every ``stall.canary_interval_s``. A 200 shows the engine
generates again: the replica is re-admitted (breaker closed). Any other answer shows the API
server lives but not that the engine progresses (a model name it refuses, a key it wants): the
breaker goes half-open for one watched trial request, which ejects it again if it stalls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Collection, Mapping
from typing import Protocol

from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.outlier import ReplicaWatch, StallDetector
from kvroute.gateway.replica import Upstream
from kvroute.gateway.upstream import UpstreamError, UpstreamTimeout

log = logging.getLogger("kvroute.gateway")
SWEEP_S = 0.25
CANARY_PROMPT = "kvroute canary"


class EjectionHost(Protocol):
    """What ejection reads of the runtime: its settings, replicas, drained set and metrics."""

    @property
    def config(self) -> GatewayConfig:
        """``stall`` and ``timeouts`` (read anew each sweep: a reload may change them)."""

    @property
    def upstreams(self) -> Mapping[str, Upstream]:
        """The replicas by name."""

    @property
    def drained(self) -> Collection[str]:
        """Replicas taking no new requests."""

    @property
    def metrics(self) -> GatewayMetrics:
        """Where ejections are counted."""

    def drain_queue(self) -> None:
        """A re-admitted replica may take held requests."""


class Ejector:
    """The runtime's stall detector and the task that acts on it."""

    def __init__(self, rt: EjectionHost):
        self.rt = rt
        sc = rt.config.stall
        self.detector = StallDetector(sc.factor, sc.min_s, sc.max_s)
        self._task: asyncio.Task[None] | None = None
        self._canaries: dict[str, asyncio.Task[None]] = {}
        self._canary_at: dict[str, float] = {}

    def start(self) -> None:
        """Sweep from now on (on the running loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop sweeping and cancel any canary in flight."""
        tasks = [t for t in (self._task, *self._canaries.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._task = None
        self._canaries.clear()

    def forget(self, name: str) -> None:
        """A replica was removed."""
        self.detector.forget(name)
        task = self._canaries.pop(name, None)
        if task is not None:
            task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_S, self.rt.config.stall.min_s / 4))
            try:
                self.sweep(time.monotonic())
            except Exception:  # a bug here must not stop stall detection
                log.exception("stall sweep failed")

    def sweep(self, now: float) -> None:
        """Eject what stalled just now; send canaries to what is out."""
        rt = self.rt
        if not rt.config.stall.enabled:
            return
        leaving: list[str] = []  # ejected in this sweep: the list below decides them all before any is held

        def may_eject(name: str) -> bool:
            if not self._others_can_serve(name, leaving):
                return False
            leaving.append(name)
            return True
        for name, watch, silent in list(self.detector.sweep(now, may_eject)):
            up = rt.upstreams.get(name)
            if up is None:
                continue
            up.breaker.hold(now)
            up.endpoint.circuit_open = True
            rt.metrics.stall_ejections.labels(name).inc()
            log.warning("replica %s ejected: none of its %d stream(s) got a token for %.1f s (it normally "
                        "goes %.2f s at most); they are retried or continued elsewhere", name,
                        len(watch.attempts), silent, watch.peak_gap_s)
            message = f"replica {name} made no progress for {silent:.1f} s (stalled)"
            for attempt in list(watch.attempts):
                if attempt.abort is not None:
                    attempt.abort(UpstreamTimeout(message))
        for name, watch in self.detector.watches.items():
            if watch.stalled and name not in self._canaries and name in rt.upstreams \
                    and now - self._canary_at.get(name, 0.0) >= rt.config.stall.canary_interval_s:
                self._canary_at[name] = now
                self._canaries[name] = asyncio.create_task(self._canary(name, rt.upstreams[name], watch))

    def _others_can_serve(self, name: str, leaving: Collection[str] = ()) -> bool:
        """Whether a replica other than ``name`` (and than those ``leaving`` in the same sweep) is
        healthy and admitted (else ejecting ``name`` would leave its requests nowhere to go; two
        replicas found silent in one sweep, as when the gateway itself was starved, ejected both)."""
        return any(other != name and other not in leaving and up.endpoint.healthy and up.breaker.allows
                   and other not in self.rt.drained for other, up in self.rt.upstreams.items())

    async def _canary(self, name: str, up: Upstream, watch: ReplicaWatch) -> None:
        rt = self.rt
        body: dict[str, object] = {"prompt": CANARY_PROMPT, "max_tokens": 1, "stream": False}
        model = next((str(c["id"]) for c in up.model_cards if c.get("id")), None) or \
            next(iter(sorted(up.models or ())), None)
        if model is not None:
            body["model"] = model
        wait = max(1.0, rt.config.stall.max_s)
        status = None
        response = None
        try:
            response = await up.pool.post("/v1/completions", json.dumps(body).encode(),
                                          [("Content-Type", "application/json")],
                                          connect_s=rt.config.timeouts.connect_s, first_byte_s=wait, idle_s=wait)
            await response.read(wait)
            status = response.status
        except UpstreamError:
            return  # still frozen (or gone): the next canary tries again
        finally:
            if response is not None:
                response.release()
            self._canaries.pop(name, None)
        if rt.upstreams.get(name) is not up or not watch.stalled:
            return
        now = time.monotonic()
        self.detector.readmit(watch, now)
        up.breaker.release(trial=status != 200)
        up.endpoint.circuit_open = not up.breaker.allows
        if status == 200:
            log.info("replica %s re-admitted: it generates again", name)
        else:
            log.info("replica %s answered its canary %s; one trial request decides", name, status)
        rt.drain_queue()
