"""Operating the gateway: liveness and readiness through a drain, request ids end to end."""

import asyncio
import contextlib
import time

import httpx
import openai

from tests.fake_upstream import FaultyDeployment, http_response, replies


def test_readiness_goes_false_before_the_drain_while_requests_are_still_served():
    # the checks below must all land inside the delay: 3 s of it, polled, instead of 1 s less a fixed
    # 0.3 s sleep, which left 0.7 s for three requests from a test thread on a possibly starved machine
    dep = FaultyDeployment([replies(http_response())], drain_delay_s=3.0)
    try:
        assert httpx.get(f"{dep.url}/livez").status_code == 200
        assert httpx.get(f"{dep.url}/readyz").status_code == 200
        started = time.monotonic()
        draining = asyncio.run_coroutine_threadsafe(dep.gateway.drain(), dep.loop)
        while httpx.get(f"{dep.url}/readyz").status_code != 503:  # the front LB stops sending
            assert not draining.done() and time.monotonic() - started < 3.0, "readiness never went false"
            time.sleep(0.02)
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


def test_a_client_leaving_after_its_queued_dispatch_was_decided_undoes_it_as_never_sent():
    """The queue hands a request to a half-open replica (set_result), and the client leaves before
    the waiting task resumes: the dispatch is undone as a request never sent — the breaker's trial
    slot comes back, the prompt is neither counted as routed nor left in the prefix index."""
    from kvroute.gateway.breaker import CircuitState
    from kvroute.model import Decision, Request
    from kvroute.policy.base import Policy
    from kvroute.prefix import hash_text

    class HoldThenPick(Policy):
        name = "hold_then_pick"
        hold = True

        def choose(self, req, eps, view, dry_run=False):
            return Decision.hold("wait") if self.hold else Decision.dispatch("r0", "pick")

    async def scenario(rt):
        rt.router.policy = policy = HoldThenPick()
        breaker = rt.upstreams["r0"].breaker
        breaker.state, breaker.trial_running = CircuitState.HALF_OPEN, False
        req = Request("left", prompt_key="p" * 256, block_hashes=hash_text("p" * 256, 64), prompt_tokens=64)
        task = asyncio.ensure_future(rt.admit(req))
        await asyncio.sleep(0.01)
        assert len(rt.queue) == 1 and not task.done()
        policy.hold = False
        rt.drain_queue()  # the waiter's future now holds the dispatch; the task has not resumed
        assert breaker.trial_running and "left" in rt.router.tickets
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return (breaker.trial_running, breaker.allows, rt.prompt_tokens_routed, dict(rt.router.tickets),
                rt.router.prefix.match(req.block_hashes))

    dep = FaultyDeployment([replies(http_response())])
    try:
        trial, allows, routed, tickets, matched = dep.call(scenario(dep.gateway.runtime))
        assert not trial and allows  # the half-open replica may take its trial again
        assert routed == 0 and tickets == {}
        assert matched == {}  # the index forgot the prompt
    finally:
        dep.close()
