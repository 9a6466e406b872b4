"""Gateways as peers over real HTTP on 127.0.0.1: forwarding only under the stated conditions and
never twice, byte-identical forwarded streams, refused unauthenticated forwards, residency, peer
ejection and re-admission, cancellation through the chain, GORGO distributed and proxy modes."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from kvroute.emulator.server import Faults, start_emulator
from kvroute.gateway.config import GatewayConfig, PeerConfig
from kvroute.gateway.peers import FORWARDED_HEADER, STATUS_PATH, TOKEN_HEADER
from kvroute.gateway.server import Gateway
from kvroute.live.delay import DelayProxy
from kvroute.ports import hold_port
from kvroute.replicas import ReplicaConfig
from tests.fake_upstream import METRICS, SSE_HEAD, ScriptedUpstream, chunk, replies

TOKEN = "peer-secret-1"
BUSY = b"vllm:num_requests_running 4\nvllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.9\n"
# an SSE answer cut into uneven pieces: a forward must hand on exactly these bytes
STREAM_BODY = [b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"he"}}]}\n\n',
               b'data: {"id":"x","choices":[{"index":0,"del', b'ta":{"content":"llo"}}]}\n\ndata: [DO',
               b"NE]\n\n"]
STREAM = SSE_HEAD + b"".join(chunk(c) for c in STREAM_BODY) + b"0\r\n\r\n"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


class Mesh:
    """Regional gateways, each over its own scripted or emulated engines, on one background loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.gateways: dict[str, Gateway] = {}
        self.ports: dict[str, int] = {}
        self.held: list = []  # the ports named so far, held bound until close (kvroute.ports.hold_port)
        self.upstreams: list[ScriptedUpstream] = []
        self.runners: list = []
        self.servers: list[DelayProxy] = []

    def call(self, coro, timeout: float = 20):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def port(self, region: str) -> int:
        """The port of ``region``'s gateway (or any named server), picked on first use and held until
        :meth:`close`: a peer names it long before that gateway binds it, and under concurrent suites another
        process's connection took such a port meanwhile ("address in use")."""
        if region not in self.ports:
            held = hold_port()
            self.held.append(held)
            self.ports[region] = held.getsockname()[1]
        return self.ports[region]

    def url(self, region: str) -> str:
        return f"http://127.0.0.1:{self.port(region)}"

    def scripted(self, script=None, metrics: bytes = METRICS) -> str:
        up = ScriptedUpstream(script or replies(STREAM))
        up.metrics = metrics
        self.call(up.start())
        self.upstreams.append(up)
        return f"http://127.0.0.1:{up.port}"

    def emulated(self, profile: str = "l4-llama3.1-8b"):
        runner, emu, port = self.call(start_emulator("127.0.0.1", 0, profile, "vllm", Faults()))
        self.runners.append(runner)
        return emu, f"http://127.0.0.1:{port}"

    def gateway(self, region: str, replicas: list[str], peers: list[str] = (), mode: str = "skywalker",
                zone: str | None = None, peer_zone: str | None = None, peer_urls: dict[str, str] | None = None,
                **overrides) -> Gateway:
        settings = {"policy": {"preset": "skywalker", "params": {"admission": "pending"}},
                    "probe": {"interval_s": 0.05, "timeout_s": 0.5}, "queue": {"max_wait_s": 3.0},
                    "timeouts": {"connect_s": 1.0, "first_byte_s": 3.0, "idle_s": 3.0, "non_stream_s": 3.0,
                                 "non_stream_total_s": 3.0},
                    "retry": {"backoff_s": 0.0}, **overrides}
        config = GatewayConfig(
            host="127.0.0.1", port=self.port(region), region=region, zone=zone, routing_mode=mode,
            replicas=[ReplicaConfig(url=u, id=f"{region}-{i}", region=region, zone=zone, engine="vllm")
                      for i, u in enumerate(replicas)],
            peers=[PeerConfig(name=p, url=(peer_urls or {}).get(p, self.url(p)), region=p, zone=peer_zone)
                   for p in peers],
            peer_auth={"token_env": "KVROUTE_TEST_PEER_TOKEN"}, **settings)
        gw = self.gateways[region] = Gateway(config)
        self.call(gw.start())
        return gw

    def wait_until(self, cond, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.call(_read(cond)):
                return True
            time.sleep(0.02)
        return False

    def forwards(self, region: str, peer: str, reason: str) -> float:
        value = self.gateways[region].runtime.metrics.registry.get_sample_value(
            "kvroute_peer_forwards_total", {"peer": peer, "reason": reason})
        return value or 0.0

    def close(self) -> None:
        async def stop():
            for server in self.servers:
                await server.stop()
            for gw in self.gateways.values():
                await gw.stop()
            for runner in self.runners:
                await runner.cleanup()
            for up in self.upstreams:
                await up.stop()  # also cancels what still runs on the loop (hung scripts, proxy pipes)
            await asyncio.sleep(0.01)
        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for held in self.held:
            held.close()


async def _read(fn):
    return fn()


@pytest.fixture
def mesh(monkeypatch):
    monkeypatch.setenv("KVROUTE_TEST_PEER_TOKEN", TOKEN)
    m = Mesh()
    yield m
    m.close()


def post(url: str, body=None, headers=None, timeout: float = 8.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body or dict(CHAT, stream=True), headers=headers,
                      timeout=timeout)


def peer_ready(mesh: Mesh, region: str, peer: str, available: bool = True):
    """Wait until ``region`` has probed ``peer`` (and sees it with or without an available replica)."""
    ep = mesh.gateways[region].runtime.peering.links[peer].endpoint
    assert mesh.wait_until(lambda: ep.healthy and ep.rtt_s > 0 and (ep.peer_available > 0) == available)


def test_forwards_only_when_no_local_replica_admits(mesh):
    us_url = mesh.scripted()
    eu_url = mesh.scripted()
    mesh.gateway("us", [us_url], ["eu"])
    mesh.gateway("eu", [eu_url], ["us"])
    peer_ready(mesh, "us", "eu")
    # a local replica admits: served at home although the peer is free
    r = post(mesh.url("us"))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "us-0"
    assert mesh.forwards("us", "eu", "no-local-replica") == 0
    # the local replica reports waiting requests: no local replica admits, so the peer takes it
    mesh.upstreams[0].metrics = BUSY
    assert mesh.wait_until(lambda: mesh.gateways["us"].runtime.router.endpoint("us-0").waiting == 3)
    r = post(mesh.url("us"))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
    assert mesh.forwards("us", "eu", "no-local-replica") == 1
    head = mesh.upstreams[1].heads[-1].lower()
    assert b"x-kvroute-forwarded" not in head and TOKEN.encode() not in head  # peer headers stop at the peer


def test_auto_forwards_only_what_its_region_cannot_admit_while_a_peer_would_take_it(mesh):
    mesh.gateway("us", [mesh.scripted(metrics=BUSY)], ["eu"], policy="auto")
    mesh.gateway("eu", [mesh.scripted()], ["us"], policy="auto")
    peer_ready(mesh, "us", "eu")
    assert mesh.wait_until(lambda: mesh.gateways["us"].runtime.router.endpoint("us-0").waiting == 3)
    r = post(mesh.url("us"))  # no local replica admits, the peer would: forwarded at once
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
    assert mesh.forwards("us", "eu", "no-local-replica") == 1
    mesh.upstreams[1].metrics = BUSY
    peer_ready(mesh, "us", "eu", available=False)
    r = post(mesh.url("us"))  # nobody admits it: auto does not hold it, the local replica serves it
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "us-0"
    assert mesh.forwards("us", "eu", "no-local-replica") == 1


def test_forwarded_request_is_never_forwarded_again(mesh):
    mesh.gateway("us", [mesh.scripted()], ["eu"])
    mesh.gateway("eu", [mesh.scripted(metrics=BUSY)], ["us"], queue={"max_wait_s": 0.5})
    peer_ready(mesh, "eu", "us")
    # a client's request at eu (no local replica admits) goes to us ...
    r = post(mesh.url("eu"))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "us-0"
    # ... but one forwarded to eu waits for eu's own replicas, and times out there
    r = post(mesh.url("eu"), headers={FORWARDED_HEADER: "asia", TOKEN_HEADER: TOKEN})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
    assert mesh.forwards("eu", "us", "no-local-replica") == 1
    assert len(mesh.upstreams[0].heads) == 1


def test_peer_without_available_replica_is_not_chosen_until_it_has_one(mesh):
    mesh.gateway("us", [mesh.scripted(metrics=BUSY)], ["eu"], queue={"max_wait_s": 5.0})
    mesh.gateway("eu", [mesh.scripted(metrics=BUSY)], ["us"])
    peer_ready(mesh, "us", "eu", available=False)
    result: dict = {}
    client = threading.Thread(target=lambda: result.setdefault("r", post(mesh.url("us"))))
    client.start()
    assert mesh.wait_until(lambda: len(mesh.gateways["us"].runtime.queue) == 1)
    time.sleep(0.3)  # several probe rounds: still held, the peer has no available replica
    assert mesh.forwards("us", "eu", "no-local-replica") == 0
    mesh.upstreams[1].metrics = METRICS  # eu's replica frees up: the held request goes there
    client.join(5)
    assert result["r"].status_code == 200 and result["r"].headers["x-kvroute-replica"] == "eu-0"
    assert mesh.forwards("us", "eu", "no-local-replica") == 1


def test_forwarded_stream_is_byte_identical(mesh):
    mesh.gateway("us", [mesh.scripted(metrics=BUSY)], ["eu"])
    mesh.gateway("eu", [mesh.scripted()], ["us"])
    peer_ready(mesh, "us", "eu")
    local = post(mesh.url("eu"))
    forwarded = post(mesh.url("us"))
    assert forwarded.headers["x-kvroute-replica"] == "eu-0" and mesh.forwards("us", "eu", "no-local-replica") == 1
    assert local.content == forwarded.content == b"".join(STREAM_BODY)
    assert local.headers["content-type"] == forwarded.headers["content-type"]
    whole = post(mesh.url("us"), dict(CHAT, stream=False))  # a non-streamed answer passes through too
    assert whole.content == b"".join(STREAM_BODY) and whole.headers["x-kvroute-replica"] == "eu-0"
    metrics = httpx.get(mesh.url("us") + "/metrics").text
    assert 'kvroute_peer_forwards_total{peer="eu",reason="no-local-replica"} 2.0' in metrics
    assert 'kvroute_peer_up{peer="eu"} 1.0' in metrics and 'kvroute_peer_rtt_seconds{peer="eu"}' in metrics


def test_unauthenticated_forward_is_refused(mesh):
    mesh.gateway("eu", [mesh.scripted()], mode="local")  # it only receives
    for headers in ({FORWARDED_HEADER: "us"}, {FORWARDED_HEADER: "us", TOKEN_HEADER: "wrong"},
                    {FORWARDED_HEADER: "us", TOKEN_HEADER: TOKEN[:-1]}):
        r = post(mesh.url("eu"), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_peer_token"
    assert mesh.upstreams[0].requests == 0  # never dispatched
    assert httpx.get(mesh.url("eu") + STATUS_PATH).status_code == 401
    status = httpx.get(mesh.url("eu") + STATUS_PATH, headers={TOKEN_HEADER: TOKEN}).json()
    assert status["region"] == "eu" and status["available"] == 1 and status["queue"] == 0
    assert status["gorgo_base_cost"] is not None
    ok = post(mesh.url("eu"), headers={FORWARDED_HEADER: "us", TOKEN_HEADER: TOKEN})
    assert ok.status_code == 200 and mesh.upstreams[0].requests == 1


def test_residency_pin_is_never_forwarded(mesh):
    mesh.gateway("us", [mesh.scripted(metrics=BUSY)], ["eu"], queue={"max_wait_s": 0.5})
    mesh.gateway("eu", [mesh.scripted()], ["us"])
    peer_ready(mesh, "us", "eu")
    pinned = post(mesh.url("us"), headers={"x-kvroute-residency": "us"})
    assert pinned.status_code == 503  # held at home until the queue gives up, never sent to eu
    elsewhere = post(mesh.url("us"), headers={"x-kvroute-residency": "asia"})
    assert elsewhere.status_code == 503 and "residency" in elsewhere.json()["error"]["message"]
    free = post(mesh.url("us"))
    assert free.status_code == 200 and free.headers["x-kvroute-replica"] == "eu-0"
    assert mesh.upstreams[0].requests == 0 and mesh.upstreams[1].requests == 1
    assert mesh.forwards("us", "eu", "no-local-replica") == 1


def test_residency_pin_travels_with_the_forward(mesh):
    mesh.gateway("us", [mesh.scripted(metrics=BUSY)], ["eu"], zone="west", peer_zone="west")
    mesh.gateway("eu", [mesh.scripted()], ["us"], zone="west", peer_zone="west")  # another region in the same zone
    peer_ready(mesh, "us", "eu")
    r = post(mesh.url("us"), headers={"x-kvroute-residency": "west"})
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
    head = mesh.upstreams[1].heads[-1].lower()
    assert b"x-kvroute-residency" not in head  # the pin reached eu's gateway, not its engine


def test_routing_headers_stop_at_the_gateway(mesh):
    """x-kvroute-residency and x-kvroute-region are the gateway's; the engine never sees them."""
    mesh.gateway("us", [mesh.scripted()], [], mode="local", zone="west")
    r = post(mesh.url("us"), headers={"x-kvroute-residency": "west", "x-kvroute-region": "us"})
    assert r.status_code == 200
    head = mesh.upstreams[0].heads[-1].lower()
    assert b"x-kvroute-residency" not in head and b"x-kvroute-region" not in head


def test_a_forward_carries_the_pin_and_the_region_to_the_peer(mesh):
    gw = mesh.gateway("us", [mesh.scripted()], ["eu"])
    from kvroute.model import Request

    req = Request(id="r", region="asia", residency="eu")
    out = dict(gw.runtime.peering.outbound([("content-type", "application/json")], req, {}))
    assert out["x-kvroute-residency"] == "eu" and out["x-kvroute-region"] == "asia"


def test_a_forward_teaches_the_token_ratio_nothing_at_home(mesh):
    """The peer's answer carries its replica's prompt count; it is not one of ours to learn."""
    _, eu_url = mesh.emulated()
    busy = mesh.scripted(metrics=BUSY)
    mesh.upstreams[-1].models = ["emulated"]
    mesh.gateway("us", [busy], ["eu"])
    mesh.gateway("eu", [eu_url], ["us"])
    peer_ready(mesh, "us", "eu")
    long_chat = {"model": "emulated", "messages": [{"role": "user", "content": "tell me about the outage " * 20}],
                 "max_tokens": 2, "stream": False}
    r = post(mesh.url("us"), long_chat)
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
    assert r.json()["usage"]["prompt_tokens"] > 0
    assert set(mesh.gateways["eu"].runtime.tokens.ratios) == {"eu-0"}  # the peer's own replica learns
    assert mesh.gateways["us"].runtime.tokens.ratios == {}


def test_key_pinned_to_a_zone(mesh, monkeypatch):
    monkeypatch.setenv("KVROUTE_TEST_KEY", "sk-pinned")
    keys = {"keys": [{"name": "pinned", "env": "KVROUTE_TEST_KEY", "zone": "us"}]}
    mesh.gateway("us", [mesh.scripted(metrics=BUSY)], ["eu"], queue={"max_wait_s": 0.5}, auth=keys)
    mesh.gateway("eu", [mesh.scripted()], ["us"])
    peer_ready(mesh, "us", "eu")
    auth = {"authorization": "Bearer sk-pinned"}
    assert post(mesh.url("us"), headers=auth).status_code == 503  # the key's pin keeps it home
    conflict = post(mesh.url("us"), headers={**auth, "x-kvroute-residency": "eu"})
    assert conflict.status_code == 403 and conflict.json()["error"]["code"] == "residency_conflict"
    assert mesh.upstreams[1].requests == 0 and mesh.forwards("us", "eu", "no-local-replica") == 0


def test_peer_ejected_and_readmitted(mesh):
    mesh.gateway("us", [mesh.scripted()], ["eu"])
    eu_replica = mesh.scripted()
    mesh.gateway("eu", [eu_replica], ["us"])
    peer_ready(mesh, "us", "eu")
    link = mesh.gateways["us"].runtime.peering.links["eu"]
    mesh.call(mesh.gateways.pop("eu").stop())
    assert mesh.wait_until(lambda: not link.endpoint.healthy)
    up = mesh.gateways["us"].runtime.metrics.registry.get_sample_value("kvroute_peer_up", {"peer": "eu"})
    assert up == 0
    mesh.gateway("eu", [eu_replica], ["us"])
    assert mesh.wait_until(lambda: link.endpoint.healthy)
    assert link.streak.oks >= 2


def test_client_disconnect_cancels_at_the_peers_engine(mesh):
    emu, emu_url = mesh.emulated()
    busy = mesh.scripted(metrics=BUSY)
    mesh.upstreams[-1].models = ["emulated"]
    mesh.gateway("us", [busy], ["eu"])
    mesh.gateway("eu", [emu_url], ["us"])
    peer_ready(mesh, "us", "eu")
    body = dict(CHAT, model="emulated", stream=True, max_tokens=4000)
    with httpx.Client(timeout=8.0) as client, client.stream(
            "POST", f"{mesh.url('us')}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
        chunks = r.iter_raw()  # kept: a dropped iterator may close the response early
        next(chunks)
        assert mesh.wait_until(lambda: len(emu.streams) == 1)
        time.sleep(0.2)
        assert len(emu.streams) == 1  # still generating while the client reads
    # the client left long before 4,000 tokens: the engine at the end of the chain stops too
    assert mesh.wait_until(lambda: not emu.streams and emu.engine.running == 0)
    assert mesh.wait_until(lambda: not mesh.gateways["us"].runtime.peering.router.tickets)


def hanging_until(release: asyncio.Event):
    """A script that answers only once ``release`` is set (keeps a request in flight)."""
    async def script(head, body, w) -> bool:
        if b"HOLD" in body:
            await release.wait()
        w.write(STREAM)
        await w.drain()
        return True
    return script


def gated(gate: dict):
    """A script that holds a request whose body says HOLD until ``gate["open"]`` (an Event the test may
    swap between phases) is set."""
    async def script(head, body, w) -> bool:
        if b"HOLD" in body:
            await gate["open"].wait()
        w.write(STREAM)
        await w.drain()
        return True
    return script


def test_gorgo_distributed_forwards_only_what_the_region_cannot_admit(mesh):
    """GORGO v1 §3.3: local first; only a request the local region "cannot immediately admit" (held by
    §7's per-instance cap) goes to a peer, and only to a cheaper one; otherwise it waits at home."""
    gate = {"open": mesh.call(_make_event())}
    gorgo = {"policy": {"preset": "gorgo", "params": {"admission": "outstanding", "max_outstanding": 2}}}
    server, far_port = mesh.call(_delay_proxy(mesh.port("eu"), 0.03))  # eu is 60+ ms away: loopback jitter
    mesh.servers.append(server)  # cannot make it look cheaper than home
    us = mesh.gateway("us", [mesh.scripted(gated(gate))], ["eu"], mode="gorgo_distributed",
                      peer_urls={"eu": f"http://127.0.0.1:{far_port}"}, **gorgo)
    mesh.gateway("eu", [mesh.scripted()], ["us"], mode="gorgo_distributed", **gorgo)
    peer_ready(mesh, "us", "eu")
    assert us.runtime.peering.links["eu"].endpoint.rtt_s > 0.05
    home = us.runtime.router.endpoint("us-0")
    assert post(mesh.url("us")).headers["x-kvroute-replica"] == "us-0"  # both idle: home

    def hold(content: str) -> threading.Thread:
        t = threading.Thread(target=post, args=(mesh.url("us"), dict(CHAT, messages=[
            {"role": "user", "content": content}])))
        t.start()
        return t

    # the cap is full with two short requests: the held one is not cheaper abroad (60 ms RTT vs a few
    # queued tokens), so it waits at home and is served there once a slot frees
    held = [hold("HOLD a"), hold("HOLD b")]
    assert mesh.wait_until(lambda: home.inflight == 2)
    served: list[str] = []
    waiting = threading.Thread(target=lambda: served.append(post(mesh.url("us")).headers["x-kvroute-replica"]))
    waiting.start()
    assert mesh.wait_until(lambda: len(us.runtime.held_requests()) == 1)
    time.sleep(0.3)  # several peer probes: still held, not forwarded
    assert len(us.runtime.held_requests()) == 1 and mesh.forwards("us", "eu", "peer-cheaper") == 0
    mesh.loop.call_soon_threadsafe(gate["open"].set)
    waiting.join(5)
    for t in held:
        t.join(5)
    assert served == ["us-0"] and mesh.forwards("us", "eu", "peer-cheaper") == 0
    assert mesh.wait_until(lambda: home.inflight == 0)

    # a long prompt in flight at home makes the peer cheaper by GORGO's cost, but a local slot is
    # free: served at home all the same (the local region admits it)
    gate["open"] = mesh.call(_make_event())
    held = [hold("HOLD " + "x" * 40_000)]
    assert mesh.wait_until(lambda: home.inflight_tokens > 5000)
    r = post(mesh.url("us"))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "us-0"
    assert mesh.forwards("us", "eu", "peer-cheaper") == 0
    # now the cap is full too: the region cannot admit it, and the cheaper peer takes it
    held.append(hold("HOLD c"))
    assert mesh.wait_until(lambda: home.inflight == 2)
    r = post(mesh.url("us"))
    assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "eu-0"
    assert mesh.forwards("us", "eu", "peer-cheaper") == 1
    assert mesh.forwards("eu", "us", "peer-cheaper") == 0  # at eu, one hop: served there
    mesh.loop.call_soon_threadsafe(gate["open"].set)
    for t in held:
        t.join(5)


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


async def _delay_proxy(target_port: int, delay_s: float) -> tuple[DelayProxy, int]:
    """kvroute live's delay proxy in front of ``target_port``: ``delay_s`` each way (a far region)."""
    proxy = DelayProxy(one_way_s=delay_s, target=("127.0.0.1", target_port), name="far")
    return proxy, await proxy.start()


def test_gorgo_proxy_routes_with_measured_rtt(mesh):
    near = mesh.scripted()
    far = ScriptedUpstream(replies(STREAM))
    mesh.call(far.start())
    mesh.upstreams.append(far)
    server, far_port = mesh.call(_delay_proxy(far.port, 0.03))
    try:
        config = GatewayConfig(host="127.0.0.1", port=0, region="us", routing_mode="gorgo_proxy", policy="gorgo",
                               probe={"interval_s": 0.05},
                               replicas=[ReplicaConfig(url=near, id="near", region="us", engine="vllm"),
                                         ReplicaConfig(url=f"http://127.0.0.1:{far_port}", id="far", region="asia",
                                                       engine="vllm")])
        gw = mesh.gateways["proxy"] = Gateway(config)
        mesh.call(gw.start())
        far_ep = gw.runtime.router.endpoint("far")
        assert mesh.wait_until(lambda: far_ep.rtt_s > 0.05)  # two delayed legs per probe
        url = f"http://127.0.0.1:{gw.port}"
        served = [post(url).headers["x-kvroute-replica"] for _ in range(5)]
        assert served == ["near"] * 5
        assert gw.runtime.router.endpoint("near").rtt_s < far_ep.rtt_s
    finally:
        mesh.call(server.stop())


def test_peer_config_errors_name_the_field(tmp_path, monkeypatch):
    from kvroute.gateway.config import load_config
    from kvroute.yamlconf import ConfigFileError

    monkeypatch.delenv("KVROUTE_NO_SUCH_TOKEN", raising=False)
    cases = {
        "peer_auth:\n  token_env: KVROUTE_NO_SUCH_TOKEN\n": "KVROUTE_NO_SUCH_TOKEN is unset",
        "routing_mode: skywalker\n": "list them under peers",
        "routing_mode: skywalker\npeers:\n  - {name: eu, url: 'http://127.0.0.1:1', region: eu}\n": "needs peer_auth",
        "routing_mode: nearest\n": "routing_mode",
        "peers:\n  - {name: eu, url: 'http://127.0.0.1:1', region: eu}\n": "peers need peer_auth",
        "peers:\n  - {name: eu, url: 'ftp://x', region: eu}\n": "url must be",
    }
    for text, expected in cases.items():
        path = tmp_path / "gw.yaml"
        path.write_text("region: us\n" + text)
        with pytest.raises(ConfigFileError) as err:
            load_config(str(path))
        assert expected in str(err.value) and "gw.yaml" in str(err.value)
        assert ": : " not in str(err.value) and "{'region'" not in str(err.value)  # no empty field, no echo


def test_forward_path_hops_and_no_way_back(mesh):
    gw = mesh.gateway("us", [mesh.scripted()], ["eu", "asia"], mode="gorgo_distributed", max_hops=2,
                      policy="gorgo")
    peering = gw.runtime.peering
    from kvroute.model import Request

    req = Request(id="r1", prompt_tokens=64, block_hashes=(1,))
    inbound = {FORWARDED_HEADER: "eu", TOKEN_HEADER: TOKEN}
    peering.accept(req, inbound, None)
    assert (req.hops, req.from_peer, req.exclude) == (1, True, ("eu",))  # never back to eu
    out = dict(peering.outbound([("content-type", "application/json"), (TOKEN_HEADER, "stale")], req, inbound))
    assert out[FORWARDED_HEADER] == "eu,us" and out[TOKEN_HEADER] == TOKEN
    req.hops = 2
    assert peering.on_hold(req, 0) is None  # max_hops reached: waits here


def test_reload_rebuilds_the_peer_table(mesh):
    gw = mesh.gateway("us", [mesh.scripted()], ["eu"])
    mesh.gateway("asia", [mesh.scripted()], ["us"])
    new = gw.config.model_copy(update={"peers": [PeerConfig(name="asia", url=mesh.url("asia"), region="asia")]})
    assert "peers" in mesh.call(_read(lambda: gw.runtime.reconfigure(new)))
    assert list(gw.runtime.peering.links) == ["asia"]
    peer_ready(mesh, "us", "asia")
    assert "peers" not in mesh.call(_read(lambda: gw.runtime.reconfigure(new)))
