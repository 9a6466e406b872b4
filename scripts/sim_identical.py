"""Check that a refactoring leaves simulation results unchanged (issue 18).

    python scripts/sim_identical.py record DIR [--seed 7] [--only NAME...] [--src TREE/src]
    python scripts/sim_identical.py compare BEFORE_DIR AFTER_DIR             # exit 1 on any difference

``record`` runs ``kvroute simulate <scenario> --seed S --json DIR/<name>.json`` for every bundled
scenario (src/kvroute/scenarios/*.yaml and reproduce/*.yaml), one at a time; ``--src`` runs the
kvroute of another checkout (e.g. ``git worktree add /tmp/before main``) on the same scenarios. ``compare`` diffs the
JSON files key by key and prints every differing path. Equality is exact (the metrics round to 6
decimals); ``--rel R`` also accepts floats within a relative R and lists them apart, for the few
unrounded statistics (e.g. a policy's ``policy_state``) where summing the same terms in another
order moves the 16th digit. Wall-clock fields (none today) would be listed in IGNORED.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "src/kvroute/scenarios").glob("*.yaml")) + sorted(
    (ROOT / "src/kvroute/scenarios/reproduce").glob("*.yaml"))
IGNORED: set[str] = set()


def name_of(path: Path) -> str:
    return ("reproduce-" if path.parent.name == "reproduce" else "") + path.stem


def record(out: Path, seed: int, only: list[str], src: Path | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(src.resolve())) if src else None
    rc = 0
    for sc in SCENARIOS:
        name = name_of(sc)
        if only and name not in only:
            continue
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "kvroute", "simulate", str(sc), "--seed", str(seed),
                               "--json", str(out / f"{name}.json")], capture_output=True, text=True, env=env)
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        print(f"{name}: rc={proc.returncode} {time.monotonic() - t0:.1f} s", flush=True)
        rc |= proc.returncode
    return rc


def diff(a: object, b: object, path: str, out: list[str], near: list[str], rel: float) -> None:
    if path in IGNORED:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'after' if k not in a else 'before'}")
            else:
                diff(a[k], b[k], f"{path}.{k}", out, near, rel)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{path}[{i}]", out, near, rel)
    elif isinstance(a, float) and isinstance(b, float) and a != b and abs(a - b) <= rel * max(abs(a), abs(b)):
        near.append(f"{path}: {a!r} ~ {b!r}")
    elif a != b:
        out.append(f"{path}: {a!r} != {b!r}")


def compare(before: Path, after: Path, rel: float) -> int:
    bad = 0
    for f in sorted(before.glob("*.json")):
        g = after / f.name
        if not g.is_file():
            print(f"{f.stem}: missing after")
            bad += 1
            continue
        out: list[str] = []
        near: list[str] = []
        diff(json.loads(f.read_text()), json.loads(g.read_text()), f.stem, out, near, rel)
        verdict = f"{len(out)} differences" if out else "identical"
        if near:
            verdict += f"; {len(near)} float(s) equal within {rel:g} relative"
        print(f"{f.stem}: {verdict}")
        for line in (out + near)[:20]:
            print("   ", line)
        bad += bool(out)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("dir", type=Path)
    r.add_argument("--seed", type=int, default=7)
    r.add_argument("--only", nargs="*", default=[])
    r.add_argument("--src", type=Path, help="the src/ folder of the checkout to run (default: this one)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--rel", type=float, default=0.0)
    a = ap.parse_args()
    return record(a.dir, a.seed, a.only, a.src) if a.cmd == "record" else compare(a.before, a.after, a.rel)


if __name__ == "__main__":
    sys.exit(main())
