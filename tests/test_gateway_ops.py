"""Operating the gateway: liveness and readiness through a drain, request ids end to end."""

import asyncio
import time

import httpx
import openai

from tests.fake_upstream import FaultyDeployment, http_response, replies


def test_readiness_goes_false_before_the_drain_while_requests_are_still_served():
    dep = FaultyDeployment([replies(http_response())], drain_delay_s=1.0)
    try:
        assert httpx.get(f"{dep.url}/livez").status_code == 200
        assert httpx.get(f"{dep.url}/readyz").status_code == 200
        draining = asyncio.run_coroutine_threadsafe(dep.gateway.drain(), dep.loop)
        time.sleep(0.3)
        assert httpx.get(f"{dep.url}/readyz").status_code == 503  # the front LB stops sending
        assert httpx.get(f"{dep.url}/livez").status_code == 200
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "late", "max_tokens": 1})
        assert r.status_code == 200  # but what still arrives is served
        draining.result(10)
    finally:
        dep.close()


def test_the_clients_request_id_is_echoed_and_forwarded():
    dep = FaultyDeployment([replies(http_response(extra=b"X-Request-Id: engine-side\r\n"))])
    try:
        c = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0)
        raw = c.completions.with_raw_response.create(model="m", prompt="id", max_tokens=1,
                                                      extra_headers={"X-Request-Id": "client-abc-123"})
        assert raw.headers.get_list("x-request-id") == ["client-abc-123"]
        assert b"x-request-id: client-abc-123" in dep.upstreams[0].heads[-1].lower()
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "id", "max_tokens": 1})
        assert len(r.headers.get_list("x-request-id")) == 1 and r.headers["x-request-id"] != "engine-side"
    finally:
        dep.settle()
        dep.close()


def test_sighup_applies_every_reloadable_setting_and_refuses_the_listening_address(tmp_path, caplog):
    dep = FaultyDeployment([replies(http_response())])
    try:
        gw = dep.gateway
        up_url = gw.config.replicas[0].url
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(f"port: 1\nmax_body_bytes: 100\nsession_headers: [x-tenant]\nblock_tokens: 32\n"
                       f"breaker: {{failures: 9, cooldown_s: 1, successes: 3}}\n"
                       f"replicas: [{{url: '{up_url}', id: r0, engine: vllm}}]\n")
        gw.config_path = str(cfg)
        changes = dep.call(_reload(gw))
        assert {"prompt hashing", "session headers", "http limits", "breaker thresholds"} <= set(changes)
        assert "port (" in caplog.text and "need a restart" in caplog.text
        assert gw.config.port != 1 and gw.proxy.session_headers == ["x-tenant"]
        assert gw.runtime.upstreams["r0"].breaker.threshold == 9 and gw.proxy.hasher.block_tokens == 32
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "x" * 200})
        assert r.status_code == 413  # the new body limit holds for new connections
    finally:
        dep.close()


async def _reload(gw):
    return gw.reload()
