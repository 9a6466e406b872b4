"""A scenario's clients over real HTTP: the simulator's workload, sent as OpenAI streaming chat.

The same ``Workload`` object that feeds ``kvroute simulate`` decides what is sent: closed-loop
programs (conversations, trees of thought) per client slot and region, or open-loop arrivals at
their trace or Poisson times. A request's prompt is rendered as text from its chained block
hashes — each block as ``block_tokens × 4`` bytes derived from that block's hash — so two
requests share text exactly where the workload says their prompts share a prefix, and the
gateway's and the emulator's own hashing (about 4 bytes per token) finds the same reuse.
``max_tokens`` is the workload's output length, which the emulator produces exactly.

Every client finds its gateway through the controller (``GET /resolve?region=R``). An attempt
that fails before the first byte of the answer (connection refused or reset, a status the
gateway itself retries on, ``gateway/retry.py``, with its backoff; a
stream that ends before any data) is retried through ``/resolve`` again until
``retry_budget_s`` runs out; a stream cut after it began is a failed request (the text it
already showed cannot be taken back). Requests still in flight when the drain time after the
last issue runs out are counted apart, as unfinished: the simulator lets every request finish.
Measurements go into the simulator's ``Recorder``, so the live table is computed exactly like
the simulated one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from kvroute.errors import ServiceError
from kvroute.gateway.retry import RETRY_STATUSES, backoff_s
from kvroute.metrics import Recorder
from kvroute.workload import Workload
from kvroute.workload.base import Program, SimRequest

BYTES_PER_TOKEN = 4  # kvroute's and the emulator's estimate for text prompts


def render_prompt(sreq: SimRequest) -> str:
    """Text whose shared prefixes are exactly the request's shared block hashes."""
    req = sreq.req
    width = req.block_tokens * BYTES_PER_TOKEN
    parts = []
    for h in req.block_hashes:
        word = f"{h & 0xFFFFFFFFFFFFFFFF:016x} "
        parts.append((word * (width // len(word) + 1))[:width])
    tail = req.prompt_tokens - len(req.block_hashes) * req.block_tokens
    if tail > 0:  # the unfinished last block: this request's own, never shared
        word = f"{req.id}-{zlib.crc32(req.id.encode()):08x} "
        n = tail * BYTES_PER_TOKEN
        parts.append((word * (n // len(word) + 1))[:n])
    return "".join(parts)


class Resolver:
    """The controller's ``/resolve`` answer per region, cached until an attempt fails there."""

    def __init__(self, controller_url: str, session: aiohttp.ClientSession):
        self.controller_url = controller_url
        self.session = session
        self._cache: dict[str, str] = {}
        self.gateway_of: dict[str, str] = {}  # url → the gateway's name, from /resolve answers
        self.lookups = 0

    async def url(self, region: str) -> str | None:
        """The gateway URL for ``region``; None while the controller knows no healthy gateway or
        cannot be reached (the caller waits and asks again)."""
        cached = self._cache.get(region)
        if cached is not None:
            return cached
        self.lookups += 1
        try:
            async with self.session.get(f"{self.controller_url}/resolve", params={"region": region},
                                        timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    return None
                answer = await r.json()
                url = str(answer["url"])
                self.gateway_of[url] = str(answer["gateway"])
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError):
            return None
        self._cache[region] = url
        return url

    def failed(self, region: str, url: str) -> None:
        """An attempt through ``url`` failed before any answer: ask the controller next time."""
        if self._cache.get(region) == url:
            del self._cache[region]


class RetryableError(ServiceError):
    """An attempt failed before the first byte of the answer."""


class StreamCut(ServiceError):
    """The stream ended or broke after the answer had begun."""


class Refused(ServiceError):
    """The gateway refused the request itself (a 4xx): retrying elsewhere would not help."""


@dataclass
class Outcome:
    """One completed request as the client saw it."""

    sent: float
    first: float
    done: float
    out_tokens: int
    prompt_tokens: int
    cached_tokens: int
    replica: str
    gateway: str | None
    attempts: int


@dataclass
class Driver:
    """Runs a workload against the deployment behind ``controller_url`` and records it."""

    workload: Workload
    recorder: Recorder
    replica_regions: dict[str, str]
    controller_url: str
    # gateway name → the replica regions it manages: an answer from elsewhere was forwarded
    manages: dict[str, set[str]] = field(default_factory=dict)
    api_key: str | None = None
    max_requests: int | None = None
    duration_s: float | None = None
    retry_budget_s: float = 30.0
    model: str = "emulated"
    on_done: Callable[[int], None] | None = None
    issued: int = 0
    first_issue: float = -1.0
    last_issue: float = 0.0
    retries: int = 0
    unfinished: int = 0  # in flight when the drain time ran out (neither completed nor failed)
    errors: dict[str, int] = field(default_factory=dict)
    _t0: float = 0.0
    _resolver: Resolver | None = None
    _session: aiohttp.ClientSession | None = None
    _stop_issuing: float = float("inf")
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def lookups(self) -> int:
        """``/resolve`` calls made (the first per region, then one after each failed attempt)."""
        return self._resolver.lookups if self._resolver is not None else 0

    def now(self) -> float:
        """Seconds since the run began (the recorder's clock)."""
        return time.monotonic() - self._t0

    def _may_issue(self) -> bool:
        if self.max_requests is not None and self.issued >= self.max_requests:
            return False
        return self.now() < self._stop_issuing

    async def run(self, drain_s: float = 60.0) -> None:
        """Issue until the request or time limit, then wait up to ``drain_s`` for what is in flight."""
        self._t0 = time.monotonic()
        if self.duration_s is not None:
            self._stop_issuing = self.duration_s
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=conn, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=None, sock_read=120)) as session:
            self._session = session
            self._resolver = Resolver(self.controller_url, session)
            if self.workload.closed_loop:
                slots = [(region, i) for region, n in self.workload.clients.items() for i in range(n)]
                starters = [asyncio.create_task(self._slot(region, i)) for region, i in slots]
            else:
                starters = [asyncio.create_task(self._open_loop())]
            await self._finish(starters, drain_s)

    async def _finish(self, starters: list[asyncio.Task], drain_s: float) -> None:
        """Wait for every program and request; once issuing has stopped, at most ``drain_s``."""
        stopped_at = None
        while True:
            pending = [t for t in (*starters, *self._tasks) if not t.done()]
            if not pending:
                return
            await asyncio.wait(pending, timeout=0.2)
            if self._may_issue():
                continue
            stopped_at = self.now() if stopped_at is None else stopped_at
            if self.now() - stopped_at > drain_s:
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return

    # -- closed loop ------------------------------------------------------------------------------
    async def _slot(self, region: str, slot: int) -> None:
        while self._may_issue():
            program = self.workload.new_program(region, slot)
            if program is None:
                return
            await self._program(program)

    async def _program(self, program: Program) -> None:
        """Run one program: its first requests, then what each completion asks for."""
        async def one(sreq: SimRequest) -> None:
            await self._request(sreq)
            if self.workload.think_time_s:
                await asyncio.sleep(self.workload.think_time_s)
            if not self._may_issue():
                return
            await asyncio.gather(*(one(s) for s in self._issue_all(program.on_complete(sreq))))

        await asyncio.gather(*(one(s) for s in self._issue_all(program.start())))

    def _issue_all(self, sreqs: list[SimRequest]) -> list[SimRequest]:
        out = []
        for s in sreqs:
            if not self._may_issue():
                break
            out.append(s)
            self._count_issue()
        return out

    def _count_issue(self) -> None:
        now = self.now()
        if self.first_issue < 0:
            self.first_issue = now
        self.last_issue = now
        self.issued += 1

    # -- open loop --------------------------------------------------------------------------------
    async def _open_loop(self) -> None:
        for sreq in self.workload.arrivals():
            if not self._may_issue():
                return
            wait = sreq.req.arrival_s - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._may_issue():
                return
            self._count_issue()
            task = asyncio.create_task(self._request(sreq))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- one request ------------------------------------------------------------------------------
    def _error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.recorder.fail(kind)

    async def _request(self, sreq: SimRequest) -> None:
        """Send one request, retrying through ``/resolve`` until its first byte; record it."""
        req = sreq.req
        region = req.region or "local"
        body = json.dumps({"model": self.model, "stream": True, "max_tokens": max(1, sreq.output_tokens),
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": render_prompt(sreq)}],
                           **({"user": req.routing_key} if req.routing_key else {})}).encode()
        try:
            await self._send(sreq, region, body)
        except asyncio.CancelledError:  # the run's drain time is over: not a failure, not a result
            self.unfinished += 1
            raise

    async def _send(self, sreq: SimRequest, region: str, body: bytes) -> None:
        assert self._resolver is not None, "requests are sent from run()"
        sent = self.now()
        deadline = sent + self.retry_budget_s
        attempts = 0
        while True:
            attempts += 1
            url = await self._resolver.url(region)
            if url is not None:
                try:
                    out = await self._attempt(url, body, sent, attempts)
                except RetryableError as exc:
                    self._resolver.failed(region, url)
                    why = str(exc)
                except StreamCut as exc:
                    self._error(f"cut mid-stream: {exc}")
                    return
                except Refused as exc:
                    self._error(f"refused: {exc}")
                    return
                else:
                    self._record(out, region)
                    return
            else:
                why = "no healthy gateway"
            wait = backoff_s(attempts, 0.05, 0.5, random.random())  # the gateway's rule (gateway/retry.py)
            if self.now() + wait > deadline:
                self._error(f"gave up: {why} ({attempts} attempts)")
                return
            self.retries += 1
            await asyncio.sleep(wait)

    async def _attempt(self, url: str, body: bytes, sent: float, attempts: int) -> Outcome:
        assert self._session is not None and self._resolver is not None, "requests are sent from run()"
        first = None
        out_tokens = 0
        usage: dict = {}
        try:
            async with self._session.post(f"{url}/v1/chat/completions", data=body,
                                          headers={"content-type": "application/json"}) as r:
                if r.status in RETRY_STATUSES:
                    await r.read()
                    raise RetryableError(f"HTTP {r.status}")
                if r.status != 200:
                    text = (await r.read())[:200]
                    raise Refused(f"HTTP {r.status}: {text!r}")
                replica = r.headers.get("x-kvroute-replica", "?")
                ended = False
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        ended = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        if first is None:
                            raise RetryableError(f"error event: {event['error'].get('message', '')[:100]}")
                        raise StreamCut(str(event["error"].get("message", ""))[:100])
                    if event.get("choices") and any((c.get("delta") or {}).get("content") for c in event["choices"]):
                        if first is None:
                            first = self.now()
                        out_tokens += 1
                    usage = event.get("usage") or usage
                if not ended:
                    if first is None:
                        raise RetryableError("stream ended before any token")
                    raise StreamCut("stream ended without [DONE]")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, OSError) as exc:
            if first is None:
                raise RetryableError(exc.__class__.__name__) from None
            raise StreamCut(exc.__class__.__name__) from None
        done = self.now()
        return Outcome(sent, first if first is not None else done, done,
                       int(usage.get("completion_tokens", out_tokens)), int(usage.get("prompt_tokens", 0)),
                       int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
                       replica, self._resolver.gateway_of.get(url), attempts)

    def _record(self, o: Outcome, client_region: str) -> None:
        rep_region = self.replica_regions.get(o.replica)
        rec = self.recorder
        if o.replica not in rec.index:  # a replica the run does not know (an operator's own)
            rec.index[o.replica] = len(rec.replica_ids)
            rec.replica_ids.append(o.replica)
        cross = rep_region is not None and rep_region != client_region
        # A replica outside the regions the client's gateway manages was reached through a peer
        # (or, during a failover, lent to that gateway: counted as forwarded too).
        managed = self.manages.get(o.gateway or "")
        forwarded = managed is not None and rep_region is not None and rep_region not in managed
        rec.complete(o.sent, o.first, o.done, o.out_tokens, o.prompt_tokens, o.cached_tokens, 0.0,
                     o.replica, cross, client_region, forwarded)
        rec.forwarded += forwarded
        if self.on_done is not None:
            self.on_done(rec.completed)


async def sample_replicas(recorder: Recorder, urls: dict[str, str], interval_s: float,
                          now: Callable[[], float], stop: asyncio.Event) -> None:
    """Every ``interval_s``, read each replica's running count from its ``/metrics`` into the
    recorder (the imbalance columns); a replica that does not answer counts 0 running."""
    from kvroute.gateway.probes import ProbeError, parse_prometheus, read_indicators

    ids = list(urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s:
        async def running(rid: str) -> int:
            try:
                async with s.get(f"{urls[rid]}/metrics") as r:
                    return int(read_indicators(parse_prometheus(await r.text())).running)
            except (TimeoutError, aiohttp.ClientError, OSError, ProbeError, ValueError):
                return 0

        while not stop.is_set():
            values = await asyncio.gather(*(running(r) for r in ids))
            counts = {rid: v for rid, v in zip(ids, values)}
            recorder.sample(now(), [counts.get(r, 0) for r in recorder.replica_ids])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
