import json
import subprocess
import sys

from kvroute.bench import routing
from kvroute.cli import main
from kvroute.policy import PRESETS


def test_policies_json_lists_every_preset(capsys):
    assert main(["policies", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == set(PRESETS)
    assert out["sglang_cache_aware"]["params"]["balance_abs"] == 32
    assert all(v["description"] and v["source"] for v in out.values())


def test_cli_entry_point_runs_as_a_process():
    proc = subprocess.run([sys.executable, "-m", "kvroute.cli", "policies"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "skywalker" in proc.stdout


def test_bench_routing_small_run_has_the_documented_shape(monkeypatch):
    monkeypatch.setattr(routing, "INDEX_BLOCKS", 20_000)
    result = routing.run(decisions=20)
    assert set(result["presets"]) == set(PRESETS)
    for r in result["presets"].values():
        assert set(r) == {"p50_us_8k", "p99_us_8k", "p50_us_32k", "p99_us_32k"}
        assert 0 < r["p50_us_8k"] <= r["p99_us_8k"]
    assert result["index_bytes_per_block"] > 0 and result["chat_220kb_ms"] > 0
