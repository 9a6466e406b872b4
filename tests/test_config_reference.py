"""docs/configuration.md documents every config key, generated from the pydantic models."""

from pathlib import Path

import pytest

from kvroute import docs_gen
from kvroute.cli import main
from kvroute.gateway.config import GatewayConfig
from kvroute.sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[1]


def test_docs_configuration_md_is_current():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert docs_gen.render_into(text) == text, (
        "docs/configuration.md is out of date with the config models: run `kvroute config-reference --write`")


@pytest.mark.parametrize("model", [GatewayConfig, Scenario])
def test_every_key_has_a_row_with_a_meaning(model):
    rows = {key: rest for key, *rest in docs_gen.rows(model)}
    assert set(model.model_fields) <= set(rows)
    missing = [key for key, (_, _, meaning) in rows.items() if not meaning]
    assert not missing, (f"config keys without a meaning: {', '.join(missing)}; give the field a "
                         "description= or a comment, then run `kvroute config-reference --write`")


def test_rows_show_types_bounds_defaults_and_nesting():
    rows = {key: rest for key, *rest in docs_gen.rows(GatewayConfig)}
    assert rows["port"][:2] == ["integer (≥ 0, ≤ 65535)", "`8000`"]
    assert rows["replicas[].url"][1] == "required"
    assert rows["replicas[].engine"][0] == "`auto` or `vllm` or `sglang` or `llamacpp`"
    assert rows["tokenizer_path"][1] == "unset"
    assert rows["session_headers"][1] == "`[x-session-id, x-hash-key, x-user-id]`"
    assert rows["probe.interval_s"][2] == "SkyWalker probes every 100 ms"  # from the source comment
    sc = {key: rest for key, *rest in docs_gen.rows(Scenario)}
    assert "workload.shapes.<key>.depth" in sc and "balancers[].manages" in sc


def test_the_readme_links_the_reference():
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()


def test_cli_write_and_check(tmp_path, capsys):
    doc = tmp_path / "conf.md"
    doc.write_text(f"# intro\n\n{docs_gen.BEGIN}\nstale\n{docs_gen.END}\n\nafter\n")
    assert main(["config-reference", "--check", str(doc)]) == 1
    assert "run `kvroute config-reference --write`" in capsys.readouterr().err
    assert main(["config-reference", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# intro\n\n") and text.endswith("\n\nafter\n") and "`replicas[].url`" in text
    assert main(["config-reference", "--check", str(doc)]) == 0
    doc.write_text("no markers\n")
    assert main(["config-reference", "--write", str(doc)]) == 2
    assert "put the two marker lines" in capsys.readouterr().err
    assert main(["config-reference"]) == 0
    assert "| `workload.kind` |" in capsys.readouterr().out
