"""`kvroute epp`: the ext_proc endpoint picker driven by a gRPC client playing Envoy's
FULL_DUPLEX_STREAMED exchange, each request then sent to the chosen emulator over real HTTP and
its response streamed back through the picker; every preset through the same Router; gRPC health;
bad input (a bad body, no ready replica, a full queue, a stream that ends early)."""

import asyncio
import contextlib
import json
import logging

import grpc
import httpx
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from kvroute.emulator.server import Faults, start_emulator  # noqa: E402
from kvroute.epp import protocol as P  # noqa: E402
from kvroute.epp.server import EndpointPicker  # noqa: E402
from kvroute.gateway.config import GatewayConfig  # noqa: E402
from kvroute.gateway.holdqueue import QueueFull  # noqa: E402
from kvroute.policy import PRESETS  # noqa: E402
from tests.envoy_client import Stream, exchange, headers  # noqa: E402

PROMPT = "You are a careful assistant. " * 40  # a shared prefix of several blocks


async def settle(rt, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while rt.router.tickets or any(e.inflight for e in rt.router.endpoints):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"requests still accounted: {list(rt.router.tickets)}")
        await asyncio.sleep(0.02)


class Setup:
    """Three emulators and a picker over them."""

    async def __aenter__(self):
        self.emus = [await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", "vllm", Faults()) for _ in range(3)]
        self.addrs = [f"127.0.0.1:{p}" for _, _, p in self.emus]
        self.config = GatewayConfig(port=0, policy="sglang_cache_aware", probe={"interval_s": 0.05},
                                    replicas=[{"url": f"http://{a}", "id": f"e{i}", "engine": "vllm"}
                                              for i, a in enumerate(self.addrs)])
        self.epp = EndpointPicker(self.config, grpc_host="127.0.0.1", grpc_port=0, health_port=0)
        self.grpc_port, self.health_port = await self.epp.start()
        self.rt = self.epp.gateway.runtime
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)
        self.http = httpx.AsyncClient(timeout=30)
        return self

    async def __aexit__(self, *exc):
        await self.http.aclose()
        await self.channel.close()
        await self.epp.stop()
        for runner, _, _ in self.emus:
            await runner.cleanup()


def test_full_duplex_exchange_routes_to_the_emulator_and_learns():
    async def run():
        async with Setup() as s:
            body = {"model": "emulated", "prompt": PROMPT + "first question", "max_tokens": 8, "stream": True}
            r = await exchange(s.stub, "/v1/completions", body, http=s.http)
            assert r.immediate is None and r.status == 200
            chosen = r.endpoints[0]
            assert r.lb_metadata == ",".join(r.endpoints)  # header and envoy.lb metadata agree
            assert len(r.endpoints) == 3 and len(set(r.endpoints)) == 3  # chosen + two ordered fallbacks
            assert set(r.endpoints) == set(s.addrs)
            assert r.set_headers["content-length"] == str(len(json.dumps(body)))
            assert json.loads(r.upstream_body) == body  # the body went on whole, through the chunks
            assert r.response.rstrip().endswith(b"data: [DONE]")  # the stream came back through the picker
            name = {a: f"e{i}" for i, a in enumerate(s.addrs)}[chosen]
            assert r.response_headers["x-kvroute-replica"] == name
            await settle(s.rt)
            assert s.rt.router.prefix.blocks(name) > 0  # the prompt is indexed where it went
            assert s.rt.prompt_tokens_routed > 0
            # the same prefix again: the cache-aware policy follows it
            again = await exchange(s.stub, "/v1/completions",
                                   {"model": "emulated", "prompt": PROMPT + "second question", "max_tokens": 4},
                                   http=s.http)
            assert again.endpoints[0] == chosen and again.status == 200
            assert json.loads(again.response)["choices"][0]["text"]
            await settle(s.rt)
            # a chat request with a large body: more than one 62,000-byte chunk each way
            big = {"model": "emulated", "max_tokens": 2,
                   "messages": [{"role": "user", "content": "x" * 150_000}]}
            r = await exchange(s.stub, "/v1/chat/completions", big, chunk=16_384, http=s.http)
            assert r.status == 200 and json.loads(r.upstream_body) == big
            await settle(s.rt)
            # Envoy retried on a fallback: the served endpoint takes the accounting, the chosen one a failure
            names = {a: f"e{i}" for i, a in enumerate(s.addrs)}
            probe = await exchange(s.stub, "/v1/completions", {"prompt": "other " * 50, "max_tokens": 2},
                                   http=s.http, served="use-fallback")
            assert probe.status == 200
            chosen, fallback = names[probe.endpoints[0]], names[probe.endpoints[1]]
            assert probe.response_headers["x-kvroute-replica"] == fallback
            assert s.rt.upstreams[chosen].breaker.failures == 1
            await settle(s.rt)
            assert s.rt.router.prefix.blocks(fallback) > 0
            text = s.epp.gateway.runtime.metrics.render().decode()
            assert 'kvroute_requests_total{' in text

    asyncio.run(run())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_picks_through_the_same_router(preset):
    async def run():
        async with Setup() as s:
            s.epp.gateway.runtime.reconfigure(s.config.model_copy(update={"policy": preset}))
            assert s.rt.policy_name == preset
            for i in range(3):
                r = await exchange(s.stub, "/v1/chat/completions", {
                    "model": "emulated", "max_tokens": 3, "user": f"user-{i}",
                    "messages": [{"role": "user", "content": f"{PROMPT} question {i}"}]}, http=s.http)
                assert r.immediate is None, r.immediate
                assert r.status == 200 and r.endpoints[0] in s.addrs
                assert json.loads(r.response)["choices"][0]["message"]["content"]
            await settle(s.rt)

    asyncio.run(run())


