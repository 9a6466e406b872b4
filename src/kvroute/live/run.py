"""`kvroute live SCENARIO`: the scenario of `kvroute simulate`, run for real on 127.0.0.1.

For the whole run: one ``kvroute emulate`` process per replica (the scenario's profiles; caches
emptied between policies through the emulator's ``/_restart``), and a ``DelayProxy`` in front of
every gateway and replica for each other region, adding half the scenario's RTT each way. Per
policy: one ``kvroute serve`` gateway per load balancer of its topology (``regional``,
``two-layer``, ``distributed``: one per region; ``global``: one), a ``kvroute controller``
over them, then the scenario's clients (``live/clients.py``) through ``/resolve``, bounded by
``--max-requests`` and ``--duration``; faults by flag (``live/faults.py``). Results go into the
simulator's ``Recorder``, so the table and JSON are ``kvroute simulate``'s.

Where live differs from the simulator by construction (said again in the closing note): the
in-region RTT (2 ms in the scenarios) is not added on loopback; client-side TTFT includes the
gateway's and the Python clients' own CPU time on a shared machine; an emulated engine steps in
real time, so a late event loop stretches its steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvroute.gateway.config import PEERING_MODES, GatewayConfig
from kvroute.live.clients import Driver, sample_replicas
from kvroute.live.delay import DelayProxy
from kvroute.live.faults import Fault
from kvroute.metrics import Recorder
from kvroute.perf.network import Network
from kvroute.ports import free_ports
from kvroute.processes import Child, Fleet
from kvroute.sim import migration_settings
from kvroute.sim.scenario import PolicyEntry, Scenario

ADMIN_ENV = "KVROUTE_LIVE_ADMIN_KEY"
CLIENT_ENV = "KVROUTE_LIVE_CLIENT_KEY"
PEER_ENV = "KVROUTE_LIVE_PEER_TOKEN"


@dataclass
class Topology:
    """The gateways one policy runs on: region → the replica regions it manages."""

    gateways: dict[str, list[str]]
    kind: str
    forward: bool


@dataclass
class LiveRun:
    """Everything a live run started, and how to reach it."""

    sc: Scenario
    folder: Path
    network: Network
    fleet: Fleet
    replicas: dict[str, Child] = field(default_factory=dict)  # id → emulator
    replica_region: dict[str, str] = field(default_factory=dict)
    proxies: dict[tuple[str, str], DelayProxy] = field(default_factory=dict)  # (endpoint, from region) → link
    regions: list[str] = field(default_factory=list)

    # -- links ------------------------------------------------------------------------------------
    async def link(self, endpoint: str, region: str, from_region: str, target: tuple[str, int] | None) -> str:
        """The delay proxy that ``from_region`` uses to reach ``endpoint`` (in ``region``); opened on
        first use, re-pointed at ``target`` afterwards (a gateway restarted for the next policy)."""
        key = (endpoint, from_region)
        proxy = self.proxies.get(key)
        if proxy is None:
            proxy = self.proxies[key] = DelayProxy(self.network.one_way(region, from_region), target,
                                                   name=f"{from_region}->{endpoint}")
            await proxy.start()
        proxy.target = target
        return proxy.url

    async def urls_from(self, endpoint: str, region: str, url: str) -> dict[str, str]:
        """Per other region, the proxy URL by which it reaches ``url``."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return {r: await self.link(endpoint, region, r, (host, int(port))) for r in self.regions if r != region}

    # -- replicas ---------------------------------------------------------------------------------
    async def start_replicas(self) -> None:
        """One emulator process per replica of the scenario, started together."""
        for g in self.sc.replicas:
            n0 = sum(1 for r in self.replica_region.values() if r == g.region)
            for i in range(g.count):
                rid = f"{g.region}-{n0 + i}"
                self.replica_region[rid] = g.region
                self.replicas[rid] = self.fleet.add(f"replica {rid}", ["emulate", "--host", "127.0.0.1", "--port",
                                                                       "0", "--profile", g.profile,
                                                                       "--engine", "vllm", "--model", "emulated"])
        await self.fleet.start([c.name for c in self.replicas.values()], timeout_s=60)
        for child in self.replicas.values():
            _pin_port(child)

    async def reset_replicas(self) -> None:
        """Before each policy: dead or frozen replicas come back, every cache is emptied."""
        for child in self.replicas.values():
            if child.paused:
                child.resume()
            if not child.alive:
                await child.start(60)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for child in self.replicas.values():
                async with s.post(f"{child.url}/_restart") as r:
                    r.raise_for_status()


