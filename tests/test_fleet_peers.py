"""Multi-region stays one system when each region runs several instances (issue 19 item 5): two
regions, two gateway instances each sharing load over a real nats-server, each region behind its
own HAProxy on 127.0.0.1; peers point at the other region's HAProxy. SkyWalker forwards from
either instance, a peer's status reports its whole region's queue, and GORGO's distributed
decision at one instance weighs the load its sibling put on the home replica."""

from __future__ import annotations

import threading

import httpx
import pytest

from kvroute.fleet.services import haproxy, nats_server
from kvroute.gateway.peers import STATUS_PATH, TOKEN_HEADER
from tests.fleet_harness import fleet_mesh, needs_haproxy, needs_nats
from tests.test_peers import BUSY, CHAT, TOKEN, _delay_proxy, _make_event, hanging_until, post

pytestmark = [needs_nats, needs_haproxy]


@pytest.fixture
def mesh(monkeypatch):
    yield from fleet_mesh(monkeypatch)


@pytest.fixture
def services(tmp_path):
    started = []

    def start(svc):
        svc.start()
        started.append(svc)
        return svc

    yield start
    for svc in reversed(started):
        svc.stop()


def two_regions(mesh, services, tmp_path, us_replicas, eu_replicas, mode, **overrides):
    """us-a, us-b over ``us_replicas``; eu-a, eu-b over ``eu_replicas``; a front per region."""
    natsd = services(nats_server(tmp_path))
    url = f"nats://127.0.0.1:{natsd.port}"
    fronts = {}
    for region in ("us", "eu"):
        (tmp_path / region).mkdir()
        fronts[region] = haproxy(tmp_path / region, [(f"{region}-{x}", mesh.port(f"{region}-{x}")) for x in "ab"])
    other = {"us": "eu", "eu": "us"}
    for region, replicas in (("us", us_replicas), ("eu", eu_replicas)):
        for x in "ab":
            mesh.instance(f"{region}-{x}", region, replicas, url, mode=mode, **overrides,
                          peers=[(other[region], f"http://127.0.0.1:{fronts[other[region]].port}")])
    for front in fronts.values():
        services(front)
    for name in ("us-a", "us-b", "eu-a", "eu-b"):
        link = mesh.gateways[name].runtime.peering.links["eu" if name.startswith("us") else "us"]
        assert mesh.wait_until(lambda link=link: link.endpoint.healthy and link.endpoint.rtt_s > 0, timeout=8)
    return fronts


def test_skywalker_across_regions_of_several_instances(mesh, services, tmp_path):
    release = mesh.call(_make_event())
    busy_us = mesh.scripted(metrics=BUSY)  # no us replica admits: the queue's head goes to eu
    eu_busy = mesh.scripted(hanging_until(release), metrics=BUSY)
    two_regions(mesh, services, tmp_path, [busy_us], [eu_busy], "skywalker",
                policy={"preset": "skywalker", "params": {"admission": "pending"}}, queue={"max_wait_s": 8.0})
    # eu's instances both hold requests (their replica reports waiting, and us is busy too)
    held = [threading.Thread(target=post, args=(mesh.url(name), dict(CHAT, stream=True)), kwargs={"timeout": 15})
            for name in ("eu-a", "eu-b", "eu-b")]
    for t in held:
        t.start()
    assert mesh.wait_until(lambda: sum(len(mesh.gateways[n].runtime.queue) for n in ("eu-a", "eu-b")) == 3, 5)
    assert mesh.wait_until(lambda: mesh.gateways["eu-a"].runtime.fleet.sibling_queue() == 2, 3)
    status = httpx.get(f"{mesh.url('eu-a')}{STATUS_PATH}", headers={TOKEN_HEADER: TOKEN}).json()
    assert status["queue"] == 3  # its own one and its sibling's two: the region's queue
    mesh.loop.call_soon_threadsafe(release.set)
    mesh.upstreams[1].metrics = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"  # eu free again
    for t in held:
        t.join(15)
    # a request at either us instance is forwarded to eu, through eu's front
    for name in ("us-a", "us-b"):
        link = mesh.gateways[name].runtime.peering.links["eu"]
        assert mesh.wait_until(lambda link=link: link.endpoint.peer_available > 0 and link.endpoint.peer_queue == 0, 5)
        r = post(mesh.url(name), dict(CHAT, stream=True))
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
        assert mesh.forwards(name, "eu", "no-local-replica") == 1


def test_gorgo_distributed_weighs_the_siblings_load(mesh, services, tmp_path):
    release = mesh.call(_make_event())
    # one request per replica (§7's per-instance cap): a request the sibling's in-flight one keeps out is held
    gorgo = {"policy": {"preset": "gorgo", "params": {"admission": "outstanding", "max_outstanding": 1}}}
    home = mesh.scripted(hanging_until(release))
    # eu is 60+ ms away from us (loopback jitter cannot make it look cheaper than home)
    eu_port = mesh.port("eu-front")
    server, far_port = mesh.call(_delay_proxy(eu_port, 0.03))
    mesh.servers.append(server)
    natsd = services(nats_server(tmp_path))
    url = f"nats://127.0.0.1:{natsd.port}"
    eu_front = haproxy(tmp_path, [(f"eu-{x}", mesh.port(f"eu-{x}")) for x in "ab"], port=eu_port)
    away = mesh.scripted()
    for x in "ab":
        mesh.instance(f"us-{x}", "us", [home], url, peers=[("eu", f"http://127.0.0.1:{far_port}")],
                      mode="gorgo_distributed", **gorgo)
        mesh.instance(f"eu-{x}", "eu", [away], url, peers=[("us", mesh.url("us-a"))], mode="gorgo_distributed",
                      **gorgo)
    services(eu_front)
    link = mesh.gateways["us-b"].runtime.peering.links["eu"]
    assert mesh.wait_until(lambda: link.endpoint.healthy and link.endpoint.rtt_s > 0.05, timeout=8)
    assert post(mesh.url("us-b")).headers["x-kvroute-replica"] == "us-0"  # idle: home is cheaper
    # a long prompt in flight at home, sent through us-a: us-b sees it in its own cost
    held = threading.Thread(target=post, args=(mesh.url("us-a"), dict(CHAT, messages=[
        {"role": "user", "content": "HOLD " + "x" * 40_000}])), kwargs={"timeout": 15})
    held.start()
    us_b = mesh.gateways["us-b"].runtime
    assert mesh.wait_until(lambda: us_b.router.endpoint("us-0").inflight_tokens > 5000, timeout=5)
    r = post(mesh.url("us-b"))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
    assert mesh.forwards("us-b", "eu", "peer-cheaper") == 1
    assert mesh.wait_until(lambda: not us_b.peering.router.tickets and not mesh.gateways["us-a"]
                           .runtime.peering.router.tickets, 5)
    mesh.loop.call_soon_threadsafe(release.set)
    held.join(15)
