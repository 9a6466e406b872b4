"""The gateway's probes of its replicas: every round reads each due replica's metrics (vLLM's
filtered series, else the whole page), updates the Endpoint the policy sees, ejects and re-admits
on streaks, notices restarts, learns KV capacity and served models, and rescales the prefix index
when the learned token ratio moved. What it needs of the runtime is :class:`ProbeHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.probes import (
    VLLM_FILTERED,
    ProbeError,
    kv_capacity,
    next_probe_interval,
    parse_prometheus,
    probe_forever,
    read_indicators,
    restarted,
    tick_breakers,
)
from kvroute.gateway.replica import Upstream
from kvroute.gateway.settings import ProbeConfig
from kvroute.gateway.tokens import RESIZE_STEP, TokenRatio
from kvroute.gateway.upstream import UpstreamConnectError, UpstreamError
from kvroute.gateway.upstream_get import get
from kvroute.model import Endpoint
from kvroute.policy import Router

log = logging.getLogger("kvroute.gateway")


class ProbeHost(Protocol):
    """What the prober reads and updates of the runtime around it."""

    config: GatewayConfig
    upstreams: dict[str, Upstream]
    router: Router
    events: Any  # the KV-event consumer (kvroute.kvevents), or None
    tokens: TokenRatio
    metrics: GatewayMetrics

    def drain_queue(self) -> None:
        """Let queued requests go where a replica freed up."""

    def replicas_changed(self) -> None:
        """A replica's engine or models changed (the per-model exclusions are stale)."""