def test_grpc_health_liveness_and_readiness():
    async def run():
        async with Setup() as s:
            out = {}
            for port in (s.grpc_port, s.health_port):
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    for svc in P.HEALTH_SERVICES:
                        out[(port, svc)] = (await stub.Check(health_pb2.HealthCheckRequest(service=svc))).status
            assert set(out.values()) == {health_pb2.HealthCheckResponse.SERVING}
            await stop_probes(s.rt)  # so no probe round re-admits the replicas marked down here
            for up in s.rt.upstreams.values():  # every replica down: not ready, still alive
                up.endpoint.healthy = False
            await s.epp.health.update()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{s.health_port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                ready = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
                alive = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert alive.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(run())


async def stop_probes(rt) -> None:
    """Stop the runtime's background probe rounds (they would re-admit replicas a test marks down)."""
    task = rt.prober.task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_refusals_are_immediate_responses(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="kvroute")

    async def run():
        async with Setup() as s:
            bad = await exchange(s.stub, "/v1/completions", b'{"prompt": ', http=s.http)
            assert bad.immediate.status.code == 400 and b"not valid JSON" in bad.immediate.body
            unknown = await exchange(s.stub, "/v1/completions", {"model": "nope", "prompt": "x"}, http=s.http)
            assert unknown.immediate.status.code == 404 and b"does not exist" in unknown.immediate.body
            hint = await exchange(s.stub, "/v1/completions", {"prompt": "x"}, subset=["10.9.9.9:8000"], http=s.http)
            assert hint.immediate.status.code == 503 and b"subset hint" in hint.immediate.body
            only = await exchange(s.stub, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                  subset=[s.addrs[2]], http=s.http)
            assert only.endpoints == [s.addrs[2]]  # the hint narrows the choice and the fallbacks
            await settle(s.rt)

            async def full(req):
                raise QueueFull("LB queue is full (0 waiting)")
            monkeypatch.setattr(s.rt, "admit", full)
            shed = await exchange(s.stub, "/v1/completions", {"prompt": "x"}, http=s.http)
            assert shed.immediate.status.code == 429
            assert {h.header.key: h.header.raw_value for h in shed.immediate.headers.set_headers}["retry-after"] == b"1"
            monkeypatch.undo()
            await stop_probes(s.rt)
            for up in s.rt.upstreams.values():  # no ready replica: 503, not a hang
                up.endpoint.healthy = False
            none = await exchange(s.stub, "/v1/completions", {"prompt": "x"}, http=s.http)
            assert none.immediate.status.code == 503 and b"no replica" in none.immediate.body
            assert "ext_proc request refused with 503" in caplog.text

    asyncio.run(run())


def test_streams_that_end_early_release_what_they_hold(caplog):
    caplog.set_level(logging.INFO, logger="kvroute")

    async def run():
        async with Setup() as s:
            # Envoy gives up mid-body: nothing routed, nothing held, one log line
            st = Stream(s.stub)
            st.send(ep.ProcessingRequest(request_headers=headers({":method": "POST", ":path": "/v1/completions"})))
            st.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"prompt": "half', end_of_stream=False)))
            st.close()
            async with asyncio.timeout(5):
                assert await st.call.read() is grpc.aio.EOF
            # routed, then the client leaves before the response: the replica's count goes back
            st = Stream(s.stub)
            st.send(ep.ProcessingRequest(request_headers=headers({":method": "POST", ":path": "/v1/completions"})))
            st.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps({"prompt": PROMPT}).encode(),
                                                                  end_of_stream=True)))
            head = await st.read()
            assert head.HasField("request_headers")
            assert sum(e.inflight for e in s.rt.router.endpoints) == 1
            st.call.cancel()
            await settle(s.rt)
            # routed, response headers in, then the stream ends: released too
            st = Stream(s.stub)
            st.send(ep.ProcessingRequest(request_headers=headers({":method": "POST", ":path": "/v1/completions"})))
            st.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps({"prompt": "y"}).encode(),
                                                                  end_of_stream=True)))
            await st.read()
            await st.read()
            st.send(ep.ProcessingRequest(response_headers=headers({":status": "200"})))
            await st.read()
            st.close()
            async with asyncio.timeout(5):
                assert await st.call.read() is grpc.aio.EOF
            await settle(s.rt)
            assert caplog.text.count("ended early") >= 2
            # the picker still works
            r = await exchange(s.stub, "/v1/completions", {"prompt": "z", "max_tokens": 2}, http=s.http)
            assert r.status == 200

    asyncio.run(run())


