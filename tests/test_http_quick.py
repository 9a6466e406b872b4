"""The callback path for non-streamed answers (``gateway/front.py``, issue 25): a request sent on a
kept-alive upstream connection is answered from that connection's read callback, with no task
woken for it, and keeps every guarantee of the coroutine path — retries, a dead kept-alive
connection sent again, a client that leaves — against scripted engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.fake_upstream import OK_JSON, FaultyDeployment, http_response, replies

COMPLETION = {"model": "m", "prompt": "hello there", "max_tokens": 4}
SLOW_PROBES = {"probe": {"interval_s": 30.0, "timeout_s": 0.5}}  # probes leave the pooled connections alone


@pytest.fixture
def deploy():
    made = []

    def make(*scripts, **overrides) -> FaultyDeployment:
        dep = FaultyDeployment(list(scripts), **{**SLOW_PROBES, **overrides})
        made.append(dep)
        return dep
    yield make
    for dep in made:
        counters = dep.settle()
        errors = dep.gateway.http.errors
        dep.close()
        assert counters == (0, 0, 0), f"in-flight / queue / tickets not back to zero: {counters}"
        assert errors == 0, "a handler raised (traceback in the log)"


def _workers(dep: FaultyDeployment) -> list[bool]:
    """For each open client connection of the gateway: whether it ever started a worker task."""
    async def look():
        return [conn.task is not None for conn in dep.gateway.http.connections]
    return dep.call(look())


def _statuses(dep: FaultyDeployment) -> dict[str, float]:
    text = httpx.get(f"{dep.url}/metrics").text
    return {line.split('status="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kvroute_requests_total{") and 'route="completions"' in line}


def test_a_non_streamed_answer_on_a_kept_alive_connection_wakes_no_task(deploy):
    dep = deploy(replies(http_response(200, OK_JSON)))
    with httpx.Client() as warm:  # the first request opens the upstream connection: by the coroutines
        assert warm.post(f"{dep.url}/v1/completions", json=COMPLETION).status_code == 200
    dep.settle()
    with httpx.Client() as client:
        answers = [client.post(f"{dep.url}/v1/completions", json=COMPLETION) for _ in range(5)]
        assert [r.status_code for r in answers] == [200] * 5
        assert all(r.content == OK_JSON and r.headers["x-kvroute-replica"] == "r0" for r in answers)
        workers = _workers(dep)
    assert workers == [False], workers  # one client connection, answered without a task
    assert dep.upstreams[0].connections == 1 and dep.upstreams[0].requests == 6  # one kept-alive connection
    assert _statuses(dep).get("200") == 6


def test_a_failed_quick_attempt_is_retried_by_the_coroutines(deploy):
    """r0 answers 503 on a kept-alive connection: the request goes on to r1, once, and r0's
    connection stays pooled (its answer was read to the end)."""
    dep = deploy(replies(http_response(503, b'{"error": "busy"}')), replies(http_response(200, OK_JSON)))
    with httpx.Client() as client:
        for _ in range(4):
            r = client.post(f"{dep.url}/v1/completions", json=COMPLETION)
            assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "r1"
    assert dep.upstreams[0].connections == 1 and dep.upstreams[1].connections == 1
    assert dep.upstreams[1].requests == 4 and 2 <= dep.upstreams[0].requests <= 4
    assert _statuses(dep).get("200") == 4


def test_a_kept_alive_connection_found_dead_is_sent_again_not_failed(deploy):
    """An engine that closes after each answer while advertising keep-alive: the next request finds
    the pooled connection dead before any byte, and is sent again on a fresh one — no retry counted,
    no failure fed to the breaker."""
    dep = deploy(replies(http_response(200, OK_JSON), keep_open=False))
    with httpx.Client() as client:
        for _ in range(4):
            r = client.post(f"{dep.url}/v1/completions", json=COMPLETION)
            assert r.status_code == 200 and r.content == OK_JSON
    up = dep.runtime.upstreams["r0"]
    assert dep.upstreams[0].requests == 4 and up.errors == 0
    assert "kvroute_retries_total{" not in httpx.get(f"{dep.url}/metrics").text


def test_a_client_that_leaves_mid_exchange_is_a_499_and_the_engine_connection_closes(deploy):
    """The client gives up while the engine is still working: the upstream connection is closed (the
    engine's signal to stop; a later request needs a new one), and the request is counted once, as
    499, with nothing left in flight."""
    async def slow(head: bytes, body: bytes, w: asyncio.StreamWriter) -> bool:
        if json.loads(body).get("prompt") == "slow":
            await asyncio.sleep(3)
            return False
        w.write(http_response(200, OK_JSON))
        await w.drain()
        return True
    dep = deploy(slow)
    with httpx.Client() as client:  # a kept-alive upstream connection to send on
        assert client.post(f"{dep.url}/v1/completions", json=COMPLETION).status_code == 200
    with pytest.raises(httpx.ReadTimeout), httpx.Client() as client:
        client.post(f"{dep.url}/v1/completions", json={**COMPLETION, "prompt": "slow"}, timeout=0.3)
    assert dep.settle() == (0, 0, 0)
    statuses = _statuses(dep)
    assert statuses.get("499") == 1 and statuses.get("200") == 1, statuses

    async def pooled() -> int:
        return len(dep.runtime.upstreams["r0"].pool._idle)
    assert dep.call(pooled()) == 0  # closed, not given back
    assert httpx.post(f"{dep.url}/v1/completions", json=COMPLETION).status_code == 200
    assert dep.upstreams[0].connections == 2


def test_pending_is_abstract_and_its_subclasses_must_say_how_to_cancel():
    from kvroute.gateway.front import QuickExchange
    from kvroute.gateway.httpmsg import Pending
    with pytest.raises(TypeError):
        Pending()  # type: ignore[abstract]
    with pytest.raises(TypeError):  # pure: cancel is missing; compiled: an interpreted subclass is refused
        class Lacks(Pending):
            pass
        Lacks()  # type: ignore[abstract]
    assert not getattr(QuickExchange, "__abstractmethods__", frozenset())  # the proxy's own is complete
