"""The Helm chart rendered by Helm's own Go engine (helm-python-sdk bundles Helm's SDK as a native
library: no helm binary, no network), every manifest validated against the Kubernetes API schemas
(kubernetes-validate), plus the checks a schema cannot make: selectors agree, probes hit endpoints
kvroute serves, the rendered gateway.yaml loads, the container args parse, RBAC is only what
discovery reads, the pods run as the Dockerfile's non-root user."""

import json
import re
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart")
kv = pytest.importorskip("kubernetes_validate")

from kvroute import yamlconf  # noqa: E402
from kvroute.commands import build_parser  # noqa: E402
from kvroute.epp.protocol import HEALTH_SERVICES  # noqa: E402
from kvroute.gateway.config import GatewayConfig  # noqa: E402
from kvroute.gateway.server import ROUTES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "kvroute"
K8S_VERSION = "1.33.0"  # a release current clusters run; the chart uses nothing newer than 1.27 (gRPC probes)
EPP_VALUES = {
    "mode": "epp", "replicaCount": 3,
    "config": {"policy": "lmetric", "discovery": [
        {"kind": "kubernetes", "service": "vllm-engines", "namespace": "engines", "port": "http"},
        {"kind": "file", "path": "/etc/kvroute/engines/engines.yaml"}]},
    "engines": {"enabled": True, "replicas": [{"url": "http://10.0.0.5:8000", "engine": "sglang"}]},
    "epp": {"inferencePool": {"create": True, "selector": {"app": "vllm"}, "targetPorts": [8000]}},
    "serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True},
}


def render(values: dict, namespace: str = "llm") -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="kvr", namespace=namespace)
    docs = []
    for path, text in out.items():
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_chart_lints_clean():
    report = helm.lint(str(CHART))
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


@pytest.mark.parametrize("values", [{}, EPP_VALUES, {"rbac": {"create": False}, "podDisruptionBudget":
                                                     {"enabled": False}, "config": {"replicas": [
                                                         {"url": "http://10.0.0.5:8000"}], "discovery": []}}],
                         ids=["defaults", "epp-everything", "static-no-rbac"])
def test_every_manifest_is_valid_kubernetes(values):
    docs = render(values)
    checked = 0
    for d in docs:
        if d["apiVersion"].startswith(("monitoring.coreos.com/", "inference.networking.k8s.io/")):
            continue  # CRDs: no schema in kubernetes-validate; checked field by field below
        kv.validate(d, K8S_VERSION, strict=True)  # raises ValidationError naming the field
        checked += 1
    assert checked >= 4


