"""Several gateway instances over one region's replicas, sharing load through a real nats-server
on 127.0.0.1: a sibling's requests count in this instance's decisions; without NATS each routes
on its own view and says so (log, /health, admin API, metrics), and resyncs when NATS returns."""

from __future__ import annotations

import asyncio
import logging
import threading

import httpx
import pytest

from kvroute.fleet.services import nats_server
from kvroute.gateway.config import GatewayConfig
from tests.fleet_harness import fleet_mesh, needs_nats
from tests.test_peers import CHAT, _make_event, hanging_until, post

pytestmark = needs_nats


@pytest.fixture
def mesh(monkeypatch):
    yield from fleet_mesh(monkeypatch)


@pytest.fixture
def natsd(tmp_path):
    svc = nats_server(tmp_path)
    svc.start()
    yield svc
    svc.stop()


def held(mesh, url: str) -> threading.Thread:
    """A request that stays in flight at the engine until the test releases it."""
    t = threading.Thread(target=post, args=(url, dict(CHAT, messages=[{"role": "user", "content": "HOLD me"}])))
    t.start()
    return t


def test_siblings_route_on_each_others_load(mesh, natsd):
    m = mesh
    release = m.call(_make_event())
    replicas = [m.scripted(hanging_until(release)), m.scripted(hanging_until(release))]
    url = f"nats://127.0.0.1:{natsd.port}"
    a = m.instance("a", "us", replicas, url)
    m.instance("b", "us", replicas, url)
    assert m.wait_until(lambda: a.runtime.fleet.connected and len(a.runtime.fleet.ledger.siblings) == 1)
    holders = [held(m, m.url("a")) for _ in range(3)]  # three long requests through instance a
    assert m.wait_until(lambda: m.inflight("b") == 3, timeout=5)  # b counts them
    b_eps = {e.id: e.inflight for e in m.gateways["b"].runtime.router.endpoints}
    a_eps = {e.id: e.inflight for e in a.runtime.router.endpoints}
    assert b_eps == a_eps  # the same per-replica load on both instances
    light = min(b_eps, key=b_eps.get)
    r = post(m.url("b"), dict(CHAT, stream=True))  # least_request at b picks the replica a loaded least
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == light
    m.loop.call_soon_threadsafe(release.set)
    for t in holders:
        t.join(5)
    assert m.wait_until(lambda: m.inflight("b") == 0 and m.mirrored("b") == 0, timeout=5)
    text = httpx.get(f"{m.url('b')}/metrics").text
    assert "kvroute_fleet_connected 1.0" in text and "kvroute_fleet_siblings 1.0" in text
    assert httpx.get(f"{m.url('b')}/health").json()["fleet"] == "synced"
    # a stops: it says bye and b forgets it then, not after its 1 s timeout. With NATS slow to confirm
    # the bye (as on a loaded machine; 0.3 s here), a's heartbeats went on meanwhile, and one sent
    # after the bye brought a back at b until the timeout forgot it again (1.02 s seen under load)
    fleet_b = m.gateways["b"].runtime.fleet
    flush = a.runtime.fleet.nc.flush

    async def slow_flush(*args, **kw):
        await asyncio.sleep(0.3)
        return await flush(*args, **kw)

    a.runtime.fleet.nc.flush = slow_flush
    m.call(a.stop())
    assert m.wait_until(lambda: not fleet_b.ledger.siblings, timeout=5)
    # nothing of a's after its bye: b never takes a back, so its timeout never forgets a
    registry = m.gateways["b"].runtime.metrics.registry
    assert not m.wait_until(lambda: fleet_b.ledger.siblings or registry.get_sample_value(
        "kvroute_fleet_siblings_expired_total"), timeout=1.5)


