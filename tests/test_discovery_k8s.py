"""Kubernetes discovery: the gateway lists and watches a Service's EndpointSlices on an API server
stand-in that serves recorded responses over real HTTPS on 127.0.0.1 (bearer token + CA, as in a
pod), and routes real requests to emulated engines on the loopback addresses the slices name."""

import asyncio
import logging
import subprocess

import httpx
import pytest

from kvroute.discovery.config import KubernetesSource
from kvroute.discovery.kube import ready_endpoints
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from tests.conftest import until
from tests.k8s_api import FakeAPIServer, Step, engines_on, pods_json, recorded

IPS = {"IP_A": "127.0.0.2", "IP_B": "127.0.0.3", "IP_C": "127.0.0.4"}


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("k8s-tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


async def complete(gw: Gateway) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as c:
        return await c.post(f"http://127.0.0.1:{gw.port}/v1/completions",
                            json={"model": "emulated", "prompt": "hello there", "max_tokens": 4})


def test_endpointslice_watch_add_remove_gone_relist(cert, tmp_path, caplog):
    import ssl

    cert_file, key_file = cert
    token = tmp_path / "token"
    token.write_text("sa-token-123\n")
    caplog.set_level(logging.INFO, logger="kvroute")

    async def run():
        port, engines = await engines_on(list(IPS.values()))
        subs = {**IPS, "PORT": port}
        api = FakeAPIServer("sa-token-123", pods_json(**subs))
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert_file, key_file)
        await api.start(ctx)
        gates = [asyncio.Event() for _ in range(5)]
        api.lists = [Step(body=recorded("endpointslice-list.json", **subs)),
                     Step(body=recorded("endpointslice-relist.json", **subs)),
                     Step(body=recorded("endpointslice-empty.json", **subs)),
                     Step(body=recorded("endpointslice-relist.json", **subs))]
        api.watches = [Step(lines=recorded("watch-1.jsonl", **subs).splitlines(), gates=gates[0:2]),
                       Step(lines=recorded("watch-2.jsonl", **subs).splitlines(), gates=gates[2:4]),
                       Step(status=410, body=recorded("gone.json")),
                       Step(lines=['{"type": "MODIFIED", "object": ["not", "a", "slice"'], gates=gates[4:5])]
        config = GatewayConfig(port=0, policy="round_robin", probe={"interval_s": 0.05}, discovery=[{
            "kind": "kubernetes", "service": "vllm-engines", "namespace": "llm", "port": "http",
            "api_server": f"https://127.0.0.1:{api.port}", "token_file": str(token), "ca_file": str(cert_file),
            "retry_s": 0.2, "defaults": {"engine": "vllm"}}])
        gw = Gateway(config)
        await gw.start()
        rt = gw.runtime
        names = lambda: set(rt.upstreams)  # noqa: E731
        try:
            # the list: two ready pods, the third not ready
            await until(lambda: names() == {"vllm-0", "vllm-1"}, what="the listed pods")
            status = rt.discovery.status()["kubernetes[0]:vllm-engines"]
            got = {e["id"]: (e["role"], e["kv_events"], e["url"]) for e in status["engines"]}
            assert got == {"vllm-0": ("prefill", "tcp://127.0.0.2:5600", f"http://127.0.0.2:{port}"),
                           "vllm-1": ("decode", None, f"http://127.0.0.3:{port}")}
            r = await complete(gw)
            assert r.status_code == 200 and r.headers["x-kvroute-replica"] in {"vllm-0", "vllm-1"}
            # watch: the third pod turns ready, a bookmark moves the resourceVersion, the watch ends
            gates[0].set()
            await until(lambda: names() == {"vllm-0", "vllm-1", "vllm-2"}, what="vllm-2 added")
            gates[1].set()
            await until(lambda: sum(1 for _, q in api.requests if q.get("watch") == "true") >= 2, what="re-watch")
            watch = [q for _, q in api.requests if q.get("watch") == "true"]
            assert watch[0]["resourceVersion"] == "100" and watch[0]["allowWatchBookmarks"] == "true"
            assert watch[1]["resourceVersion"] == "105"  # resumed from the bookmark, not relisted
            # vllm-0 starts terminating (not ready); then the watch expires: 410 Gone → relist
            gates[2].set()
            await until(lambda: names() == {"vllm-1", "vllm-2"}, what="vllm-0 removed")
            assert rt.router.endpoint("vllm-0") is None
            gates[3].set()
            # relist (rv 200), a watch refused with 410, relist again: no ready endpoint at all
            await until(lambda: not names(), what="every engine gone")
            assert "has no ready endpoints" in caplog.text
            r = await complete(gw)
            assert r.status_code == 503, r.text
            # a malformed watch event: logged, relisted after retry_s, engines back
            gates[4].set()
            await until(lambda: names() == {"vllm-1", "vllm-2"}, what="relist after a malformed event")
            assert "malformed watch event" in caplog.text
            assert "410 Gone" in caplog.text or "Expired" in caplog.text
            lists = [q for _, q in api.requests if q.get("watch") != "true"]
            assert len(lists) == 4 and all(q["labelSelector"] == "kubernetes.io/service-name=vllm-engines"
                                           for q in lists)
            r = await complete(gw)
            assert r.status_code == 200 and r.headers["x-kvroute-replica"] in {"vllm-1", "vllm-2"}
            assert rt.upstreams["vllm-2"].endpoint.healthy
        finally:
            await gw.stop()
            await api.stop()
            for runner, _ in engines:
                await runner.cleanup()

    asyncio.run(run())