def test_kvroute_epp_process_serves_health_and_drains_on_sigterm(tmp_path):
    import os
    import re
    import signal
    import subprocess
    import sys

    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("port: 0\npolicy: skywalker\nreplicas:\n  - {url: http://127.0.0.1:9, id: gone, engine: vllm}\n")
    proc = subprocess.Popen([sys.executable, "-m", "kvroute", "epp", "--config", str(cfg), "--grpc-port", "0",
                             "--health-port", "0"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = ""
        for _ in range(50):
            line = proc.stderr.readline()
            if "ext_proc on" in line:
                break
        m = re.search(r"ext_proc on 127\.0\.0\.1:(\d+), gRPC health on (\d+)", line)
        assert m, line

        async def check():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{m.group(2)}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                for _ in range(100):  # until the probes have ejected the replica that never answers
                    alive = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
                    ready = await stub.Check(health_pb2.HealthCheckRequest(service=P.EXT_PROC_SERVICE))
                    if ready.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.1)
            return alive.status, ready.status
        alive, ready = asyncio.run(check())
        assert alive == health_pb2.HealthCheckResponse.SERVING
        assert ready == health_pb2.HealthCheckResponse.NOT_SERVING  # its one replica never answers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_kvroute_epp_bad_config_is_one_line_exit_2(tmp_path, capsys):
    from kvroute.cli import main

    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("policy: skywalker\nreplicas: []\n")
    assert main(["epp", "--config", str(cfg)]) == 2
    assert "lists no replicas and no discovery" in capsys.readouterr().err
    cfg.write_text("policy: nosuch\n")
    assert main(["epp", "--config", str(cfg)]) == 2


def test_discovered_engines_come_and_go_under_the_picker(tmp_path):
    """A picker whose engines come from discovery: not ready and 503 while the Service has none,
    ready and routing once one appears."""
    engines = tmp_path / "engines.yaml"
    engines.write_text("replicas: []\n")

    async def run():
        runner, _, port = await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", "vllm", Faults())
        epp = EndpointPicker(GatewayConfig(port=0, probe={"interval_s": 0.05}, discovery=[
            {"kind": "file", "path": str(engines), "interval_s": 0.05}]), grpc_host="127.0.0.1", grpc_port=0,
            health_port=None)
        grpc_port, _ = await epp.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
                stub, health = ep_grpc.ExternalProcessorStub(ch), health_pb2_grpc.HealthStub(ch)
                ready = await health.Check(health_pb2.HealthCheckRequest(service="readiness"))
                assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
                empty = await exchange(stub, "/v1/completions", {"prompt": "x"})
                assert empty.immediate.status.code == 503
                engines.write_text(f"replicas: [{{url: 'http://127.0.0.1:{port}', id: found, engine: vllm}}]\n")
                for _ in range(200):
                    await epp.health.update()
                    ready = await health.Check(health_pb2.HealthCheckRequest(service=P.EXT_PROC_SERVICE))
                    if ready.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                    await asyncio.sleep(0.02)
                assert ready.status == health_pb2.HealthCheckResponse.SERVING
                r = await exchange(stub, "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert r.endpoints == [f"127.0.0.1:{port}"] and r.status == 200
                assert r.response_headers["x-kvroute-replica"] == "found"
        finally:
            await epp.stop()
            await runner.cleanup()

    asyncio.run(run())


def test_a_request_without_a_body_is_routed_by_load():
    async def run():
        async with Setup() as s:
            st = Stream(s.stub)
            st.send(ep.ProcessingRequest(request_headers=headers({":method": "GET", ":path": "/v1/models"},
                                                                 end=True)))
            head = await st.read()
            assert head.HasField("request_headers"), head
            dest = {h.header.key: h.header.raw_value.decode()
                    for h in head.request_headers.response.header_mutation.set_headers}[P.DESTINATION]
            target = dest.split(",")[0]
            async with httpx.AsyncClient() as c:
                models = await c.get(f"http://{target}/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "emulated"
            st.send(ep.ProcessingRequest(response_headers=headers({":status": "200"})))
            await st.read()
            st.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=models.content, end_of_stream=True)))
            echo = await st.read()
            assert echo.response_body.response.body_mutation.streamed_response.body == models.content
            st.close()
            await settle(s.rt)

    asyncio.run(run())


