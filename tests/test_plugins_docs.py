"""docs/policies.md lists every preset's plugins and parameters, generated from the registry."""

from pathlib import Path

from kvroute.cli import main
from kvroute.policy import PRESETS
from kvroute.policy.listing import describe_presets, presets_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_docs_policies_md_is_current():
    text = (ROOT / "docs" / "policies.md").read_text()
    assert presets_markdown() == text, "docs/policies.md is out of date: run `kvroute policies --write`"


def test_every_preset_documents_its_params_and_plugins():
    out = describe_presets()
    assert set(out) == set(PRESETS)
    for name, d in out.items():
        assert d["description"] and d["source"], name
        assert all(d["param_docs"].values()), f"{name}: a parameter without a description"
        assert d["plugins"]["rules"], name
    assert out["skywalker"]["plugins"]["rules"][0] == {
        "branch": "prefix-hit", "when": ["hit_ratio_at_least(0.5)"], "among": ["best_prefix"],
        "cost": {"inflight": 1.0}, "picker": "argmin"}


def test_policies_write_and_plugins_listing(tmp_path, capsys):
    target = tmp_path / "policies.md"
    assert main(["policies", "--write", str(target)]) == 0
    assert target.read_text() == presets_markdown()
    assert main(["policies", "--plugins", "--json"]) == 0
    import json

    kinds = json.loads(capsys.readouterr().out)
    assert {"filter", "scorer", "condition", "picker", "route"} <= set(kinds)
    assert "lmetric" in kinds["scorer"] and "best_prefix" in kinds["filter"]
