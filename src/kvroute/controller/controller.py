"""The controller (SkyWalker §3.4): probes every gateway and replica, fails a dead gateway's
replicas over to the nearest healthy gateway, moves them back when it recovers, and tells clients
which gateway to use (``GET /resolve?region=R``).

It keeps no state of its own. The plan — which gateway should hold which replica — is a function
of the deployment file and the latest probes; what each gateway actually holds is read back from
its admin API (``GET /admin/replicas``) and corrected (``POST`` / ``DELETE /admin/replicas``).
A restarted controller probes again, reads the gateways again and reaches the same plan, so a
restart mid-run loses nothing.

Choices where the paper is brief:
* "Nearest" is the smallest configured RTT from the replicas' region to a healthy gateway's
  region (ties: the gateway listed first); the same rule answers ``/resolve`` for a client region.
* A gateway fails after ``unhealthy_after`` consecutive failed probes of ``/readyz`` (a draining
  gateway answers 503 there, so it is failed over too) and recovers after ``healthy_after``
  good ones; the replicas move back only then, so a flapping gateway does not bounce them.
* A replica moves only while none of the gateways that manage its region is healthy; a helper
  gateway gets it under the replica's own id and region, so its metrics still say where it is.
* Replicas not in the deployment file are never touched: an operator's own additions stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvroute.controller.deployment import DeployedGateway, Deployment
from kvroute.gateway.http import error_object
from kvroute.gateway.probes import ProbeStreak

log = logging.getLogger("kvroute.controller")


@dataclass
class Health:
    """Probe streaks of one gateway or replica; ``healthy`` is None until the first probe."""

    healthy: bool | None = None
    streak: ProbeStreak = field(default_factory=ProbeStreak)  # the gateway's hysteresis, shared
    last_error: str = ""
    changed_at: float = 0.0

    def record(self, ok: bool, error: str, up_after: int, down_after: int) -> bool:
        """Count one probe; returns True when ``healthy`` changed. The very first probe decides
        at once (a restarted controller must not wait through a streak to see the world)."""
        before = self.healthy
        if ok:
            flips = self.streak.succeeded(bool(before), up_after)
        else:
            flips, self.last_error = self.streak.failed(bool(before), down_after), error
        if before is None or flips:
            self.healthy = ok
        if self.healthy != before:
            self.changed_at = time.monotonic()
            return True
        return False


@dataclass
class Controller:
    """Probes, plan and reconciliation for one deployment; ``serve`` adds the HTTP API."""

    deployment: Deployment
    gateways: dict[str, Health] = field(default_factory=dict)
    replicas: dict[str, Health] = field(default_factory=dict)
    holdings: dict[str, set[str]] = field(default_factory=dict)  # gateway → replica ids, as last read
    moves: int = 0  # admin calls that succeeded (adds and removes)
    _session: aiohttp.ClientSession | None = None
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        dep = self.deployment
        self.network = dep.network.model()
        self.token = dep.admin_token()
        self.gateways = {g.name: Health() for g in dep.gateways}
        self.replicas = {r.id: Health() for r in dep.replicas}
        self._by_name = {g.name: g for g in dep.gateways}
        self._replica_ids = {r.id for r in dep.replicas}

    # -- the plan ---------------------------------------------------------------------------------
    def healthy_gateways(self) -> list[DeployedGateway]:
        """Gateways whose last probes say they serve, in deployment order."""
        return [g for g in self.deployment.gateways if self.gateways[g.name].healthy]

    def nearest(self, region: str, among: list[DeployedGateway]) -> DeployedGateway | None:
        """The gateway of ``among`` with the smallest RTT from ``region`` (first listed on ties)."""
        return min(among, key=lambda g: self.network.rtt(region, g.region), default=None)

    def plan(self) -> dict[str, set[str]]:
        """Which replicas each healthy gateway should hold: its own, plus those of regions whose
        every managing gateway is down, each at the healthy gateway nearest to its region."""
        healthy = self.healthy_gateways()
        out: dict[str, set[str]] = {g.name: set() for g in healthy}
        for r in self.deployment.replicas:
            homes = [g for g in healthy if g.manages_region(r.region)]
            if homes:
                for g in homes:
                    out[g.name].add(r.id)
            elif (helper := self.nearest(r.region, healthy)) is not None:
                out[helper.name].add(r.id)
        return out

    def resolve(self, region: str) -> DeployedGateway | None:
        """The gateway a client in ``region`` should use: the nearest healthy one."""
        return self.nearest(region, self.healthy_gateways())

    # -- probes -----------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _get(self, url: str, auth: bool = False) -> tuple[int, bytes]:
        assert self._session is not None, "controller not started"
        timeout = aiohttp.ClientTimeout(total=self.deployment.probe.timeout_s)
        async with self._session.get(url, timeout=timeout, headers=self._headers() if auth else None) as r:
            return r.status, await r.read()

    async def _answers_200(self, base: str, path: str) -> tuple[bool, str]:
        """GET ``base + path``: whether it answered 200 and, when not, why (for logs and /status)."""
        try:
            status, _ = await self._get(f"{base}{path}")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return False, str(exc) or exc.__class__.__name__
        return status == 200, f"{path} answered {status}"

    async def probe_gateway(self, g: DeployedGateway) -> None:
        """One ``/readyz`` probe; a health change wakes the reconciler at once."""
        pc = self.deployment.probe
        ok, why = await self._answers_200(g.url, "/readyz")
        h = self.gateways[g.name]
        if h.record(ok, why, pc.healthy_after, pc.unhealthy_after):
            if h.healthy:
                log.info("gateway %s (%s) is healthy", g.name, g.region)
            else:
                log.warning("gateway %s (%s) failed: %s", g.name, g.region, why)
            self._changed.set()

    async def probe_replica(self, rid: str, url: str) -> None:
        """One replica ``/health`` probe, for ``/status``."""
        pc = self.deployment.probe
        ok, why = await self._answers_200(url, "/health")
        if self.replicas[rid].record(ok, why, pc.healthy_after, pc.unhealthy_after):
            log.log(logging.INFO if ok else logging.WARNING, "replica %s is %s", rid,
                    "healthy" if ok else f"failing: {why}")

    async def _gateway_loop(self, g: DeployedGateway) -> None:
        while True:
            await asyncio.sleep(self.deployment.probe.interval_s)
            await self.probe_gateway(g)

    async def _replica_loop(self) -> None:
        while True:
            await asyncio.sleep(self.deployment.probe.replica_interval_s)
            await asyncio.gather(*(self.probe_replica(r.id, r.url) for r in self.deployment.replicas))

    # -- reconciliation ---------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Read every healthy gateway's replicas and add or remove what differs from the plan."""
        plan = self.plan()
        await asyncio.gather(*(self._reconcile_one(self._by_name[name], want) for name, want in plan.items()))

    async def _reconcile_one(self, g: DeployedGateway, want: set[str]) -> None:
        if not self.token:
            return
        try:
            status, body = await self._get(f"{g.url}/admin/replicas", auth=True)
            if status != 200:
                raise ValueError(f"GET /admin/replicas answered {status}: {body[:200]!r}")
            have = {r["id"] for r in json.loads(body)["replicas"]}
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("gateway %s: cannot read its replicas: %s", g.name, exc)
            return
        self.holdings[g.name] = have
        ours = have & self._replica_ids  # replicas outside the deployment are left alone
        for rid in sorted(want - have):
            replica = next(r for r in self.deployment.replicas if r.id == rid)
            body_out = replica.as_seen_from(g.region).model_dump(mode="json", exclude_none=True)
            if await self._admin(g, "POST", "/admin/replicas", body_out, 201):
                have.add(rid)
                log.info("replica %s (%s) assigned to gateway %s (%s)", rid, replica.region, g.name, g.region)
        for rid in sorted(ours - want):
            if await self._admin(g, "DELETE", f"/admin/replicas/{rid}", None, 200):
                have.discard(rid)
                log.info("replica %s taken back from gateway %s", rid, g.name)

    async def _admin(self, g: DeployedGateway, method: str, path: str, body: dict | None, expect: int) -> bool:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, self.deployment.probe.timeout_s))
            async with self._session.request(method, f"{g.url}{path}", json=body, headers=self._headers(),
                                             timeout=timeout) as r:
                text = await r.text()
                if r.status == expect or (method == "POST" and r.status == 409):
                    self.moves += 1
                    return True
                log.warning("gateway %s: %s %s answered %d: %s", g.name, method, path, r.status, text[:200])
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning("gateway %s: %s %s failed: %s", g.name, method, path, exc)
        return False

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.deployment.probe.reconcile_s)
            self._changed.clear()
            try:
                await self.reconcile()
            except Exception:  # a bug in one round must not stop failover
                log.exception("reconcile round failed")

    # -- life cycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe everything once (so ``/resolve`` answers from the first request), reconcile once,
        then keep probing and reconciling in the background."""
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        dep = self.deployment
        await asyncio.gather(*(self.probe_gateway(g) for g in dep.gateways),
                             *(self.probe_replica(r.id, r.url) for r in dep.replicas))
        await self.reconcile()
        self._changed.clear()
        self._tasks = [asyncio.create_task(self._gateway_loop(g)) for g in dep.gateways]
        self._tasks += [asyncio.create_task(self._replica_loop()), asyncio.create_task(self._reconcile_loop())]

    async def stop(self) -> None:
        """Stop probing; the gateways keep what they hold."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._session is not None:
            await self._session.close()

    def status(self) -> dict:
        """Health of everything, the plan, and what each gateway held when last read."""
        plan = self.plan()
        return {
            "gateways": {g.name: {"region": g.region, "healthy": self.gateways[g.name].healthy,
                                  "last_error": self.gateways[g.name].last_error,
                                  "should_hold": sorted(plan.get(g.name, ())),
                                  "holds": sorted(self.holdings.get(g.name, ()))}
                         for g in self.deployment.gateways},
            "replicas": {r.id: {"region": r.region, "healthy": self.replicas[r.id].healthy,
                                "held_by": sorted(n for n, ids in plan.items() if r.id in ids)}
                         for r in self.deployment.replicas},
            "moves": self.moves,
        }