class Prober:
    """Probes the host's replicas: once each at start-up (:meth:`probe_all`), then in the
    background at each replica's adaptive interval (:meth:`start`)."""

    def __init__(self, host: ProbeHost):
        self.host = host
        self.task: asyncio.Task | None = None
        self.index_scale = 1.0  # the token ratio the index's capacity was last computed with

    def start(self) -> None:
        """Keep probing in the background (after a first :meth:`probe_all`)."""
        self.task = asyncio.create_task(
            probe_forever(lambda: self.host.config.probe.interval_s, self.probe_due, "probe round failed"))

    async def stop(self) -> None:
        """Stop the background probing."""
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def probe_all(self) -> None:
        """Probe every replica once, in parallel; then tick the breakers, rescale the prefix index and let
        queued requests go where a replica freed up."""
        await self._probe_round(force=True)

    async def probe_due(self) -> None:
        """One round of the probe loop: the replicas whose adaptive interval has come
        (``probes.next_probe_interval``), then the same bookkeeping as :meth:`probe_all`."""
        await self._probe_round(force=False)

    async def _probe_round(self, force: bool) -> None:
        ups = list(self.host.upstreams.values())
        now = time.monotonic()
        slack = self.host.config.probe.interval_s / 2  # a round that runs a little early still probes what is due
        await asyncio.gather(*(self._probe(up) for up in ups if force or up.next_probe_at <= now + slack))
        tick_breakers(ups, time.monotonic())
        self._rescale_index()
        self.host.drain_queue()

    def _rescale_index(self) -> None:
        """A prefix block is a fixed span of bytes; when the learned token ratio has moved, its
        worth in tokens, and so each index's capacity in blocks, follows (gateway/tokens.py)."""
        scale = self.host.tokens.scale
        if abs(scale / self.index_scale - 1) <= RESIZE_STEP:
            return
        self.index_scale = scale
        self.host.router.index_block_tokens = self.host.tokens.block_tokens(self.host.config.block_tokens)
        for ep in self.host.router.all_endpoints:
            self.host.router.resize_index(ep.id)

    async def _probe(self, up: Upstream) -> None:
        pc = self.host.config.probe
        ep = up.endpoint
        t0 = time.monotonic()
        try:
            await self._read_probe(up, pc, ep, t0)
        finally:
            reading = up.reading
            idle = ep.healthy and ep.inflight == 0 and reading is not None and reading.running == 0 \
                and reading.waiting == 0
            up.probe_every_s = next_probe_interval(up.probe_every_s, idle, pc.interval_s, pc.idle_interval_s)
            up.next_probe_at = t0 + up.probe_every_s

    async def _scrape(self, up: Upstream, path: str, timeout_s: float) -> str:
        """One GET of the replica's metrics at ``path``; its text (ProbeError unless 200). Over the
        replica's own lean pool (gateway/upstream_get.py), not aiohttp: a fraction of the CPU."""
        # identity: prometheus_client's app (vLLM's /metrics/) gzips for a client that accepts it
        got = await get(up.pool, urlsplit(up.config.url).path + path, timeout_s)
        if got.status != 200:
            raise ProbeError(f"{path.split('?')[0]} answered {got.status}")
        text = got.text()
        up.probe_bytes += len(text)
        return text

    async def _read_probe(self, up: Upstream, pc: ProbeConfig, ep: Endpoint, t0: float) -> None:
        up.probes += 1
        try:
            reading = None
            if up.engine == "vllm" and up.filtered is not False:  # only the series routing reads
                try:
                    text = await self._scrape(up, VLLM_FILTERED, pc.timeout_s)
                    reading = read_indicators(parse_prometheus(text), up.engine)
                    up.filtered = True
                except ProbeError as exc:  # an engine that does not filter: the whole page from now on
                    up.filtered = False
                    log.info("replica %s: filtered metrics refused (%s); reading /metrics", ep.id, exc)
            if reading is None:
                text = await self._scrape(up, "/metrics", pc.timeout_s)
                reading = read_indicators(parse_prometheus(text), up.engine)
            if reading.kv_tokens is None:
                reading.kv_tokens = kv_capacity(text)
        except (TimeoutError, UpstreamError, ProbeError, UnicodeDecodeError) as exc:
            self.host.metrics.probe_failures.labels(ep.id).inc()
            if not up.answered:  # never routable yet: nothing to eject, but say when it stops being awaited
                up.streak.failed(False, pc.unhealthy_after)
                if up.streak.fails == pc.unhealthy_after:
                    log.warning("replica %s (%s) has not answered its first %d probes (%s); not routable until "
                                "one answers", ep.id, up.config.url, up.streak.fails, _why(exc))
                    self.host.drain_queue()  # requests waiting for it alone get their answer now
                return
            if up.streak.failed(ep.healthy, pc.unhealthy_after):
                ep.healthy = False
                why = _why(exc)
                log.warning("replica %s (%s) ejected after %d failed probes: %s", ep.id, up.config.url,
                            up.streak.fails, why)
                if isinstance(exc, UpstreamConnectError) and up.exchanges:
                    # nothing listens there (the engine died or restarted): the exchanges still open
                    # to it cannot be answered, whether or not their connection's close reached us;
                    # failed now, they are retried elsewhere (a non-streamed one would otherwise wait
                    # up to timeouts.non_stream_s for a head)
                    log.warning("replica %s: %d request(s) in flight there retried elsewhere", ep.id,
                                len(up.exchanges))
                    for abort in list(up.exchanges):
                        abort(UpstreamConnectError(f"replica {ep.id} ejected: {why}"))
            return
        ep.rtt_s = up.streak.rtt(time.monotonic() - t0, pc.rtt_ewma)
        if up.engine == "auto":
            up.engine = reading.engine
            self.host.replicas_changed()
        if restarted(up.reading, reading):  # a restart faster than ejection: the cache is gone
            up.restarts += 1
            self.host.router.forget_cache(ep.id)
            if self.host.events is not None:
                self.host.events.restarted(ep.id)  # its sequence starts over: replay from 0
            self.host.tokens.forget(ep.id)  # it may serve another model (tokenizer) now
            ep.warming = True  # its cache is empty: the warm-up rule may let it in
            log.warning("replica %s restarted (process start time or counters reset); its cache entries "
                        "are forgotten", ep.id)
        elif up.reading is None and reading.kv_usage is None:
            log.info("replica %s (%s) exports no KV-cache usage; KV-aware scores treat it as empty",
                     ep.id, reading.engine)
        if reading.kv_tokens and not up.config.kv_tokens and ep.kv_blocks != reading.kv_tokens:
            ep.kv_blocks = reading.kv_tokens  # block_size 1: capacity in tokens
            self.host.router.resize_index(ep.id)
            log.info("replica %s holds %d KV tokens (from its metrics); its prefix index is bounded to that",
                     ep.id, reading.kv_tokens)
        up.reading = reading
        if up.config.models is None and t0 - up.models_read_at >= pc.models_every_s:
            up.models_read_at = t0
            await self.read_models(up)
        ep.apply_probe(reading.running, reading.waiting, reading.kv_usage)
        if not up.answered:  # its first answer admits it: nothing was routed to it, no flapping to damp
            up.answered = True  # (Envoy's healthy_threshold: "during startup, only a single successful
            ep.healthy = True  # health check is required to mark a host healthy", config.core.v3.HealthCheck)
            log.info("replica %s (%s) answered its first probe: routable", ep.id, up.config.url)
        if up.streak.succeeded(ep.healthy, pc.healthy_after):
            ep.healthy = True
            self.host.router.forget_cache(ep.id)  # it may have restarted with an empty cache
            if self.host.events is not None:
                self.host.events.restarted(ep.id)
            ep.warming = True
            log.info("replica %s re-admitted", ep.id)

    async def read_models(self, up: Upstream) -> None:
        """What the replica serves, from its /v1/models (kept as it was when the read fails)."""
        try:
            got = await get(up.pool, urlsplit(up.config.url).path + "/v1/models", self.host.config.probe.timeout_s,
                            b"")
            data = json.loads(got.text()).get("data") if got.status == 200 else None
        except (TimeoutError, UpstreamError, ValueError, AttributeError):
            return
        if isinstance(data, list):
            cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
            up.model_cards = cards
            models = frozenset(c["id"] for c in cards)
            if models != up.models:
                up.models = models
                self.host.replicas_changed()


def _why(exc: BaseException) -> str:
    """A failed probe's cause in a few words (a timeout's message is empty)."""
    return str(exc) or ("timed out" if isinstance(exc, TimeoutError) else exc.__class__.__name__)
