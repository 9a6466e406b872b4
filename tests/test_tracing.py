"""OpenTelemetry request spans carry the routing decision (tracing is an optional extra)."""

import httpx
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.fake_upstream import FaultyDeployment, http_response, replies

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
trace.set_tracer_provider(PROVIDER)  # once per process, as an application would


def test_each_request_is_a_span_with_its_routing_decision():
    dep = FaultyDeployment([replies(http_response(500, b"{}")), replies(http_response())],
                           tracing={"enabled": True})
    try:
        EXPORTER.clear()
        r = httpx.post(f"{dep.url}/v1/completions", json={"model": "m", "prompt": "trace me"})
        assert r.status_code == 200
        dep.settle()
        [span] = [s for s in EXPORTER.get_finished_spans() if s.name == "kvroute.request"]
        a = span.attributes
        assert a["kvroute.route"] == "completions" and a["kvroute.status"] == 200 and a["kvroute.model"] == "m"
        assert a["kvroute.replica"] == r.headers["x-kvroute-replica"] and a["kvroute.policy"] == "round_robin"
        assert a["kvroute.branch"] and "kvroute.request_id" in a
    finally:
        dep.close()


def test_tracing_is_off_by_default():
    dep = FaultyDeployment([replies(http_response())])
    try:
        EXPORTER.clear()
        assert httpx.post(f"{dep.url}/v1/completions", json={"prompt": "x"}).status_code == 200
        assert not EXPORTER.get_finished_spans() and not dep.gateway.proxy.tracer.enabled
    finally:
        dep.settle()
        dep.close()