def _pin_port(child: Child) -> None:
    """After the first start, restarts reuse the port it got (peers, proxies and the controller
    hold its address)."""
    args = child.args
    if "--port" in args:
        args[args.index("--port") + 1] = str(child.port)


def topology_of(sc: Scenario, entry: PolicyEntry) -> Topology:
    """The gateways for one policy: the simulator's balancer layout for its topology."""
    groups = sc.balancer_groups(entry.topology)
    gws = {}
    for b in groups:
        manages = sc.regions() if b.manages == "all" else (b.manages or [b.region])
        gws[b.region] = list(manages)
    forward = any(b.forward for b in groups)
    kind = entry.topology or (sc.topology.kind if sc.topology else None)
    if kind is None:  # balancers listed by hand: name their layout
        everywhere = [r for r, m in gws.items() if set(m) >= set(sc.regions())]
        kind = ("two-layer" if forward else "global" if len(gws) == 1 and everywhere
                else "distributed" if everywhere and len(everywhere) == len(gws) else "regional")
    return Topology(gws, kind, forward)


def routing_mode(topo: Topology, preset: str) -> str:
    """The gateway's mode for a simulator topology. ``two-layer`` with forwarding: peer forwarding,
    GORGO v1's distributed mode with the ``gorgo`` preset (``gorgo_distributed``, as
    ``sim/balancer.py``'s ``GorgoPeering``), SkyWalker's otherwise. ``global`` and ``distributed``
    gateways manage every region's replicas themselves; with a GORGO preset they weigh the
    measured RTT (``gorgo_proxy``)."""
    if topo.kind == "two-layer" and topo.forward and len(topo.gateways) > 1:
        return "gorgo_distributed" if preset == "gorgo" else "skywalker"
    if topo.kind in ("global", "distributed") and preset.startswith("gorgo"):
        return "gorgo_proxy"
    return "local"


def gateway_config(run: LiveRun, entry: PolicyEntry, topo: Topology, region: str,
                   replica_urls: dict[str, dict[str, str]], peers: list[dict[str, str]]) -> dict[str, Any]:
    """The YAML of one gateway: its replicas as seen from its region, keys, peers when the
    gateway supports them."""
    spec = run.sc.topology
    params, _ = migration_settings.split(entry.params)  # the simulator's own settings stay behind
    policy: str | dict[str, Any] = entry.preset if not params else {"preset": entry.preset, "params": params}
    replicas = [{"url": replica_urls[rid].get(region, run.replicas[rid].url), "id": rid,
                 "region": run.replica_region[rid], "engine": "vllm"}
                for rid in run.replicas if run.replica_region[rid] in topo.gateways[region]]
    cfg: dict[str, Any] = {
        "host": "127.0.0.1", "port": 0, "region": region, "policy": policy, "replicas": replicas,
        "probe": {"interval_s": spec.probe_interval_s if spec else 0.1},
        "queue": {"dispatch_tick_s": spec.dispatch_tick_s if spec else 0.01},
        "auth": {"keys": [{"name": "controller", "env": ADMIN_ENV, "admin": True},
                          {"name": "clients", "env": CLIENT_ENV}]},
        "access_log": False, "seed": run.sc.seed,
    }
    fields = GatewayConfig.model_fields
    if "routing_mode" in fields:
        cfg["routing_mode"] = routing_mode(topo, entry.preset)
    if cfg.get("routing_mode") in PEERING_MODES and "peers" in fields:
        cfg["peers"] = peers
        cfg["peer_auth"] = {"token_env": PEER_ENV}
    return cfg


