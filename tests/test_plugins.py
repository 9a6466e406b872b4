"""Policies as compositions of plugins: the per-decision state, the protocols' guarantees, and
user presets from YAML and from an entry point."""

import sys
import textwrap

import pytest

from kvroute import policyfiles
from kvroute.errors import ConfigError
from kvroute.model import Branch, DecisionKind, Endpoint
from kvroute.policy import Router, build_policy, policy_from_config, registry
from kvroute.policy.catalog import PLUGINS, PRESETS_TABLE, register_plugin
from kvroute.policy.plugins import DecisionState
from kvroute.policyfiles import load_policy_file
from kvroute.prefix import PrefixIndex
from tests.conftest import make_request

LONG = "shared context about the deployment " * 120


def warm_router(preset, n=4, params=None, warm="e1", index=None):
    router = Router(policy_from_config(preset) if isinstance(preset, dict) else build_policy(preset, params),
                    [Endpoint(f"e{i}") for i in range(n)])
    if index is not None:  # in place of the router's own, before anything is indexed
        router.prefix = router.view.prefix = index
    router.commit(make_request("warm", LONG), warm)
    router.on_finish("warm")
    return router


class CountingIndex(PrefixIndex):
    """The prefix index, counting its full matches (a subclass, not a patched class: the compiled
    build's classes refuse patching, docs/compiled.md)."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.calls, self.fail = 0, fail

    def match(self, hashes, endpoint_ids=None):
        if self.fail:
            pytest.fail("a load-only preset matched")
        self.calls += 1
        return super().match(hashes, endpoint_ids)


@pytest.mark.parametrize("preset", ["skywalker", "sglang_cache_aware", "lmetric", "dynamo_kv", "gorgo",
                                    "weighted", "aibrix_prefix_cache", "bailian_linear", "llm_d"])
def test_each_decision_matches_the_prompt_once(preset):
    index = CountingIndex()
    router = warm_router(preset, index=index)
    for i in range(5):
        d = router.route(make_request(f"r{i}", LONG))
        assert d.kind is DecisionKind.DISPATCH
    assert 1 <= index.calls <= 5  # prefix-aware: it does match, once per decision at most


@pytest.mark.parametrize("preset", ["round_robin", "least_request", "least_load", "vllm_jsq", "power_of_two",
                                    "consistent_hash", "prefix_hash"])
def test_load_only_presets_never_match(preset):
    router = warm_router(preset, index=CountingIndex(fail=True))
    assert router.route(make_request("a", LONG, key="u1")).kind is DecisionKind.DISPATCH


def test_decision_state_is_lazy_and_agrees_with_the_formula():
    router = warm_router("round_robin")
    req = make_request("a", LONG)
    st = DecisionState(req, router.view, router.policy.rng)
    assert st.matched("e1") == 0  # nobody asked: nothing matched
    eps = router.endpoints
    assert st.new_prefill(eps) == [req.new_prefill_tokens(st.matches.get(e.id, 0)) for e in eps]
    assert st.best_match(eps) == st.matches["e1"] and st.hit_ratio(eps) == req.hit_ratio(st.matches["e1"])


def test_lmetric_score_is_computed_once_per_decision_and_endpoint_list():
    """LMetric's P-tokens x BS, shared by the lmetric scorer, lmetric_speed, the hotspot route and the
    trust region: the formula, one list per endpoint list, recomputed for another list."""
    router = warm_router("round_robin", n=4)
    for e, (run, wait) in zip(router.endpoints, [(3, 1), (0, 0), (7, 4), (1, 0)]):
        e.apply_probe(run, wait, 0.0)
        e.queued_prefill_tokens = 100 * e.running
    st = DecisionState(make_request("a", LONG), router.view, router.policy.rng)
    eps = router.endpoints
    want = [(e.queued_prefill_tokens + n) * (e.running + e.waiting + e.dispatched_since_probe + 1)
            for n, e in zip(st.new_prefill(eps), eps)]
    assert st.lmetric(eps) == want and st.lmetric(eps) is st.lmetric(eps)
    assert PLUGINS["scorer"]["lmetric"]().values(st, eps) is st.lmetric(eps)
    assert PLUGINS["scorer"]["lmetric_speed"]().values(st, eps) == want  # no speeds learned: LMetric's
    fewer = eps[1:]
    assert st.lmetric(fewer) == want[1:] and st.lmetric(eps) == want


def test_every_scorer_normalises_into_the_unit_interval():
    router = warm_router("round_robin", n=5)
    for e, (run, wait, kv, rtt) in zip(router.endpoints, [(3, 1, .2, .01), (0, 0, .9, .2), (7, 4, 0, 0),
                                                         (1, 0, 1, .05), (2, 2, .5, .1)]):
        e.apply_probe(run, wait, kv)
        e.rtt_s = rtt
    router.commit(make_request("busy", "other prompt " * 50), "e2")
    st = DecisionState(make_request("a", LONG), router.view, router.policy.rng)
    for name, cls in PLUGINS["scorer"].items():
        try:
            scorer = cls()
        except TypeError:
            continue  # needs arguments (a learning scorer)
        values = scorer.normalised(st, router.endpoints)
        assert all(0.0 <= v <= 1.0 for v in values), (name, values)


def test_consistent_hash_and_skywalker_ch_are_one_algorithm():
    a, b = build_policy("consistent_hash"), build_policy("skywalker_ch")
    assert a.describe()["rules"] == b.describe()["rules"]
    assert (a.admission.name, b.admission.name) == ("blind", "pending")


def test_inline_composition_routes_and_names_its_inputs():
    policy = policy_from_config({"filters": ["residency"], "admission": "pending", "cost": {"lmetric": 1.0},
                                 "picker": "argmin", "branch": "mine"})
    assert policy.admission.name == "pending" and policy.reads_prefill_backlog
    router = Router(policy, [Endpoint("us-1", region="us"), Endpoint("eu-1", region="eu")])
    d = router.route(make_request("a", LONG, residency="eu"))
    assert (d.target, d.branch) == ("eu-1", "mine")


PRESET_FILE = """\
name: cache_then_lmetric
description: Follow a strong cache hit, else LMetric's score.
params:
  threshold: 0.8
