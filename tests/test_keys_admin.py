"""API keys (hashed, per-key limits, usage), what reaches the engine, and the admin API."""

import hashlib

import httpx
import openai
import pytest

from kvroute import yamlconf
from kvroute.gateway.auth import KeyState, TokenBucket
from kvroute.gateway.config import GatewayConfig
from tests.fake_upstream import FaultyDeployment, ScriptedUpstream, http_response, replies

USER_KEY, ADMIN_KEY, SLOW_KEY = "sk-user-1", "sk-admin-1", "sk-slow-1"
GOOD = replies(http_response())


@pytest.fixture
def dep(monkeypatch):
    monkeypatch.setenv("KVROUTE_TEST_ADMIN_KEY", ADMIN_KEY)
    keys = [{"name": "user", "sha256": hashlib.sha256(USER_KEY.encode()).hexdigest()},
            {"name": "ops", "env": "KVROUTE_TEST_ADMIN_KEY", "admin": True},
            {"name": "slow", "sha256": hashlib.sha256(SLOW_KEY.encode()).hexdigest(), "requests_per_min": 2}]
    d = FaultyDeployment([GOOD, GOOD], auth={"keys": keys})
    yield d
    assert d.settle() == (0, 0, 0)
    d.close()


def post(d, key=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{d.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, headers=headers, **kw)


def test_requests_need_a_configured_key(dep):
    r = post(dep)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(dep, "sk-wrong").status_code == 401
    c = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=USER_KEY, max_retries=0)
    assert c.completions.create(model="m", prompt="hi").choices[0].text == "ok"
    assert all(b"authorization" not in h.lower() for u in dep.upstreams for h in u.heads)  # ours, not the engine's
    assert httpx.get(f"{dep.url}/health").status_code == 200  # probes of the gateway need no key


def test_per_key_request_limit_answers_429_with_retry_after(dep):
    assert [post(dep, SLOW_KEY).status_code for _ in range(2)] == [200, 200]
    r = post(dep, SLOW_KEY)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert post(dep, USER_KEY).status_code == 200  # other keys are not affected
    text = httpx.get(f"{dep.url}/metrics").text
    assert 'kvroute_key_requests_total{key="slow"} 2.0' in text and 'kvroute_key_limited_total{key="slow"} 1.0' in text


def test_token_bucket_refills_with_time():
    key = KeyState("k", tokens=TokenBucket(600, now=0.0))  # 10 tokens a second
    assert key.admit(500, now=0.0) == 0
    assert key.admit(200, now=0.0) == 10  # 100 left: 100 more take 10 s
    assert key.admit(200, now=10.0) == 0


def test_authorization_is_forwarded_only_when_configured():
    d = FaultyDeployment([GOOD], auth={"keys": [{"name": "u", "sha256": hashlib.sha256(b"k").hexdigest()}],
                                       "forward_authorization": True})
    try:
        assert post(d, "k").status_code == 200
        assert b"authorization: bearer k" in d.upstreams[0].heads[-1].lower()
    finally:
        d.close()


def test_a_key_from_a_missing_env_var_is_a_config_error_naming_it(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("auth:\n  keys:\n    - {name: ops, env: KVROUTE_NO_SUCH_VAR}\n")
    with pytest.raises(yamlconf.ConfigFileError, match="KVROUTE_NO_SUCH_VAR is unset"):
        yamlconf.load(GatewayConfig, f)


def admin(d, method, path, key=ADMIN_KEY, **kw):
    return httpx.request(method, f"{d.url}/admin/{path}", headers={"Authorization": f"Bearer {key}"}, **kw)


def test_admin_api_lists_drains_adds_and_removes_replicas(dep):
    assert admin(dep, "GET", "replicas", key=USER_KEY).status_code == 403
    assert httpx.get(f"{dep.url}/admin/replicas").status_code == 401
    listing = admin(dep, "GET", "replicas").json()["replicas"]
    assert [r["id"] for r in listing] == ["r0", "r1"] and listing[0]["healthy"]
    assert admin(dep, "POST", "replicas/r0/drain").json()["drained"] is True
    assert {post(dep, USER_KEY).headers["x-kvroute-replica"] for _ in range(4)} == {"r1"}
    admin(dep, "POST", "replicas/r0/undrain")
    assert {post(dep, USER_KEY).headers["x-kvroute-replica"] for _ in range(4)} == {"r0", "r1"}
    extra = ScriptedUpstream(GOOD)
    dep.call(extra.start())
    dep.upstreams.append(extra)
    r = admin(dep, "POST", "replicas", json={"url": f"http://127.0.0.1:{extra.port}", "id": "r2", "engine": "vllm"})
    assert r.status_code == 201 and r.json()["id"] == "r2"
    assert admin(dep, "POST", "replicas", json={"url": "ftp://x"}).status_code == 400
    assert admin(dep, "DELETE", "replicas/r1").json() == {"removed": "r1"}
    assert admin(dep, "DELETE", "replicas/r1").status_code == 404
    assert {post(dep, USER_KEY).headers["x-kvroute-replica"] for _ in range(6)} == {"r0", "r2"}
    assert admin(dep, "GET", "policy").json()["name"] == "round_robin"