@dataclass
class PolicyRun:
    """One policy's gateways and controller."""

    gateways: dict[str, Child]
    controller: Child
    gateway_urls: dict[str, str]


async def start_policy(run: LiveRun, entry: PolicyEntry, topo: Topology) -> PolicyRun:
    """Gateways (ports first, so peers can name each other), then the controller."""
    fleet, folder = run.fleet, run.folder
    replica_urls = {rid: await run.urls_from(rid, run.replica_region[rid], c.url) for rid, c in run.replicas.items()}
    # Gateways listen on ports chosen now, so every peer link can be opened before any starts.
    ports = dict(zip(topo.gateways, free_ports(len(topo.gateways)), strict=True))
    peer_links: dict[str, list[dict[str, str]]] = {}
    for region in topo.gateways:
        peer_links[region] = [
            {"name": f"gw-{other}", "region": other,
             "url": await run.link(f"gw-{other}", other, region, ("127.0.0.1", ports[other]))}
            for other in topo.gateways if other != region]
    gateways: dict[str, Child] = {}
    for region in topo.gateways:
        cfg = gateway_config(run, entry, topo, region, replica_urls, peer_links[region])
        cfg["port"] = ports[region]
        GatewayConfig.model_validate(cfg)  # a mistake here is kvroute's, not the user's: fail loudly
        path = folder / f"{entry.label}-gw-{region}.yaml".replace("/", "_")
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        name = f"{entry.label} gw-{region}"
        gateways[region] = fleet.add(name, ["serve", "--config", str(path), "--log-level", "WARNING"])
    await fleet.start([c.name for c in gateways.values()], timeout_s=60)
    gateway_urls = {region: c.url for region, c in gateways.items()}
    deployment = {
        "host": "127.0.0.1", "port": 0, "admin_key": {"env": ADMIN_ENV},
        "network": run.sc.network.model_dump(),
        "gateways": [{"name": f"gw-{region}", "region": region, "url": url,
                      "manages": topo.gateways[region],
                      "urls_from": await run.urls_from(f"gw-{region}", region, url)}
                     for region, url in gateway_urls.items()],
        "replicas": [{"id": rid, "region": run.replica_region[rid], "url": c.url, "engine": "vllm",
                      "urls_from": replica_urls[rid]} for rid, c in run.replicas.items()],
    }
    dep_path = folder / f"{entry.label}-deployment.yaml".replace("/", "_")
    dep_path.write_text(yaml.safe_dump(deployment, sort_keys=False))
    name = f"{entry.label} controller"
    controller = fleet.add(name, ["controller", "--config", str(dep_path), "--port", "0"])
    await controller.start(60)
    _pin_port(controller)
    return PolicyRun(gateways, controller, gateway_urls)


def check_faults(sc: Scenario, faults: list[Fault]) -> None:
    """Fail before anything starts when a fault names a replica or region the scenario lacks."""
    replicas = [r.id for r in sc.setup().replicas]
    regions = list(dict.fromkeys([*sc.regions(), *(b.region for e in sc.policy_list()
                                                   for b in sc.balancer_groups(e.topology))]))
    for f in faults:
        if f.kind == "replica" and f.target not in replicas:
            raise ValueError(f"--{f.action} replica:{f.target}: no such replica; replicas: {', '.join(replicas)}")
        if f.kind == "gateway" and (f.target or "").removeprefix("gw-") not in regions:
            raise ValueError(f"--{f.action} gateway:{f.target}: no such region; gateways are named by region: "
                             f"{', '.join(regions)}")


