"""The Grafana dashboard in deploy/grafana queries only metrics the gateway exports."""

import json
import re
from pathlib import Path

import httpx

from tests.gateway_harness import LiveDeployment

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvroute-gateway.json"


def test_every_metric_the_dashboard_queries_is_exported():
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\bkvroute_\w+", e)}
    dep = LiveDeployment(replicas=2, policy="sglang_cache_aware",
                         auth={"keys": [{"name": "k", "sha256": "0" * 64}]})
    try:
        text = httpx.get(f"{dep.url}/metrics").text
    finally:
        dep.close()
    exported = set(re.findall(r"^# TYPE (kvroute_\w+) (\w+)", text, re.M))
    names = set()
    for name, kind in exported:  # the series names a query can use for each family
        names |= {name} | ({f"{name}_total"} if kind == "counter" else set()) | (
            {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else set())
    missing = sorted(queried - names)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    assert len(queried) >= 20