def build_app(ctl: Controller) -> web.Application:
    """``/resolve``, ``/status``, ``/health``."""

    async def resolve(request: web.Request) -> web.Response:
        region = request.query.get("region", "").strip()
        if not region:
            return web.json_response(error_object("give ?region=NAME (the client's region)"), status=400)
        g = ctl.resolve(region)
        if g is None:
            return web.json_response(error_object("no healthy gateway", "server_error"), status=503,
                                     headers={"Retry-After": "1"})
        return web.json_response({"gateway": g.name, "region": g.region, "url": g.url_from(region),
                                  "rtt_ms": round(ctl.network.rtt(region, g.region) * 1000, 3)})

    async def status(request: web.Request) -> web.Response:
        return web.json_response(ctl.status())

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/resolve", resolve)
    app.router.add_get("/status", status)
    app.router.add_get("/health", health)
    return app


async def start_controller(deployment: Deployment, port: int | None = None) -> tuple[Controller, web.AppRunner, int]:
    """Start probing and listening; returns the controller, its runner and the bound port."""
    ctl = Controller(deployment)
    await ctl.start()
    runner = web.AppRunner(build_app(ctl), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, deployment.host, deployment.port if port is None else port)
        await site.start()
    except OSError:
        await runner.cleanup()
        await ctl.stop()
        raise
    return ctl, runner, int(runner.addresses[0][1])