def fault_child(run: LiveRun, pol: PolicyRun, fault: Fault) -> Child | None:
    """The process a fault names; None for a gateway region this policy's topology has no gateway
    in (a global LB has one region); a name the scenario does not have is a ValueError listing
    the known ones."""
    if fault.kind == "controller":
        return pol.controller
    if fault.kind == "replica":
        if fault.target not in run.replicas:
            raise ValueError(f"--{fault.action} replica:{fault.target}: no such replica; replicas: "
                             f"{', '.join(run.replicas)}")
        return run.replicas[fault.target]
    target = (fault.target or "").removeprefix("gw-")
    if target not in run.regions:
        raise ValueError(f"--{fault.action} gateway:{fault.target}: no such region; gateways are named by "
                         f"region: {', '.join(run.regions)}")
    return pol.gateways.get(target)


async def inject(child: Child, fault: Fault, t0: float, log: list[dict[str, Any]]) -> None:
    """Apply one fault at its time (relative to ``t0``) and undo it after ``for_s``."""
    await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
    if fault.action == "kill":
        await child.kill()
    else:
        child.pause()
    log.append({"fault": fault.describe(), "pid": child.pid, "at_s": round(time.monotonic() - t0, 3)})
    if fault.for_s is None:
        return
    await asyncio.sleep(fault.for_s)
    if fault.action == "kill":
        await child.start(60)
        what = "restarted"
    else:
        child.resume()
        what = "resumed"
    log.append({"fault": fault.describe(), what: child.pid, "at_s": round(time.monotonic() - t0, 3)})


async def gateway_counts(urls: list[str]) -> tuple[int | None, dict[str, int]]:
    """Summed over the gateways' ``/metrics``: requests forwarded to peers (None when no gateway
    exports the counter) and routing decisions by policy branch, as the simulator counts them."""
    import re

    sample = re.compile(r'^(kvroute_peer_forwards_total|kvroute_policy_branch_total)(\{[^}]*\})? ([0-9.e+-]+)$')
    branch = re.compile(r'branch="([^"]*)"')
    forwards, seen = 0.0, False
    branches: dict[str, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        for url in urls:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with s.get(f"{url}/metrics") as r:
                    text = await r.text()
                for line in text.splitlines():
                    m = sample.match(line)
                    if m is None:
                        continue
                    if m[1] == "kvroute_peer_forwards_total":
                        forwards, seen = forwards + float(m[3]), True
                    elif (b := branch.search(m[2] or "")) is not None:
                        branches[b[1]] = branches.get(b[1], 0) + int(float(m[3]))
    return (int(forwards) if seen else None), dict(sorted(branches.items()))


async def run_policy(run: LiveRun, entry: PolicyEntry, *, max_requests: int | None, duration_s: float | None,
                     faults: list[Fault], client_key: str, drain_s: float = 60.0, on_progress=None) -> dict[str, Any]:
    """One policy, from fresh caches to its result row."""
    sc = run.sc
    await run.reset_replicas()
    topo = topology_of(sc, entry)
    pol = await start_policy(run, entry, topo)
    for f in faults:
        fault_child(run, pol, f)  # unknown names fail before any load
    recorder = Recorder(list(run.replicas), [run.replica_region[r] for r in run.replicas])
    # Only peering gateways forward; elsewhere an answer from another region is "remote".
    manages = ({f"gw-{r}": set(m) for r, m in topo.gateways.items()}
               if routing_mode(topo, entry.preset) in PEERING_MODES else {})
    driver = Driver(sc.make_workload(), recorder, dict(run.replica_region), pol.controller.url, manages,
                    client_key, max_requests, duration_s, on_done=on_progress)
    stop = asyncio.Event()
    fault_log: list[dict[str, Any]] = []
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_replicas(recorder, {r: c.url for r, c in run.replicas.items()},
                                                  sc.sample_interval_s, driver.now, stop))
    injectors = []
    for f in faults:
        child = fault_child(run, pol, f)
        if child is None:
            fault_log.append({"fault": f.describe(), "skipped": f"no gateway in {f.target} in this topology"})
        else:
            injectors.append((asyncio.create_task(inject(child, f, t0, fault_log)), f))
    try:
        await driver.run(drain_s)
    finally:
        stop.set()
        wall = time.monotonic() - t0
        # a fault already applied is undone before the run ends (bounded by the restart's own
        # timeout), so the report says how it ended: a restart that outlasted the workload (a loaded
        # machine) was cancelled and left out. One not due yet is dropped.
        applied = {e["fault"] for e in fault_log if "pid" in e}
        for t, f in injectors:
            if f.describe() not in applied:
                t.cancel()
        await asyncio.gather(sampler, *(t for t, _ in injectors), return_exceptions=True)
    forwards, branches = await gateway_counts([c.url for c in pol.gateways.values() if c.alive])
    for c in [*pol.gateways.values(), pol.controller]:
        await c.stop()
    result = recorder.result(len(run.replicas) * wall / 3600.0)
    result["issued"] = driver.issued
    result["load"] = recorder.load(max(0.0, driver.first_issue), driver.last_issue, driver.issued,
                                   driver.workload.closed_loop)
    result["slo"] = recorder.slo(sc.slo.ttft_s, sc.slo.tpot_s, driver.issued)
    result["branches"] = branches  # of the gateways alive at the end (a killed one's counts are gone)
    if forwards is not None:
        result["cross_region_forwards"] = forwards  # what the gateways decided, failed forwards included
    result["live"] = {"wall_s": round(wall, 3), "retries": driver.retries, "unfinished": driver.unfinished,
                      "errors": dict(sorted(driver.errors.items())), "resolve_lookups": driver.lookups,
                      "faults": fault_log, "gateways": sorted(f"gw-{r}" for r in topo.gateways),
                      "topology": topo.kind,
                      "forwards_source": "gateway metrics" if forwards is not None else "client-side paths"}
    return result


