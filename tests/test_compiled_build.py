"""The optional compiled build (issue 22, item 5): the modules listed in kvroute/buildinfo.py
compiled by mypyc give the same simulation results, byte for byte, as the pure-Python source.

One real compile per session (``KVROUTE_COMPILE=1 pip install --target``, as `make compiled`
does, about four and a half minutes of one core), shared by the tests here: started in the background
once the timed test_calibrate* files have run, with these tests moved to the end of the run
(tests/compile_harness.py).
The rest of the suite runs against the editable, pure-Python tree (docs/compiled.md says why).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_trace

import kvroute
from kvroute import buildinfo
from kvroute.sim import tracefiles
from tests import compile_harness

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvroute"


@pytest.fixture(scope="module")
def compiled() -> Path:
    """kvroute installed with its listed modules compiled, into a folder of its own: the compile
    tests/conftest.py started in the background during the run (compile_harness)."""
    return compile_harness.compiled_site()


def _kvroute(site: Path, *args: str, pure: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != buildinfo.PURE_ENV}
    env["PYTHONPATH"] = str(site)
    # an installed build finds no shared/ beside itself: point it at the checkout's bundled traces
    env.setdefault("KVROUTE_TRACES", str(tracefiles.DATA_DIR))
    if pure:
        env[buildinfo.PURE_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "kvroute", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_compiled_build_simulates_a_bundled_scenario_identically(compiled, tmp_path):
    version = _kvroute(compiled, "--version")
    assert f"all {len(buildinfo.COMPILED)} listed modules" in version.stdout, version.stdout + version.stderr
    assert "pure Python (KVROUTE_PURE=1)" in _kvroute(compiled, "--version", pure=True).stdout
    out = {}
    for build, pure in (("compiled", False), ("pure", True)):
        # seven presets, from round robin to the cache-aware ones: the sim core and the prefix index
        proc = _kvroute(compiled, "simulate", "chat-1region", "--seed", "7", "--max-requests", "1500",
                        "--json", str(tmp_path / f"{build}.json"), pure=pure)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[build] = (tmp_path / f"{build}.json").read_text()
    assert json.loads(out["compiled"])["results"], "no results"
    assert out["compiled"] == out["pure"]


def test_the_compiled_modules_are_compiled_and_the_rest_stays_source(compiled):
    listed = {compiled / "kvroute" / Path(*name.split(".")[1:]) for name in buildinfo.COMPILED}
    for stem in listed:
        assert list(stem.parent.glob(stem.name + ".*.so")), f"{stem} was not compiled"
    others = [p for p in (compiled / "kvroute").rglob("*.so") if p.with_suffix("").with_suffix("") not in listed]
    assert others == []


def test_the_source_tree_holds_no_compiled_module():
    """An editable checkout runs its .py files: a compiled module left beside one would be loaded
    instead (setup.py refuses in-place builds; `make clean` removes strays)."""
    assert sorted(SRC.rglob("*.so")) == []
    if Path(kvroute.__file__).parent == SRC:  # this suite runs against the checkout's source
        assert buildinfo.describe().startswith("pure Python")


def test_kvroute_pure_loads_the_listed_modules_from_source(compiled):
    code = ("import kvroute.sim.engine as e, kvroute.sim.simulation as s; "
            "print(e.__file__.endswith('.py'), s.__file__.endswith('.py'))")
    env = dict(os.environ, PYTHONPATH=str(compiled), **{buildinfo.PURE_ENV: "1"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.stdout.split() == ["True", "True"], proc.stderr


def test_the_compiled_gateway_passes_its_http_and_stream_tests(compiled):
    """The gateway's compiled per-request modules (issue 25) under the gateway's own tests: HTTP
    parsing and limits, hostile input (test_http_server: its refused bodies raised in the compiled
    proxy's accounting), the upstream client's faults, the stream splice and continuation —
    run in a process that imports kvroute from the compiled install."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(compiled), str(ROOT)]))
    env.pop(buildinfo.PURE_ENV, None)
    check = subprocess.run([sys.executable, "-c", "import kvroute.gateway.proxy as p; print(p.__file__)"], env=env,
                           capture_output=True, text=True)
    assert check.stdout.strip().endswith(".so"), check.stdout + check.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_http_units.py",
                           "tests/test_http_server.py", "tests/test_hot_path.py", "tests/test_continuation.py",
                           "tests/test_upstream_faults.py", "tests/test_gateway.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@needs_trace
def test_bench_sim_speed_measures_both_builds_in_one_run_and_finds_them_identical(compiled, tmp_path):
    out = tmp_path / "speed.json"
    proc = _kvroute(compiled, "bench", "sim-speed", "--skip-million", "--repeats", "1", "--presets", "round_robin",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["builds"]) == {"pure", "compiled"} and r["identical"] and r["build"] == "compiled"
    assert r["builds"]["compiled"]["per_preset"]["round_robin"]["build"].startswith("compiled (mypyc)")
    assert r["builds"]["pure"]["per_preset"]["round_robin"]["build"] == "pure Python (KVROUTE_PURE=1)"
    assert r["speedup"]["min"] > 0 and "compiled ÷ pure" in proc.stdout
