"""TLS on the gateway's listener and to https engines, with a self-signed certificate made here."""

import asyncio
import ssl
import subprocess

import httpx
import openai
import pytest

from kvroute.gateway.config import GatewayConfig
from kvroute.gateway.server import Gateway
from kvroute.replicas import ReplicaConfig
from tests.fake_upstream import FaultyDeployment, ScriptedUpstream, http_response, replies


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_gateway_serves_https(cert):
    cert_file, key_file = cert
    dep = FaultyDeployment([replies(http_response())], tls={"cert_file": str(cert_file), "key_file": str(key_file)})
    try:
        url = dep.url.replace("http://", "https://")
        trusting = httpx.Client(verify=ssl.create_default_context(cafile=str(cert_file)))
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=trusting)
        assert c.completions.create(model="m", prompt="secure").choices[0].text == "ok"
        with pytest.raises(httpx.ConnectError):  # an untrusted certificate is refused by the client
            httpx.get(f"{url}/health")
    finally:
        dep.settle()
        dep.close()


def test_gateway_reaches_https_engines(cert):
    cert_file, key_file = cert
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert_file, key_file)

    async def run():
        engine = ScriptedUpstream(replies(http_response()))
        engine._server = await asyncio.start_server(engine._serve, "127.0.0.1", 0, ssl=server_ctx)
        engine.port = engine._server.sockets[0].getsockname()[1]
        config = GatewayConfig(port=0, policy="round_robin", replicas=[ReplicaConfig(
            url=f"https://127.0.0.1:{engine.port}", id="secure", engine="vllm", ca_file=str(cert_file))])
        gw = Gateway(config)
        await gw.start()
        try:
            async with httpx.AsyncClient() as c:
                r = await c.post(f"http://127.0.0.1:{gw.port}/v1/completions", json={"prompt": "x"})
            return r.status_code, r.headers.get("x-kvroute-replica"), gw.runtime.upstreams["secure"].endpoint.healthy
        finally:
            await gw.stop()
            await engine.stop()
    assert asyncio.run(run()) == (200, "secure", True)


def test_unreadable_tls_files_are_a_config_error_naming_them(tmp_path):
    with pytest.raises(ValueError, match="cannot load cert_file /nope/cert.pem"):
        GatewayConfig(tls={"cert_file": "/nope/cert.pem", "key_file": "/nope/key.pem"})
