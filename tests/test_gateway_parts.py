"""Gateway building blocks: probe parsing, emulator metrics, config errors, HTTP edge cases."""

import socket

import httpx
import pytest

from kvroute import yamlconf
from kvroute.emulator.text import emulated_text
from kvroute.gateway.config import GatewayConfig, load_config
from kvroute.gateway.probes import ProbeError, parse_prometheus, read_indicators, restarted
from tests.gateway_harness import LiveDeployment


def test_probe_sums_label_sets_averages_kv_and_ignores_other_metrics():
    # two data-parallel ranks: the replica runs 1 + 7 requests, not the first rank's 1
    text = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="a",engine="0"} 1\n'
            'vllm:num_requests_running{model_name="a",engine="1"} 7\n'
            'vllm:num_requests_waiting 2.0\nvllm:kv_cache_usage_perc{engine="0"} 0.2\n'
            'vllm:kv_cache_usage_perc{engine="1"} 0.4\nvllm:num_requests_running_other 99\n'
            'vllm:prompt_tokens_total 1234\nprocess_start_time_seconds 1.7e9\nbroken line here\n')
    r = read_indicators(parse_prometheus(text))
    assert (r.engine, r.running, r.waiting) == ("vllm", 8, 2)
    assert r.kv_usage == pytest.approx(0.3) and r.prompt_tokens_total == 1234 and r.start_time == 1.7e9


def test_restarts_are_recognised_by_start_time_or_a_counter_going_back():
    def reading(total, start=None):
        text = f"vllm:num_requests_running 0\nvllm:prompt_tokens_total {total}\n"
        return read_indicators(parse_prometheus(text + (f"process_start_time_seconds {start}\n" if start else "")))
    assert not restarted(None, reading(5))
    assert not restarted(reading(5), reading(9))
    assert restarted(reading(5000), reading(12))  # counters reset (llama.cpp exports no start time)
    assert restarted(reading(5, start=100.0), reading(9, start=160.0))


@pytest.mark.parametrize("engine, text", [
    ("vllm", "vllm:num_requests_running 4\nvllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.5\n"),
    ("sglang", "sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n"),
    ("llamacpp", "llamacpp:requests_processing 4\nllamacpp:requests_deferred 1\n"),  # no KV usage
])
def test_each_engine_is_detected_and_read(engine, text):
    r = read_indicators(parse_prometheus(text))
    assert (r.engine, r.running, r.waiting) == (engine, 4, 1)
    assert read_indicators(parse_prometheus(text), engine).running == 4
    with pytest.raises(ProbeError):
        read_indicators(parse_prometheus("process_cpu_seconds_total 1\n"))


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_emulator_exports_its_engines_metric_names(engine):
    import asyncio

    from kvroute.emulator.server import start_emulator

    async def scrape():
        import aiohttp
        runner, _, port = await start_emulator("127.0.0.1", 0, "h100-llama3.2-3b", engine)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    return await r.text()
        finally:
            await runner.cleanup()

    assert read_indicators(parse_prometheus(asyncio.run(scrape()))).engine == engine


def test_gateway_config_errors_name_file_line_field_and_allowed(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("port: 8000\nreplicas:\n  - url: http://127.0.0.1:9000\n    engin: vllm\n")
    with pytest.raises(yamlconf.ConfigFileError, match=r"gw.yaml:4: unknown key 'replicas.0.engin'; allowed: url, id"):
        load_config(f)
    f.write_text("replicas:\n  - {url: 'ftp://x'}\n")
    with pytest.raises(yamlconf.ConfigFileError, match=r"gw.yaml:2: replicas.0.url: url must be http://host:port"):
        load_config(f)
    f.write_text("policy: {preset: lmetrik}\n")
    with pytest.raises(yamlconf.ConfigFileError, match="unknown preset 'lmetrik'; valid presets"):
        load_config(f)
    f.write_text("replicas:\n  - {url: 'http://a:1', engine: tgi}\n")
    with pytest.raises(yamlconf.ConfigFileError, match="'auto', 'vllm', 'sglang' or 'llamacpp'"):
        load_config(f)
    with pytest.raises(yamlconf.ConfigFileError, match="must be unique; repeated: a:1"):
        yamlconf.validate(GatewayConfig, {"replicas": [{"url": "http://a:1"}, {"url": "http://a:1"}]}, "x")


@pytest.fixture(scope="module")
def gw():
    dep = LiveDeployment(replicas=2)
    yield dep
    assert dep.settle() == (0, 0, 0)
    dep.close()


def _raw(port: int, payload: bytes, read_until: bytes = b"\r\n0\r\n\r\n", timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        out = b""
        while True:
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            if not data:
                break
            out += data
            if read_until and out.count(read_until) >= 1 and out.endswith(read_until):
                break
        return out


def _port(dep):
    return dep.dep.gateway.port


def test_expect_100_continue_is_answered(gw):
    body = b'{"prompt": "hello", "max_tokens": 2}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", _port(gw)), timeout=5) as s:
        s.sendall(head)
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 200") and emulated_text("hello", 2).encode() in out


def test_chunked_request_body_and_pipelined_requests(gw):
    body = b'{"prompt": "chunked", "max_tokens": 1}'
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    req1 = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    req2 = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    out = _raw(_port(gw), req1 + req2, read_until=b"")
    assert out.count(b"HTTP/1.1 200") == 2  # both answered, in order
    assert out.index(b"text_completion") < out.index(b'"status": "ok"')


@pytest.mark.parametrize("payload, status", [
    (b"NONSENSE\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n", 413),
])
def test_malformed_http_gets_a_json_error_and_the_server_survives(gw, payload, status):
    out = _raw(_port(gw), payload, read_until=b"")
    assert out.startswith(b"HTTP/1.1 %d" % status) and b'"error"' in out
    assert httpx.get(f"{gw.url}/health").status_code == 200


def test_replicas_without_a_region_are_in_the_gateways(tmp_path):
    """`region: us` and replicas that name none: they are in us (and its zone), so a request pinned
    to us is served, not refused; a replica that names its region keeps it; no gateway region: local."""
    from tests.fake_upstream import FaultyDeployment, http_response, replies

    cfg = tmp_path / "gw.yaml"
    cfg.write_text("region: us\nreplicas:\n  - {url: 'http://127.0.0.1:1', id: a}\n"
                   "  - {url: 'http://127.0.0.1:2', id: b, region: eu}\n")
    assert [r.region for r in load_config(str(cfg)).replicas] == ["us", "eu"]
    assert GatewayConfig(replicas=[{"url": "http://127.0.0.1:1"}]).replicas[0].region == "local"
    dep = FaultyDeployment([replies(http_response())], region="us")
    try:
        assert dep.runtime.upstreams["r0"].endpoint.zone == "us"
        r = httpx.post(f"{dep.url}/v1/completions", json={"prompt": "pinned", "max_tokens": 1},
                       headers={"x-kvroute-residency": "us"}, timeout=5)
        assert r.status_code == 200
    finally:
        dep.settle()
        dep.close()
