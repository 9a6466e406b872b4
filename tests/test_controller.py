"""The controller against real gateways and emulated replicas on 127.0.0.1: a failed gateway's
replicas are served by the nearest healthy gateway within a second and return when it recovers,
a restarted controller loses nothing, clients retry through /resolve without losing a request
that had not started streaming, and a bad deployment file is one line naming file:line."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import aiohttp

from kvroute.cli import main
from kvroute.controller import Controller, start_controller
from kvroute.controller.deployment import Deployment
from kvroute.emulator.server import start_emulator
from kvroute.gateway.auth import digest
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.live.clients import Driver
from kvroute.metrics import Recorder
from kvroute.workload.synthetic import ChatWorkload

ADMIN, CLIENT = "test-admin-key", "test-client-key"
REGIONS = ("us", "eu", "asia")  # us–eu 80 ms, us–asia 150 ms: us fails over to eu
PROFILE = "h100-llama3.2-3b"


class Cluster:
    """One emulated replica and one in-process gateway per region, and a controller."""

    def __init__(self, stack: AsyncExitStack):
        self.stack = stack
        self.gateways: dict[str, Gateway] = {}
        self.configs: dict[str, GatewayConfig] = {}
        self.ctl: Controller | None = None
        self.ctl_url = ""
        self._runner = None

    async def start(self, monkeypatch) -> Cluster:
        monkeypatch.setenv("KVROUTE_TEST_ADMIN", ADMIN)
        urls = {}
        for region in REGIONS:
            runner, _, port = await start_emulator("127.0.0.1", 0, PROFILE)
            self.stack.push_async_callback(runner.cleanup)
            urls[region] = f"http://127.0.0.1:{port}"
        for region in REGIONS:
            cfg = GatewayConfig(host="127.0.0.1", port=0, region=region, policy="round_robin", access_log=False,
                                replicas=[{"url": urls[region], "id": f"{region}-0", "region": region}],
                                auth={"keys": [{"name": "controller", "sha256": digest(ADMIN), "admin": True},
                                               {"name": "clients", "sha256": digest(CLIENT)}]})
            await self.start_gateway(region, cfg)
        self.deployment = Deployment(
            admin_key={"env": "KVROUTE_TEST_ADMIN"},
            network={"rtt_ms": {"us-eu": 80, "us-asia": 150, "eu-asia": 200}},
            gateways=[{"name": f"gw-{r}", "region": r, "url": f"http://127.0.0.1:{self.gateways[r].port}"}
                      for r in REGIONS],
            replicas=[{"id": f"{r}-0", "region": r, "url": urls[r]} for r in REGIONS])
        await self.start_controller()
        self.stack.push_async_callback(self.stop_all)
        return self

    async def start_gateway(self, region: str, cfg: GatewayConfig | None = None) -> None:
        cfg = cfg or self.configs[region]
        gw = Gateway(cfg)
        await gw.start()
        self.configs[region] = cfg.model_copy(update={"port": gw.port})  # a restart takes the same port
        self.gateways[region] = gw

    async def kill_gateway(self, region: str) -> None:
        await self.gateways.pop(region).stop()

    async def start_controller(self) -> None:
        self.ctl, self._runner, port = await start_controller(self.deployment, port=0)
        self.ctl_url = f"http://127.0.0.1:{port}"

    async def stop_controller(self) -> None:
        assert self.ctl is not None and self._runner is not None
        await self._runner.cleanup()
        await self.ctl.stop()
        self.ctl = None

    async def stop_all(self) -> None:
        if self.ctl is not None:
            await self.stop_controller()
        for region in list(self.gateways):
            await self.kill_gateway(region)

    def holds(self, region: str) -> set[str]:
        return set(self.gateways[region].runtime.upstreams)

    async def resolve(self, region: str) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.get(f"{self.ctl_url}/resolve", params={"region": region}) as r:
            return r.status, await r.json()


async def _until(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``timeout_s``."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def _served_by(url: str, n: int) -> list[str]:
    body = {"model": "emulated", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {CLIENT}"}) as s:
        for _ in range(n):
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                out.append(r.headers["x-kvroute-replica"])
    return out


def test_failed_gateway_replicas_go_to_the_nearest_gateway_within_1s_and_come_back(monkeypatch):
    async def run() -> None:
        async with AsyncExitStack() as stack:
            c = await Cluster(stack).start(monkeypatch)
            assert (await c.resolve("us"))[1]["gateway"] == "gw-us"
            await c.kill_gateway("us")
            took = await _until(lambda: "us-0" in c.holds("eu"), 1.0)
            assert "us-0" not in c.holds("asia")  # eu is nearer to us than asia
            # a replica a gateway takes on is routable once its first probe there answers (one probe round)
            await _until(lambda: c.gateways["eu"].runtime.upstreams["us-0"].endpoint.healthy, 1.0)
            assert "us-0" in await _served_by(f"http://127.0.0.1:{c.gateways['eu'].port}", 4)
            status, body = await c.resolve("us")
            assert (status, body["gateway"]) == (200, "gw-eu")
            await c.start_gateway("us")  # recovery: same config, same port
            await _until(lambda: "us-0" not in c.holds("eu"), 2.0)
            assert c.holds("us") == {"us-0"} and c.holds("eu") == {"eu-0"}
            assert (await c.resolve("us"))[1]["gateway"] == "gw-us"
            assert took < 1.0
    asyncio.run(asyncio.wait_for(run(), 20))


def test_a_restarted_controller_loses_nothing(monkeypatch):
    async def run() -> None:
        async with AsyncExitStack() as stack:
            c = await Cluster(stack).start(monkeypatch)
            await c.kill_gateway("us")
            await _until(lambda: "us-0" in c.holds("eu"), 1.0)
            await c.stop_controller()
            await c.start_controller()  # it probes and reads the gateways before answering
            assert c.ctl is not None and c.ctl.moves == 0  # the failover stood: nothing re-done
            assert c.holds("eu") == {"eu-0", "us-0"}
            assert (await c.resolve("us"))[1]["gateway"] == "gw-eu"
            status = c.ctl.status()
            assert status["gateways"]["gw-us"]["healthy"] is False
            assert status["replicas"]["us-0"]["held_by"] == ["gw-eu"]
            await c.start_gateway("us")
            await _until(lambda: "us-0" not in c.holds("eu"), 2.0)
            assert (await c.resolve("us"))[1]["gateway"] == "gw-us"
    asyncio.run(asyncio.wait_for(run(), 20))


def test_clients_fail_over_through_resolve_and_lose_no_request_that_had_not_started(monkeypatch):
    async def run() -> None:
        async with AsyncExitStack() as stack:
            c = await Cluster(stack).start(monkeypatch)
            ids = [f"{r}-0" for r in REGIONS]
            rec = Recorder(ids, list(REGIONS))
            workload = ChatWorkload({"us": 6, "eu": 2}, seed=3)
            driver = Driver(workload, rec, dict(zip(ids, REGIONS)), c.ctl_url, {}, CLIENT, max_requests=40,
                            duration_s=2.5, retry_budget_s=4.0)
            streaming_at_kill = 0

            async def kill_soon() -> None:
                nonlocal streaming_at_kill
                await asyncio.sleep(0.6)
                streaming_at_kill = c.gateways["us"].active  # an upper bound: queued ones count too
                await c.kill_gateway("us")

            killer = asyncio.create_task(kill_soon())
            await driver.run(drain_s=5.0)
            await killer
            lost = {k: n for k, n in rec.failed.items() if k != "cut mid-stream"}
            assert lost == {}, f"requests lost before streaming: {lost}"
            assert rec.failed.get("cut mid-stream", 0) <= streaming_at_kill
            assert driver.retries > 0 and driver.lookups > 2  # they did go back to /resolve
            assert rec.completed + sum(rec.failed.values()) + driver.unfinished == driver.issued
            assert "us-0" in c.holds("eu")
    asyncio.run(asyncio.wait_for(run(), 30))


def test_resolve_needs_a_region_and_says_when_no_gateway_is_healthy(monkeypatch):
    async def run() -> None:
        dep = Deployment(gateways=[{"name": "gw-x", "region": "x", "url": "http://127.0.0.1:9"}])
        ctl, runner, port = await start_controller(dep, port=0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/resolve") as r:
                    assert r.status == 400
                async with s.get(f"http://127.0.0.1:{port}/resolve", params={"region": "x"}) as r:
                    assert r.status == 503 and "no healthy gateway" in (await r.json())["error"]["message"]
        finally:
            await runner.cleanup()
            await ctl.stop()
    asyncio.run(asyncio.wait_for(run(), 10))


def test_bad_deployment_files_are_one_line_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "deployment.yaml"
    path.write_text("gateways:\n  - {name: gw-a, region: a, url: http://127.0.0.1:1}\n"
                    "  - {name: gw-a, region: b, url: http://127.0.0.1:2}\n")
    assert main(["controller", "--config", str(path)]) == 2
    out = capsys.readouterr().err.strip()
    assert len(out.splitlines()) == 1 and f"{path}:3" in out and "unique" in out
    path.write_text("gateways:\n  - {name: gw-a, region: a, url: http://127.0.0.1:1}\n"
                    "replicas:\n  - {id: r, region: b, url: http://127.0.0.1:3}\n")
    assert main(["controller", "--config", str(path)]) == 2
    out = capsys.readouterr().err.strip()
    assert len(out.splitlines()) == 1 and "no gateway manages" in out
    assert f"{path}:4: replicas.0.region: replica 'r'" in out and "got" not in out  # no file echoed
    path.write_text("gateways:\n  - {name: gw-a, region: a, url: http://127.0.0.1:1, colour: red}\n")
    assert main(["controller", "--config", str(path)]) == 2
    out = capsys.readouterr().err.strip()
    assert f"{path}:2" in out and "colour" in out and "allowed" in out
    path.write_text("admin_key: {env: KVROUTE_SURELY_UNSET_VAR}\n"
                    "gateways:\n  - {name: gw-a, region: a, url: http://127.0.0.1:1}\n")
    assert main(["controller", "--config", str(path)]) == 2
    assert "KVROUTE_SURELY_UNSET_VAR" in capsys.readouterr().err