def test_nats_lost_routes_on_the_local_view_then_resyncs(mesh, natsd, tmp_path, caplog, monkeypatch):
    m = mesh
    monkeypatch.setenv("KVROUTE_TEST_ADMIN", "adm-1")
    release = m.call(_make_event())
    replicas = [m.scripted(hanging_until(release)), m.scripted(hanging_until(release))]
    url = f"nats://127.0.0.1:{natsd.port}"
    admin = {"auth": {"keys": [{"name": "ops", "env": "KVROUTE_TEST_ADMIN", "admin": True}]}}
    m.instance("a", "us", replicas, url)
    b = m.instance("b", "us", replicas, url, **admin)
    holder = held(m, m.url("a"))
    assert m.wait_until(lambda: m.mirrored("b") == 1, timeout=5)
    with caplog.at_level(logging.INFO, logger="kvroute.fleet"):
        natsd.kill()
        assert m.wait_until(lambda: b.runtime.fleet.state == "local-view", timeout=5)
        assert m.wait_until(lambda: m.mirrored("b") == 0)  # the sibling's load can no longer be followed: forgotten
        assert httpx.get(f"{m.url('b')}/health").json()["fleet"] == "local-view"
        view = httpx.get(f"{m.url('b')}/admin/fleet", headers={"Authorization": "Bearer adm-1"}).json()
        assert view["sync"] == "local-view" and view["siblings"] == []
        assert "kvroute_fleet_connected 0.0" in httpx.get(f"{m.url('b')}/metrics").text
        assert any("routing on this instance's own view" in r.getMessage() for r in caplog.records)
        for _ in range(3):  # still routing, on its own counts
            assert post(m.url("b"), dict(CHAT, stream=True), {"Authorization": "Bearer adm-1"}).status_code == 200
        restarted = nats_server(tmp_path, port=natsd.port)  # NATS comes back on the same address
        restarted.start()
        try:
            assert m.wait_until(lambda: b.runtime.fleet.state == "synced", timeout=8)
            assert m.wait_until(lambda: m.mirrored("b") == 1, timeout=5)  # a's held request, from its snapshot
            assert any("reconnected to NATS" in r.getMessage() for r in caplog.records)
            m.loop.call_soon_threadsafe(release.set)
            holder.join(5)
            assert m.wait_until(lambda: m.mirrored("b") == 0 and m.inflight("b") == 0, timeout=5)
        finally:
            restarted.stop()


def test_a_gateway_starts_and_serves_while_nats_is_down(mesh, natsd):
    m = mesh
    natsd.kill()
    gw = m.instance("solo", "us", [m.scripted()], f"nats://127.0.0.1:{natsd.port}")
    assert gw.runtime.fleet.state == "local-view"
    assert post(m.url("solo"), dict(CHAT, stream=True)).status_code == 200


def test_fleet_config_errors_name_the_field():
    with pytest.raises(ValueError, match="nats_url must start with nats://"):
        GatewayConfig(fleet={"nats_url": "http://x:4222"})
    with pytest.raises(ValueError, match="timeout_s"):
        GatewayConfig(fleet={"nats_url": "nats://127.0.0.1:4222", "heartbeat_s": 1, "timeout_s": 1.5})


def test_scope_all_shares_dispatches_across_regions(mesh, natsd):
    """A distributed deployment (each region's gateway over every region's replicas): with ``scope:
    all`` the eu gateway counts the us gateway's requests on the shared replicas; with the default
    ``region`` scope it does not (each region has its own subject)."""
    m = mesh
    release = m.call(_make_event())
    replicas = [m.scripted(hanging_until(release)), m.scripted(hanging_until(release))]
    url = f"nats://127.0.0.1:{natsd.port}"
    us = m.instance("us1", "us", replicas, url, replica_region="us", scope="all")
    m.instance("eu1", "eu", replicas, url, replica_region="us", scope="all")
    m.instance("eu2", "eu", replicas, url, replica_region="us")  # region scope: kvroute.fleet.eu
    assert us.runtime.fleet.subject == "kvroute.fleet.all"
    assert m.wait_until(lambda: len(us.runtime.fleet.ledger.siblings) == 1)
    holders = [held(m, m.url("us1")) for _ in range(3)]
    assert m.wait_until(lambda: m.inflight("eu1") == 3 and m.mirrored("eu1") == 3, timeout=5)
    assert m.inflight("eu2") == 0 and not m.gateways["eu2"].runtime.fleet.ledger.siblings
    eu = {e.id: e.inflight for e in m.gateways["eu1"].runtime.router.endpoints}
    assert eu == {e.id: e.inflight for e in us.runtime.router.endpoints}
    light = min(eu, key=eu.get)  # least_request at eu1 picks the replica us1 loaded least
    r = post(m.url("eu1"), dict(CHAT, stream=True))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == light
    m.loop.call_soon_threadsafe(release.set)
    for t in holders:
        t.join(5)
    assert m.wait_until(lambda: m.inflight("eu1") == 0 and m.mirrored("eu1") == 0, timeout=5)


def test_fleet_scope_is_checked(monkeypatch):
    monkeypatch.setenv("KVROUTE_TEST_SCOPE_TOKEN", "t")
    with pytest.raises(ValueError, match="scope"):
        GatewayConfig(region="us", replicas=[{"url": "http://127.0.0.1:1"}],
                      fleet={"nats_url": "nats://127.0.0.1:4222", "scope": "world"})
    with pytest.raises(ValueError, match="fleet.scope all is for gateways"):  # peers: queues would mix regions
        GatewayConfig(region="us", replicas=[{"url": "http://127.0.0.1:1"}], routing_mode="skywalker",
                      peers=[{"name": "eu", "url": "http://127.0.0.1:2", "region": "eu"}],
                      peer_auth={"token_env": "KVROUTE_TEST_SCOPE_TOKEN"},
                      fleet={"nats_url": "nats://127.0.0.1:4222", "scope": "all"})