def test_wrong_token_is_reported_and_retried(cert, tmp_path, caplog):
    import ssl

    cert_file, key_file = cert
    token = tmp_path / "token"
    token.write_text("stale")

    async def run():
        api = FakeAPIServer("fresh")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert_file, key_file)
        await api.start(ctx)
        api.lists = [Step(body=recorded("endpointslice-relist.json", IP_B="127.0.0.3", IP_C="127.0.0.4",
                                        PORT=1))]
        config = GatewayConfig(port=0, discovery=[{
            "kind": "kubernetes", "service": "vllm-engines", "namespace": "llm", "role_label": None,
            "kv_events_annotation": None, "api_server": f"https://127.0.0.1:{api.port}",
            "token_file": str(token), "ca_file": str(cert_file), "retry_s": 0.1}])
        gw = Gateway(config)
        await gw.start()
        try:
            await until(lambda: len(api.requests) >= 2, what="a retry")
            assert not gw.runtime.upstreams
            status = gw.runtime.discovery.status()
            assert "401" in status["kubernetes[0]:vllm-engines"]["error"] and "RBAC" in caplog.text
            token.write_text("fresh")  # the kubelet rotated the token: re-read on the next call
            await until(lambda: set(gw.runtime.upstreams) == {"vllm-1", "vllm-2"}, what="listed")
        finally:
            await gw.stop()
            await api.stop()

    asyncio.run(run())


def test_ready_endpoints_ports_and_roles():
    src = KubernetesSource(kind="kubernetes", service="s", api_server="http://127.0.0.1:1", port=8000,
                           kv_events_port="kv-events")
    sl = {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {},  # unset ready: ready
                         "targetRef": {"kind": "Pod", "name": "p1"}},
                        {"addresses": ["fd00::2"], "conditions": {"ready": True}},
                        {"addresses": ["10.0.0.3"], "conditions": {"ready": False}},
                        {"addresses": [], "conditions": {"ready": True}}, "junk"],
          "ports": [{"name": "http", "port": 8000}, {"name": "kv-events", "port": 5557}]}
    other = {"endpoints": [{"addresses": ["10.0.0.9"]}], "ports": [{"name": "metrics", "port": 9090}]}
    got = ready_endpoints({"a": sl, "b": other}, src, {"p1": {"labels": {"llm-d.ai/role": "decode"}}})
    assert [(e.id, e.url, e.role, e.kv_events) for e in got] == [
        ("[fd00::2]:8000", "http://[fd00::2]:8000", "both", "tcp://[fd00::2]:5557"),
        ("p1", "http://10.0.0.1:8000", "decode", "tcp://10.0.0.1:5557")]


