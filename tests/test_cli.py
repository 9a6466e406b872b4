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


def test_the_readme_command_table_lists_each_commands_options():
    """Every row of README.md's command table names exactly the options `kvroute <cmd> --help` has."""
    import argparse
    import re
    from pathlib import Path

    from kvroute.commands import build_parser

    def sub(parser, name):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                return a.choices.get(name)
        return None

    rows = 0
    for line in (Path(__file__).parent.parent / "README.md").read_text().splitlines():
        m = re.match(r"\| `kvroute ([a-z-]+)(?: ([a-z-]+))?", line)
        if not m:
            continue
        cmd, name = sub(build_parser(), m.group(1)), m.group(1)
        if m.group(2) and sub(cmd, m.group(2)) is not None:
            cmd, name = sub(cmd, m.group(2)), f"{name} {m.group(2)}"
        usage = line.replace("\\|", "/").split("|")[1]  # the command cell; the other may cite other commands
        named = set(re.findall(r"--[a-z][a-z-]*", line))  # the description may list knobs
        named |= {"--" + f[len("--no-"):] for f in named if f.startswith("--no-")}  # --no-X: the X switch
        have = {o for a in cmd._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
        assert have <= named, (name, "missing", have - named)
        assert set(re.findall(r"--[a-z][a-z-]*", usage)) <= have, (name, "unknown", named - have)
        rows += 1
    assert rows >= 15
