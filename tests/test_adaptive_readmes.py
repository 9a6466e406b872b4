"""Each adaptive mechanism's README (policy/adaptive/<name>/README.md) stays true: its example
config compiles, and the parameters it lists are the plugin's own."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

from kvroute.policy import Policy, policy_from_config
from kvroute.policy.catalog import PLUGINS

ADAPTIVE = Path(__file__).resolve().parent.parent / "src/kvroute/policy/adaptive"

# folder → the plugin it documents (kind, registered name); the seed (from the policy's) is not listed
MECHANISMS = [("es_tuner", "scorer", "es"), ("ttft_fit", "scorer", "calibration"), ("hotspot", "route", "hotspot"),
              ("predictor", "scorer", "predictor"), ("selector", "condition", "ttft_selector"),
              ("replica_speed", "scorer", "lmetric_speed")]


def test_every_mechanism_folder_is_listed():
    assert sorted(p.parent.name for p in ADAPTIVE.glob("*/README.md")) == sorted(m[0] for m in MECHANISMS)


@pytest.mark.parametrize(("folder", "kind", "name"), MECHANISMS)
def test_the_readme_matches_its_plugin(folder, kind, name):
    text = (ADAPTIVE / folder / "README.md").read_text()
    assert text.startswith(f"# {name} ")
    assert f"**Type:** {kind} (`{name}`)" in text
    params = text.split("## Parameters", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`(\w+)` \(", params))
    accepted = set(inspect.signature(PLUGINS[kind][name].__init__).parameters) - {"self", "seed"}
    assert listed == accepted
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example is not None
    policy = policy_from_config(yaml.safe_load(example.group(1))["policy"], where=f"{folder}/README.md")
    assert isinstance(policy, Policy)
