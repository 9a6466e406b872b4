"""`kvroute bench plan`: the same capacity plan on 1 worker and on N, the speedup, and that the answers agree.

The plan is the bundled ``skywalker-cost`` (SkyWalker's Fig. 10 setup, cross-region vs region-local
load balancing) with both layouts, so each search round hands the executor four independent runs.
Each size is timed once, without a progress bar; the machine's load average before and after is
reported, since other work on a shared machine takes cores from the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run(workers: tuple[int, ...] = (1, 2), requests: int = 800, ray: str | None = None) -> dict:
    """Plan once per worker count (and on ``ray`` if given); wall times, speedups over 1 worker, answers equal."""
    # imported here: the simulator needs the [sim] extra, and parsing the command line must not
    from kvroute.parallel import make_executor
    from kvroute.plan.command import resolve
    from kvroute.plan.search import Planner
    from kvroute.plan.spec import load_plan

    spec = load_plan(resolve("skywalker-cost")).model_copy(update={"requests": requests,
                                                                   "layouts": ["even", "by-clients"]})
    out: dict = {"plan": "skywalker-cost", "requests_per_run": requests, "cpu_count": os.cpu_count(),
                 "load_before": [round(x, 2) for x in os.getloadavg()], "runs": {}}
    answers = {}
    for label, kw in [(f"{n} worker{'s' if n > 1 else ''}", {"workers": n}) for n in workers] + (
            [(f"ray {ray}", {"ray": ray})] if ray else []):
        with make_executor(**kw) as ex:
            t0 = time.perf_counter()
            answer = Planner(spec, ex).run()
            wall = time.perf_counter() - t0
        answers[label] = json.dumps(answer, sort_keys=True)
        out["runs"][label] = {"wall_s": round(wall, 2), "simulations": answer["runs"], "executor": ex.describe(),
                              "winner": answer["winner"]["candidate"] if answer["winner"] else None}
    base = out["runs"][next(iter(out["runs"]))]["wall_s"]
    for r in out["runs"].values():
        r["speedup"] = round(base / r["wall_s"], 2)
    out["answers_identical"] = len(set(answers.values())) == 1
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return out


def add_parser(bench: argparse._SubParsersAction) -> None:
    """Register `kvroute bench plan`."""
    p = bench.add_parser("plan", help="capacity-plan wall time on 1 vs N workers (and a Ray cluster)")
    p.add_argument("--workers", default="1,2", help="worker counts to time, comma-separated (default 1,2)")
    p.add_argument("--requests", type=int, default=800, help="requests per simulated run (default 800)")
    p.add_argument("--ray", metavar="ADDRESS", help="also time the plan on this Ray cluster")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    """Print the timing table; exit 2 for a bad worker list or an unreachable Ray address."""
    from rich.table import Table

    from kvroute.parallel import ExecutorError
    from kvroute.report import console, error, write_json

    try:
        workers = tuple(int(x) for x in args.workers.split(","))
        if not workers or min(workers) < 1:
            raise ValueError
    except ValueError:
        return error(f"--workers {args.workers!r}: expected positive integers, comma-separated (e.g. 1,2)")
    try:
        result = run(workers, args.requests, args.ray)
    except ExecutorError as exc:
        return error(str(exc))
    t = Table(title=f"kvroute plan skywalker-cost ({result['requests_per_run']} requests per run), "
                    f"{result['cpu_count']} cores; load average before {result['load_before'][0]}, "
                    f"after {result['load_after'][0]}")
    for col in ("executor", "simulations", "wall (s)", "speedup"):
        t.add_column(col, justify="left" if col == "executor" else "right")
    for r in result["runs"].values():
        t.add_row(r["executor"], str(r["simulations"]), f"{r['wall_s']:.1f}", f"{r['speedup']:.2f}×")
    console.print(t)
    console.print("answers identical on every executor" if result["answers_identical"]
                  else "[red]answers DIFFER between executors[/red]")
    write_json(args.json, result)
    return 0 if result["answers_identical"] else 1