admission: blind
rules:
  - when: {hit_ratio_at_least: $threshold}
    among: best_prefix
    cost: {inflight: 1}
    branch: strong-hit
cost: {lmetric: 1}
branch: lmetric
"""


def test_user_preset_from_a_yaml_file_routes_with_its_own_params(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(PRESET_FILE)
    try:
        assert policyfiles.register_preset_file(f) == "cache_then_lmetric"
        router = warm_router("cache_then_lmetric")
        assert router.route(make_request("a", LONG)).branch == "strong-hit"
        strict = warm_router("cache_then_lmetric", params={"threshold": 1.0})
        assert strict.route(make_request("b", LONG + " tail " * 40)).branch == "lmetric"
        with pytest.raises(ConfigError, match="unknown parameter 'treshold'.*valid parameters:.*threshold"):
            build_policy("cache_then_lmetric", {"treshold": 1})
        assert load_policy_file(f).name == "cache_then_lmetric"  # the same file, not registered, also builds
    finally:
        PRESETS_TABLE.pop("cache_then_lmetric", None)


@pytest.mark.parametrize("text, line, fragment", [
    (PRESET_FILE.replace("hit_ratio_at_least", "hit_ratio_atleast"), 7, "unknown condition 'hit_ratio_atleast'"),
    (PRESET_FILE.replace("cost: {lmetric: 1}", "cost: {lmetrik: 1}"), 11, "unknown scorer 'lmetrik'; valid"),
    (PRESET_FILE.replace("$threshold", "$thresh"), 7, "unknown parameter '$thresh'"),
    (PRESET_FILE.replace("branch: lmetric", "brunch: lmetric"), 12, "unknown key(s) brunch"),
    (PRESET_FILE.replace("admission: blind", "admission: sometimes"), 5, "allowed: blind, pending, outstanding"),
    (PRESET_FILE.replace("among: best_prefix", "among: {best_prefix: 3}"), 8, "bad arguments 3"),
])
def test_preset_file_errors_name_file_and_line(tmp_path, text, line, fragment):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_policy_file(f)
    msg = str(exc.value)
    assert msg.startswith(f"{f}:{line}: ") and fragment in msg and "\n" not in msg, msg


def test_composition_errors_name_the_valid_choices():
    with pytest.raises(ConfigError, match="unknown picker 'best'; valid pickers: argmin, argmax"):
        policy_from_config({"cost": {"inflight": 1}, "picker": "best"})
    with pytest.raises(ConfigError, match="give cost .* or score .*, not both"):
        policy_from_config({"cost": {"inflight": 1}, "score": {"prefix": 1}})
    with pytest.raises(ConfigError, match="needs scores"):
        policy_from_config({"picker": "argmin"})
    with pytest.raises(ConfigError, match="missing 'preset'"):
        policy_from_config({"params": {}})


ENTRY_MODULE = '''
"""A preset shipped outside kvroute."""
from kvroute.policy.catalog import register_plugin, register_preset
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import Scorer


@register_plugin
class Longest(Scorer):
    """Prompt tokens in flight (a test scorer)."""
    name = "ext_inflight_tokens"
    inputs = frozenset({"load"})

    def values(self, st, eps):
        return [e.inflight_tokens for e in eps]


@register_preset("ext_least_tokens", source="a test package", cost={"ext_inflight_tokens": 1}, branch="ext")
class ExtParams(PolicyParams):
    """Fewest prompt tokens in flight, from an entry point."""
'''


def _dist(tmp_path, name: str, value: str) -> None:
    info = tmp_path / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvroute.policies]\n{name} = {value}\n")


def test_user_preset_from_an_entry_point_routes(tmp_path, monkeypatch):
    (tmp_path / "kvroute_ext_test.py").write_text(textwrap.dedent(ENTRY_MODULE))
    _dist(tmp_path, "kvroute_ext_test", "kvroute_ext_test")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        policyfiles.load_entry_points(force=True)
        assert "ext_least_tokens" in registry.PRESETS
        router = Router(build_policy("ext_least_tokens"), [Endpoint("a"), Endpoint("b")])
        router.commit(make_request("big", tokens=5000), "a")
        d = router.route(make_request("x"))
        assert (d.target, d.branch) == ("b", "ext")
    finally:
        PRESETS_TABLE.pop("ext_least_tokens", None)
        PLUGINS["scorer"].pop("ext_inflight_tokens", None)
        sys.modules.pop("kvroute_ext_test", None)


def test_a_broken_entry_point_is_one_line_naming_it(tmp_path, monkeypatch):
    _dist(tmp_path, "kvroute_broken_test", "kvroute_no_such_module_xyz")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as exc:
        policyfiles.load_entry_points(force=True)
    msg = str(exc.value)
    assert "entry point 'kvroute_broken_test' (kvroute_no_such_module_xyz)" in msg and "\n" not in msg
    monkeypatch.undo()
    policyfiles.load_entry_points(force=True)  # the broken one is gone again


def test_branch_labels_are_plain_strings():
    assert Branch.PREFIX_HIT == "prefix-hit" and f"{Branch.RING_OVERFLOW}" == "ring-overflow"


def test_gateway_serves_a_composed_policy_and_labels_it():
    import openai

    from tests.gateway_harness import LiveDeployment

    dep = LiveDeployment(replicas=2, policy={"name": "mine", "cost": {"inflight": 1}, "branch": "composed-min"})
    try:
        c = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=20)
        c.chat.completions.create(model="emulated", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert dep.settle() == (0, 0, 0)
        assert dep.runtime.policy_name == "mine"
        text = dep.runtime.metrics.render().decode()
        assert 'kvroute_policy_branch_total{branch="composed-min",policy="mine"} 1.0' in text
    finally:
        dep.close()


def test_simulate_runs_a_preset_file_and_names_a_bad_one(tmp_path, capsys):
    import json

    from kvroute.cli import main

    f = tmp_path / "mine.yaml"
    f.write_text(PRESET_FILE)
    out = tmp_path / "r.json"
    try:
        rc = main(["simulate", "--workload", "chat", "--replicas", "2", "--max-requests", "60",
                   "--policy", "lmetric", "--policy-file", str(f), "--json", str(out)])
        assert rc == 0
        results = json.loads(out.read_text())["results"]
        assert set(results) == {"lmetric", "cache_then_lmetric"}
        assert set(results["cache_then_lmetric"]["branches"]) <= {"strong-hit", "lmetric"}
    finally:
        PRESETS_TABLE.pop("cache_then_lmetric", None)
    f.write_text(PRESET_FILE.replace("lmetric: 1", "lmetrik: 1"))
    assert main(["simulate", "--policy-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}:11:" in err and "unknown scorer 'lmetrik'" in err


def test_a_scenario_compares_an_inline_composition():
    from kvroute.sim.runner import run_scenario
    from kvroute.sim.scenario import parse_scenario

    composed = {"name": "p2c_tokens", "cost": {"inflight_tokens": 1}, "picker": "power_of_two", "branch": "p2c-tok"}
    try:
        sc = parse_scenario({"replicas": [{"region": "us", "count": 3}],
                             "workload": {"kind": "chat", "clients": {"us": 6}},
                             "policies": ["round_robin", composed], "limits": {"max_requests": 60}, "seed": 1})
        runs = {r.label: r.result for r in run_scenario(sc)}
        assert set(runs) == {"round_robin", "p2c_tokens"} and runs["p2c_tokens"]["branches"] == {"p2c-tok": 60}
    finally:
        PRESETS_TABLE.pop("p2c_tokens", None)


def test_the_policy_layer_reads_no_files_and_imports_no_packages():
    """policy/ and model/ are pure: no file reading, no entry-point imports, no clock
    (kvroute.policyfiles reads the files and loads the entry points)."""
    import ast
    from pathlib import Path

    import kvroute

    banned_modules = {"importlib.metadata", "time", "os", "pathlib", "asyncio", "socket"}
    banned_calls = {"open", "read", "load", "read_text", "entry_points", "sleep", "monotonic", "perf_counter"}
    root = Path(kvroute.__file__).parent
    found = []
    for pkg in ("policy", "model"):
        for f in (root / pkg).rglob("*.py"):
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    names = {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    names = {a.name for a in node.names}
                elif isinstance(node, ast.Call):
                    fn = node.func
                    names = {fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""}
                    if names & banned_calls:
                        found.append(f"{f.relative_to(root)}:{node.lineno} calls {names & banned_calls}")
                    continue
                else:
                    continue
                if names & banned_modules:
                    found.append(f"{f.relative_to(root)}:{node.lineno} imports {names & banned_modules}")
    assert found == []


def test_a_plugin_declaring_an_unknown_input_is_refused_at_registration():
    """A misspelt input would let the simulator skip the probe or event that keeps it fresh."""
    from kvroute.policy.plugins import Scorer

    class Typo(Scorer):
        name = "typo_scorer"
        inputs = frozenset({"kv_usgae"})

        def values(self, st, eps):
            return [e.kv_usage for e in eps]

    with pytest.raises(TypeError, match="unknown input.*kv_usgae.*inputs: prefix"):
        register_plugin(Typo)
    assert "typo_scorer" not in PLUGINS["scorer"]


def test_a_plugin_without_its_kinds_method_is_refused_at_registration():
    from kvroute.policy.plugins import Picker

    class NoPick(Picker):
        name = "no_pick"

    with pytest.raises(TypeError, match="must implement pick"):
        register_plugin(NoPick)


def test_an_instance_widening_its_inputs_is_checked_when_compiled():
    from kvroute.policy.plugins import Scorer

    class Widening(Scorer):
        name = "widening"

        def __init__(self, reads: str = "load"):
            self.inputs = frozenset({reads})

        def values(self, st, eps):
            return [0.0] * len(eps)

    register_plugin(Widening)
    assert policy_from_config({"cost": {"widening": {"weight": 1, "reads": "rtt"}}}).inputs == {"rtt"}
    with pytest.raises(ConfigError, match="unknown input.*ttr"):
        policy_from_config({"cost": {"widening": {"weight": 1, "reads": "ttr"}}})


def _local_first_state(eps):
    router = Router(build_policy("round_robin"), eps)
    return DecisionState(make_request("r", "x " * 20), router.view, router.policy.rng)


def test_local_first_keeps_free_nearby_replicas_and_every_candidate_otherwise():
    from kvroute.policy.builtin.filters import LocalFirst

    def eps():
        out = [Endpoint(f"e{i}", rtt_s=0.002 if i < 2 else 0.1) for i in range(4)]
        for e in out[2:]:
            e.running = 3  # the farther replicas run batches of 3
        return out

    f = LocalFirst(ms=10)
    got = eps()
    assert [e.id for e in f.filter(_local_first_state(got), got)] == ["e0", "e1"]
    got = eps()
    got[0].queued_prefill_tokens = 500  # this LB's prefill still queued there
    got[1].waiting = 1  # the probe saw a request waiting
    assert [e.id for e in f.filter(_local_first_state(got), got)] == ["e0", "e1", "e2", "e3"]  # spill
    got = eps()
    got[0].inflight = 4  # more of this LB's requests in flight than any farther replica's batch
    got[1].running, got[1].dispatched_since_probe = 2, 1
    assert [e.id for e in f.filter(_local_first_state(got), got)] == ["e1"]  # 3 <= 3: not the most loaded
    one_region = [Endpoint(f"e{i}", rtt_s=0.002 + 0.001 * i) for i in range(3)]
    one_region[0].queued_prefill_tokens = 100
    assert f.filter(_local_first_state(one_region), one_region) == one_region  # within 10 ms: all kept
    assert LocalFirst(on=False).filter(_local_first_state(got), got) == got
    with pytest.raises(ValueError, match="ms must be >= 0"):
        LocalFirst(ms=-1)
