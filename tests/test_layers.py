"""Layering (issue 18): the pure layers open no data file on import, and every built-in preset
compiles with its defaults (they are no longer compiled on import)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.policy import PRESETS, build_policy

AUDIT = """
import os, sys
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.fsdecode(args[0]))
    elif event in ("os.listdir", "os.scandir") and args and args[0] is not None:
        d = os.fsdecode(args[0])
        if not os.path.exists(os.path.join(d, "__init__.py")):  # not the import system's own listing
            opened.append(d + "/")
sys.addaudithook(hook)
import {module}
pkg = os.path.dirname(sys.modules["kvroute"].__file__)
data = [p for p in opened if (p.startswith(pkg) and not p.endswith((".py", ".pyc")))
        or p.endswith((".yaml", ".yml", ".json", ".jsonl"))]
print("\\n".join(data))
"""


@pytest.mark.parametrize("module", ["kvroute.policy", "kvroute.perf", "kvroute.sim.engine"])
def test_importing_a_pure_layer_opens_no_data_file(module):
    out = subprocess.run([sys.executable, "-c", AUDIT.format(module=module)], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "", f"importing {module} opened: {out}"


def test_a_profile_name_needs_the_runtime_source():
    """Without start-up the policy layer cannot turn a profile name into a profile: a clear error,
    not a file read from inside the pure layer."""
    code = ("from kvroute.policy import build_policy\n"
            "try:\n    build_policy('llm_d', {'profile': 'h20-qwen3-30b-a3b'})\nexcept Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "no profile source is installed" in out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_compiles_with_its_defaults(name):
    assert build_policy(name).describe()


LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is a dev dependency")
@pytest.mark.parametrize(("module", "line", "broken"), [
    ("policy/base.py", "import kvroute.gateway.server", "layers"),  # an upward import
    ("sim/engine.py", "import kvroute.sim.simulation", "no import cycles"),  # a cycle inside a layer
    ("policy/router.py", "import yaml", "do no I/O"),  # a file format in the pure layer
])
def test_make_lint_fails_on_an_upward_import_a_cycle_or_io_in_the_pure_layers(tmp_path, module, line, broken):
    """The contracts `make lint` runs (pyproject.toml), on a copy of the package with one bad import."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "src" / "kvroute", tmp_path / "src" / "kvroute",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", tmp_path)
    target = tmp_path / "src" / "kvroute" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"))
    clean = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout[-2000:]
    proc = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert any(broken in ln and "BROKEN" in ln for ln in proc.stdout.splitlines()), proc.stdout[-2000:]