async def run_live(sc: Scenario, *, max_requests: int | None, duration_s: float | None, faults: list[Fault],
                   logs: str | None = None, drain_s: float = 60.0, on_start=None, on_progress=None) -> dict[str, Any]:
    """Every policy of the scenario, live; the report has ``kvroute simulate``'s shape."""
    folder = Path(logs) if logs else Path(tempfile.mkdtemp(prefix="kvroute-live-"))
    folder.mkdir(parents=True, exist_ok=True)
    admin, client, peer = (secrets.token_hex(16) for _ in range(3))
    keys = {ADMIN_ENV: admin, CLIENT_ENV: client, PEER_ENV: peer}
    os.environ.update(keys)  # the gateway configs name these variables; validated here, read by the children
    fleet = Fleet(folder, keys)
    network = sc.setup().network
    regions = list(dict.fromkeys([*sc.regions(), *sc.clients(), *(b.region for b in sc.balancer_groups())]))
    run = LiveRun(sc, folder, network, fleet, regions=regions)
    results: dict[str, Any] = {}
    ok = False
    try:
        await run.start_replicas()
        for entry in sc.policy_list():
            if on_start is not None:
                on_start(entry.label)
            progress = (lambda n, label=entry.label: on_progress(label, n)) if on_progress else None
            results[entry.label] = await run_policy(run, entry, max_requests=max_requests, duration_s=duration_s,
                                                    faults=faults, client_key=client, drain_s=drain_s,
                                                    on_progress=progress)
        ok = True
    finally:
        await fleet.stop_all()
        for proxy in run.proxies.values():
            await proxy.stop()
        if ok and not logs:
            shutil.rmtree(folder, ignore_errors=True)
    return {"scenario": sc.name, "seed": sc.seed, "replicas": sum(g.count for g in sc.replicas),
            "workload": sc.workload.kind, "slo": sc.slo.model_dump(), "results": results, "mode": "live",
            "logs": str(folder) if (logs or not ok) else None, "pids": sorted(fleet.all_pids())}
