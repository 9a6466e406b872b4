"""Operating the gateway: liveness and readiness through a drain, request ids end to end."""

import asyncio
import time

import httpx

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
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "id", "max_tokens": 1},
                       headers={"X-Request-Id": "client-abc-123"})
        assert r.headers.get_list("x-request-id") == ["client-abc-123"]
        assert b"x-request-id: client-abc-123" in dep.upstreams[0].heads[-1].lower()
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "id", "max_tokens": 1})
        assert len(r.headers.get_list("x-request-id")) == 1 and r.headers["x-request-id"] != "engine-side"
    finally:
        dep.settle()
        dep.close()