def test_fallbacks_are_the_policys_next_choices_and_cost_it_nothing():
    """The fallbacks are what the policy would pick next with the earlier picks excluded, and
    computing them moves nothing: round robin still rotates e0, e1, e2 over three requests."""
    from kvroute.model import Request

    async def run():
        async with Setup() as s:
            s.epp.gateway.runtime.reconfigure(s.config.model_copy(update={"policy": "round_robin"}))
            names = {a: f"e{i}" for i, a in enumerate(s.addrs)}
            chosen = []
            for i in range(3):
                r = await exchange(s.stub, "/v1/completions", {"prompt": f"p{i}", "max_tokens": 2}, http=s.http)
                picked = [names[a] for a in r.endpoints]
                chosen.append(picked[0])
                if i == 0:  # what the policy says now, the chosen one (then the first fallback) excluded
                    d1 = s.rt.router.decide(Request(id="probe", prompt_tokens=1, exclude=(picked[0],)))
                    d2 = s.rt.router.decide(Request(id="probe", prompt_tokens=1, exclude=(picked[0], d1.target)))
                    assert picked[1:] == [d1.target, d2.target], (d1, d2)
                await settle(s.rt)
            order = ["e0", "e1", "e2"]
            start = order.index(chosen[0])
            assert chosen == [order[(start + k) % 3] for k in range(3)]  # the rotation never skipped

    asyncio.run(run())