def test_kubernetes_source_outside_a_cluster_fails_at_load(tmp_path, monkeypatch):
    from kvroute import yamlconf
    from kvroute.gateway.config import load_config

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    p = tmp_path / "gw.yaml"
    p.write_text("discovery:\n  - kind: kubernetes\n    service: engines\n")
    with pytest.raises(yamlconf.ConfigFileError, match=r"gw.yaml:2: .*KUBERNETES_SERVICE_HOST unset"):
        load_config(str(p))


def test_roles_reach_replicas_only_in_a_pd_gateway(monkeypatch):
    from kvroute.discovery.model import Engine
    from kvroute.discovery.reconcile import Reconciler

    added = {}
    rec = Reconciler(lambda rc: added.__setitem__(rc.name, rc), added.pop, lambda n: n in added)
    engines = [Engine("p0", "http://10.0.0.1:8000", "prefill", "tcp://10.0.0.1:5557", {"bootstrap_port": 8998}),
               Engine("d0", "http://10.0.0.2:8000", "decode")]
    rec.apply("k", engines, {"engine": "sglang"})
    assert {n: rc.role for n, rc in added.items()} == {"p0": "mixed", "d0": "mixed"}  # no pd: whole requests
    rec.forget("k")
    assert not added
    rec.roles = True
    rec.apply("k", engines, {"engine": "sglang", "kv_events": {"topic": "kv"}})
    assert {n: (rc.role, rc.bootstrap_port, rc.engine) for n, rc in added.items()} == {
        "p0": ("prefill", 8998, "sglang"), "d0": ("decode", None, "sglang")}
    # the pod's own publisher, the source's topic: the gateway's KV-event consumer subscribes to it
    assert (added["p0"].kv_events.endpoint, added["p0"].kv_events.topic) == ("tcp://10.0.0.1:5557", "kv")
    assert added["d0"].kv_events is None  # publishes nothing: the approximate index
    assert rec.status()["k"]["engines"][0]["kv_events"] == "tcp://10.0.0.1:5557"
    # a pod that changes role is a new replica (removed, added again)
    assert rec.apply("k", [Engine("p0", "http://10.0.0.1:8000", "decode"), engines[1]], {}) == ["-p0", "+p0"]
    assert added["p0"].role == "decode"


def test_pd_gateway_may_take_all_its_engines_from_discovery(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    cfg = GatewayConfig(pd={"protocol": "sglang"}, discovery=[
        {"kind": "kubernetes", "service": "sglang", "port": "http"}])
    assert cfg.pd is not None and not cfg.replicas


def test_bootstrap_port_from_the_pod_annotation():
    src = KubernetesSource(kind="kubernetes", service="s", api_server="http://127.0.0.1:1")
    sl = {"endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "p"}}],
          "ports": [{"port": 30000}]}
    pods = {"p": {"labels": {"llm-d.ai/role": "prefill"}, "annotations": {"sglang.ai/bootstrap-port": "8999"}}}
    (e,) = ready_endpoints({"a": sl}, src, pods)
    assert (e.role, e.fields, e.url) == ("prefill", {"bootstrap_port": 8999}, "http://10.0.0.1:30000")


def test_slices_of_impossible_shapes_are_skipped_not_fatal():
    """A watch event that parses as JSON but holds a slice no API server would send (wrong types)
    yields no engine from the broken parts and never raises."""
    src = KubernetesSource(kind="kubernetes", service="s", api_server="http://127.0.0.1:1")
    junk = {"a": {"endpoints": {"not": "a list"}, "ports": [{"port": 80}]},
            "b": {"endpoints": [{"addresses": "10.0.0.1", "conditions": []}], "ports": "eighty"},
            "c": {"endpoints": [{"addresses": ["10.0.0.2"], "conditions": "ready", "targetRef": ["Pod"]},
                                {"addresses": [7], "conditions": {}}], "ports": [{"port": 80}, "junk"]}}
    got = ready_endpoints(junk, src, {"x": {"labels": None}})
    assert [(e.id, e.url) for e in got] == [("10.0.0.2:80", "http://10.0.0.2:80")]
