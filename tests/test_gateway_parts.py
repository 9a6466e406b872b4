"""Gateway building blocks: probe parsing, emulator metrics, config errors, HTTP edge cases."""

import socket

import httpx
import pytest

from kvroute import yamlconf
from kvroute.gateway.config import GatewayConfig, load_config
from kvroute.gateway.probes import ProbeError, parse_prometheus, read_indicators
from tests.gateway_harness import LiveDeployment


def test_parse_prometheus_takes_first_sample_and_ignores_labels_and_comments():
    text = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="a",engine="0"} 3\n'
            'vllm:num_requests_running{model_name="b"} 9\n'
            'vllm:num_requests_waiting 2.0\nvllm:kv_cache_usage_perc{x="y z"} 0.25\nbroken line here\n')
    s = parse_prometheus(text)
    assert s["vllm:num_requests_running"] == 3 and s["vllm:num_requests_waiting"] == 2
    assert s["vllm:kv_cache_usage_perc"] == 0.25


@pytest.mark.parametrize("engine, text", [
    ("vllm", "vllm:num_requests_running 4\nvllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.5\n"),
    ("sglang", "sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n"),
    ("llamacpp", "llamacpp:requests_processing 4\nllamacpp:requests_deferred 1\n"),
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
    assert out.startswith(b"HTTP/1.1 200") and b"t0 t1" in out


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