def test_gateway_mode_defaults_hang_together(monkeypatch):
    kinds = by_kind(render({}))
    dep, svc, pdb = kinds["Deployment"][0], kinds["Service"][0], kinds["PodDisruptionBudget"][0]
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    for selector in (dep["spec"]["selector"]["matchLabels"], svc["spec"]["selector"],
                     pdb["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert dep["spec"]["replicas"] >= 2
    c = pod["spec"]["containers"][0]
    assert {p["name"] for p in c["ports"]} >= {p["targetPort"] for p in svc["spec"]["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] in ROUTES  # /livez and /readyz: the gateway serves them
    # non-root, nothing writable but /tmp, no privilege
    sec, psec = c["securityContext"], pod["spec"]["securityContext"]
    assert psec["runAsNonRoot"] and psec["runAsUser"] == dockerfile_uid()
    assert sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"]
    assert sec["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    # the container's args are a kvroute command line, and the gateway.yaml it reads loads
    args = build_parser().parse_args(c["args"])
    assert args.command == "serve" and args.config == "/etc/kvroute/gateway.yaml"
    cfg = load_rendered_config(kinds["ConfigMap"][0]["data"]["gateway.yaml"], monkeypatch)
    assert cfg.host == "0.0.0.0" and cfg.port == c["ports"][0]["containerPort"]
    assert cfg.discovery[0].kind == "kubernetes" and cfg.discovery[0].service == "vllm-engines"
    assert pod["spec"]["automountServiceAccountToken"] is True  # kubernetes discovery reads the API
    assert pod["spec"]["terminationGracePeriodSeconds"] > cfg.drain_delay_s + cfg.drain_timeout_s - 30


def test_rbac_is_only_what_discovery_reads():
    kinds = by_kind(render(EPP_VALUES))
    (role,), (binding,) = kinds["Role"], kinds["RoleBinding"]
    assert role["metadata"]["namespace"] == "engines"  # where the source's Service lives
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]},
                             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvr-kvroute", "namespace": "llm"}]
    assert "ClusterRole" not in kinds
    static = by_kind(render({"config": {"replicas": [{"url": "http://10.0.0.5:8000"}], "discovery": []}}))
    assert "Role" not in static  # no kubernetes source: no API access at all, no token mounted
    assert static["Deployment"][0]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_epp_mode_inference_pool_monitoring_and_dashboard(monkeypatch):
    kinds = by_kind(render(EPP_VALUES))
    dep, svc = kinds["Deployment"][0], kinds["Service"][0]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(c["args"])
    assert (args.command, args.grpc_port, args.health_port) == ("epp", 9002, 9003)
    assert c["livenessProbe"]["grpc"]["service"] in HEALTH_SERVICES
    assert c["readinessProbe"]["grpc"]["service"] == "readiness"
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 9002 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    # InferencePool, inference.networking.k8s.io/v1 (fields as the extension's API types define them)
    (pool,) = kinds["InferencePool"]
    spec = pool["spec"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert spec["selector"] == {"matchLabels": {"app": "vllm"}}
    assert 1 <= len(spec["targetPorts"]) <= 8 and all(set(p) == {"number"} for p in spec["targetPorts"])
    ref = spec["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["name"] == svc["metadata"]["name"]
    assert ref["port"] == {"number": ports["grpc"]["port"]} and ref["failureMode"] in ("FailOpen", "FailClose")
    # ServiceMonitor scrapes the Service's http port at /metrics
    (sm,) = kinds["ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["port"] in ports and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    # the dashboard ConfigMap carries deploy/grafana's dashboard as it is
    maps = {m["metadata"]["name"]: m for m in kinds["ConfigMap"]}
    board = maps["kvr-kvroute-dashboard"]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["kvroute-gateway.json"]) == json.loads(
        (ROOT / "deploy" / "grafana" / "kvroute-gateway.json").read_text())
    # the engines ConfigMap is a file discovery source kvroute reads, mounted as a directory
    engines = yaml.safe_load(maps["kvr-kvroute-engines"]["data"]["engines.yaml"])
    assert engines == {"replicas": [{"url": "http://10.0.0.5:8000", "engine": "sglang"}]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["engines"]["mountPath"] == "/etc/kvroute/engines" and "subPath" not in mounts["engines"]
    cfg = load_rendered_config(maps["kvr-kvroute"]["data"]["gateway.yaml"], monkeypatch)
    assert cfg.policy == "lmetric" and [s.kind for s in cfg.discovery] == ["kubernetes", "file"]


def test_recorded_api_responses_are_valid_kubernetes_objects():
    """The discovery tests' recorded EndpointSlice lists and watch objects fit the API schema."""
    data = ROOT / "tests" / "data" / "k8s"
    subs = {"{IP_A}": "10.0.0.1", "{IP_B}": "10.0.0.2", "{IP_C}": "10.0.0.3", "{PORT}": "8000"}

    def fill(text: str) -> str:
        for k, v in subs.items():
            text = text.replace(k, v)
        return text
    for name in ("endpointslice-list.json", "endpointslice-relist.json", "endpointslice-empty.json"):
        doc = json.loads(fill((data / name).read_text()))
        for item in doc["items"]:
            kv.validate({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", **item}, K8S_VERSION,
                        strict=True)
    for name in ("watch-1.jsonl", "watch-2.jsonl"):
        for line in fill((data / name).read_text()).splitlines():
            event = json.loads(line)
            obj = event["object"]
            if event["type"] != "BOOKMARK" and obj["kind"] == "EndpointSlice":  # a bookmark: metadata only
                kv.validate(obj, K8S_VERSION, strict=True)
    for pod in json.loads(fill((data / "pods.json").read_text())).values():
        kv.validate({**pod, "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}, K8S_VERSION, strict=True)


def test_bad_values_fail_to_validate():
    """The validator is not a rubber stamp: a wrong field in a rendered manifest is caught."""
    dep = by_kind(render({}))["Deployment"][0]
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def dockerfile_uid() -> int:
    m = re.search(r"^USER (\d+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, "the Dockerfile runs as a numeric non-root user"
    return int(m.group(1))


def load_rendered_config(text: str, monkeypatch) -> GatewayConfig:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # as in any pod
    return yamlconf.validate(GatewayConfig, yaml.safe_load(text), "gateway.yaml", text)


def test_chart_values_are_documented():
    """Every top-level value has a comment: on its line, or above it (a block of keys under one
    comment counts, as in the scheduling block at the end)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-zA-Z]\w*:", line):
            before = next((x for x in reversed(lines[:i]) if x.strip() and not re.match(r"^[a-zA-Z]\w*: .+$", x)), "")
            assert "#" in line or before.startswith("#"), f"values.yaml: {line!r} has no comment"


def test_readme_kubernetes_examples_are_what_kvroute_and_the_protocol_take(monkeypatch):
    """The README's discovery block loads as gateway.yaml; its InferencePool names the picker's port;
    its Envoy fragment sends every phase in FULL_DUPLEX_STREAMED and routes on the picker's header."""
    from kvroute.epp import protocol

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Kubernetes"):text.index("## Compare policies")]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    cfg = GatewayConfig(**blocks[0])
    assert [s.kind for s in cfg.discovery] == ["kubernetes", "dns", "file"]
    pool = blocks[1]
    assert pool["kind"] == "InferencePool" and pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002
    envoy = blocks[2]
    mode = envoy["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["response_header_mode"] == "SEND"  # the picker learns completions from the response
    (cluster,) = [c for c in envoy["clusters"] if c.get("type") == "ORIGINAL_DST"]
    assert cluster["original_dst_lb_config"]["http_header_name"] == protocol.DESTINATION
    (epp,) = [c for c in envoy["clusters"] if c.get("health_checks")]
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == protocol.EXT_PROC_SERVICE
