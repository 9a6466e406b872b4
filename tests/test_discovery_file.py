"""File discovery: a mounted ConfigMap's engine list (the kubelet's atomic ..data symlink swap),
re-read on change; a broken edit is logged with file:line and the last good list stays."""

import asyncio
import logging
import os

import httpx

from kvroute.emulator.server import Faults, start_emulator
from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from tests.conftest import until


def swap(mount, text: str, version: int) -> None:
    """Update a ConfigMap volume as the kubelet does: a new timestamped dir, then rename ..data."""
    d = mount / f"..v{version}"
    d.mkdir()
    (d / "engines.yaml").write_text(text)
    tmp = mount / "..data_tmp"
    tmp.symlink_to(d.name)
    os.replace(tmp, mount / "..data")
    if not (mount / "engines.yaml").is_symlink():
        (mount / "engines.yaml").symlink_to("..data/engines.yaml")


def test_configmap_file_re_read(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvroute")
    mount = tmp_path / "cm"
    mount.mkdir()

    async def run():
        emus = [await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", "vllm", Faults()) for _ in range(2)]
        urls = [f"http://127.0.0.1:{p}" for _, _, p in emus]
        swap(mount, f"replicas:\n  - {{url: {urls[0]}, id: a, engine: vllm}}\n", 1)
        gw = Gateway(GatewayConfig(port=0, policy="round_robin", discovery=[{
            "kind": "file", "path": str(mount / "engines.yaml"), "interval_s": 0.05,
            "defaults": {"region": "eu"}}]))
        await gw.start()
        rt = gw.runtime
        try:
            assert set(rt.upstreams) == {"a"} and rt.upstreams["a"].config.region == "eu"
            swap(mount, f"replicas:\n  - {{url: {urls[0]}, id: a, engine: vllm}}\n"
                        f"  - {{url: {urls[1]}, id: b, engine: vllm, region: us}}\n", 2)
            await until(lambda: set(rt.upstreams) == {"a", "b"}, what="b added")
            assert rt.upstreams["b"].config.region == "us"  # the file's own field beats the default
            swap(mount, "replicas:\n  - {url: http://127.0.0.1:1, id: c, engin: vllm}\n", 3)
            await until(lambda: "keeping the last good list" in caplog.text, what="the bad edit logged")
            assert "engines.yaml:2: unknown key 'replicas.0.engin'" in caplog.text
            assert set(rt.upstreams) == {"a", "b"}
            swap(mount, f"replicas:\n  - {{url: {urls[1]}, id: b, engine: vllm, region: us}}\n", 4)
            await until(lambda: set(rt.upstreams) == {"b"}, what="a removed")
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(f"http://127.0.0.1:{gw.port}/v1/completions",
                                 json={"model": "emulated", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "b"
        finally:
            await gw.stop()
            for runner, _, _ in emus:
                await runner.cleanup()

    asyncio.run(run())


def test_discovered_id_clashing_with_a_static_replica_is_skipped(tmp_path, caplog):
    f = tmp_path / "engines.yaml"
    f.write_text("replicas:\n  - {url: http://127.0.0.1:2, id: static}\n  - {url: http://127.0.0.1:3, id: new}\n")

    async def run():
        gw = Gateway(GatewayConfig(port=0, replicas=[{"url": "http://127.0.0.1:1", "id": "static"}],
                                   discovery=[{"kind": "file", "path": str(f)}]))
        await gw.start()
        try:
            return set(gw.runtime.upstreams), gw.runtime.upstreams["static"].config.url
        finally:
            await gw.stop()

    assert asyncio.run(run()) == ({"static", "new"}, "http://127.0.0.1:1")
    assert "engine static (http://127.0.0.1:2) skipped: a replica with that id exists already" in caplog.text


def test_reload_restarts_discovery_and_admin_shows_it(tmp_path):
    import hashlib

    from kvroute.gateway.config import load_config

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("replicas:\n  - {url: http://127.0.0.1:1, id: from-a}\n")
    b.write_text("replicas:\n  - {url: http://127.0.0.1:2, id: from-b}\n")
    digest = hashlib.sha256(b"admin-key").hexdigest()
    cfg = tmp_path / "gateway.yaml"
    body = ("port: 0\nauth: {keys: [{name: ops, sha256: %s, admin: true}]}\n"
            "replicas: [{url: 'http://127.0.0.1:3', id: static}]\n"
            "discovery: [{kind: file, path: '%s', interval_s: 0.05}]\n")
    cfg.write_text(body % (digest, a))

    async def run():
        gw = Gateway(load_config(str(cfg)), str(cfg))
        await gw.start()
        try:
            assert set(gw.runtime.upstreams) == {"static", "from-a"}
            cfg.write_text(body % (digest, b))
            assert "discovery (restarted)" in gw.reload()
            await until(lambda: set(gw.runtime.upstreams) == {"static", "from-b"}, what="the new source")
            async with httpx.AsyncClient() as c:
                r = await c.get(f"http://127.0.0.1:{gw.port}/admin/discovery",
                                headers={"authorization": "Bearer admin-key"})
            return r.status_code, r.json()
        finally:
            await gw.stop()

    status, view = asyncio.run(run())
    assert status == 200
    (source,) = view.values()
    assert source["synced"] and source["error"] is None
    assert source["engines"] == [{"id": "from-b", "url": "http://127.0.0.1:2", "role": "both", "kv_events": None}]
