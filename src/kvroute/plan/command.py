"""`kvroute plan FILE`: search, then print the cheapest deployment, the cost-vs-latency front and the headroom."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.table import Table

from kvroute.argtypes import int_at_least
from kvroute.parallel import add_arguments as add_parallel
from kvroute.plan import MIN_REQUESTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvroute plan` on the top-level subparsers."""
    p = sub.add_parser("plan", help="the cheapest replicas × hardware × regions × policy that meets an SLO")
    p.add_argument("plan", help="plan YAML (workload or scenario, SLO, hardware with prices, regions, residency), "
                   "or the name of a bundled one (kvroute/scenarios/plans/)")
    p.add_argument("--requests", type=int_at_least(MIN_REQUESTS),
                   help=f"requests per simulated run, {MIN_REQUESTS} or more (overrides the file)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="PNG", help="write the cost-vs-latency plot (every run, front, winner)")
    p.add_argument("--no-headroom", action="store_true", dest="no_headroom",
                   help="skip measuring how much more load the winner takes")
    p.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar on stderr")
    add_parallel(p)
    p.set_defaults(func=cmd_plan)


def resolve(path: str) -> str:
    """A plan file, or a bundled plan's name."""
    from kvroute.sim.scenario import SCENARIO_DIR

    bundled = SCENARIO_DIR / "plans" / f"{path}.yaml"
    return str(bundled) if not Path(path).exists() and bundled.is_file() else path


def cmd_plan(args: argparse.Namespace) -> int:
    """Run the search; exit 2 with one line for bad input or an SLO no configuration met (plus the closest)."""
    from kvroute.parallel import ExecutorError, make_executor
    from kvroute.plan.search import Planner
    from kvroute.plan.spec import load_plan
    from kvroute.policy import ConfigError
    from kvroute.report import console, err, error, write_json
    from kvroute.sim.scenario import ScenarioError

    try:
        spec = load_plan(resolve(args.plan))
        if args.requests is not None:
            spec = spec.model_copy(update={"requests": args.requests})
        executor = make_executor(args.workers, args.ray)
    except (ScenarioError, ConfigError, ExecutorError) as exc:
        return error(str(exc))
    t0 = time.perf_counter()
    with executor:
        try:
            planner = Planner(spec, executor)
        except (ScenarioError, ConfigError) as exc:
            return error(str(exc))
        err.print(f"[dim]plan {spec.name!r}: {len(planner.candidates)} candidates, runs on {executor.describe()}"
                  "[/dim]", highlight=False)
        answer = _with_progress(planner, args.no_progress)
        if answer["winner"] and not args.no_headroom:
            answer["headroom"] = planner.headroom(answer["winner"])
    answer["wall_s"] = round(time.perf_counter() - t0, 1)
    answer["runs"] = planner.runs
    answer["executor"] = executor.describe()
    for t in tables(answer):
        console.print(t)
    write_json(args.json, answer)
    if args.plot:
        console.print(f"wrote {plot(answer, args.plot)}")
    if answer["winner"] is None:
        c = answer["closest"]
        return error(f"no configuration meets the SLO (up to {spec.max_replicas} replicas); closest: "
                     f"{c['replicas']} × {c['candidate']} ({c['cost_per_hour']:.4g}/h): {'; '.join(c['broke'])}")
    w = answer["winner"]
    console.print(f"[bold]cheapest deployment meeting the SLO:[/bold] {w['replicas']} replicas "
                  f"({_regions(w)}) of {w['hardware']}, policy {w['policy']}, layout {w['layout']}: "
                  f"{w['cost_per_hour']:.4g}/h; {answer.get('headroom', {}).get('note', '')}", highlight=False)
    return 0


def _with_progress(planner, quiet: bool) -> dict:
    """The search with a progress bar and time-left estimate on stderr (none when ``quiet``)."""
    if quiet:
        return planner.run()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvroute.report import err

    with Progress(TextColumn("{task.description:<30}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("left"), TimeRemainingColumn(), console=err, transient=False) as bar:
        # the first estimate: a few probes per candidate; each round re-estimates from the brackets left
        task = bar.add_task("plan: simulated runs", total=len(planner.candidates) * 4)

        def step(done: int, expected: int, what: str) -> None:
            bar.update(task, completed=done, total=max(expected, done), description=f"plan: {what}")

        planner.progress = step
        return planner.run()


def _regions(p: dict) -> str:
    return ", ".join(f"{r} {n}" for r, n in p["per_region"].items())


def tables(answer: dict) -> list[Table]:
    """The front, the candidates' minimum sizes, and the closest miss when nothing passed."""
    metric, stat = answer["front_axis"].split(".")
    name = f"{metric[:-2].upper()} {stat} (s)"
    out = []
    front = Table(title=f"{answer['name']}: cost vs {name} Pareto front of the passing deployments "
                        f"({answer['runs']} simulated runs of {answer['requests_per_run']} requests)")
    extra = [(m, s, f"{m[:-2].upper()} {s} ({'ms' if m == 'tpot_s' else 's'})")
             for m, s in (("ttft_s", "p90"), ("tpot_s", "p90"), ("e2e_s", "p50")) if (m, s) != (metric, stat)]
    for col in ("cost (/h)", "replicas", "per region", "hardware", "policy", "layout", name,
                *(e[2] for e in extra), "goodput within SLO (%)"):
        front.add_column(col, justify="left" if col in ("per region", "hardware", "policy", "layout") else "right")
    for p in answer["front"]:
        mark = " ★" if p == answer["winner"] else ""
        cells = [f"{p[m][s] * (1000 if m == 'tpot_s' else 1):.3g}" for m, s, _ in extra]
        front.add_row(f"{p['cost_per_hour']:.4g}{mark}", str(p["replicas"]), _regions(p), p["hardware"], p["policy"],
                      p["layout"], f"{p[metric][stat]:.3f}", *cells, f"{p['attainment'] * 100:.1f}")
    out.append(front)
    cands = Table(title="fewest replicas meeting the SLO, per candidate")
    for col in ("candidate", "replicas", "cost (/h)", "runs", "note"):
        cands.add_column(col, justify="left" if col in ("candidate", "note") else "right")
    for label, c in answer["candidates"].items():
        cands.add_row(label, "–" if c["min_replicas"] is None else str(c["min_replicas"]),
                      "–" if c["cost_per_hour"] is None else f"{c['cost_per_hour']:.4g}", str(c["runs"]), c["note"])
    out.append(cands)
    return out


def plot(answer: dict, path: str) -> str:
    """Cost vs the front's latency: every run (passing filled, failing hollow), the front as a line, the winner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, stat = answer["front_axis"].split(".")
    fig, ax = plt.subplots(figsize=(8, 5))
    for cand in sorted({p["candidate"] for p in answer["points"]}):
        pts = [p for p in answer["points"] if p["candidate"] == cand]
        good = [p for p in pts if p["passes"]]
        bad = [p for p in pts if not p["passes"]]
        line = ax.scatter([p["cost_per_hour"] for p in good], [p[metric][stat] for p in good], label=cand, s=30)
        ax.scatter([p["cost_per_hour"] for p in bad], [p[metric][stat] for p in bad], s=30,
                   facecolors="none", edgecolors=line.get_facecolor())
    if answer["front"]:
        ax.plot([p["cost_per_hour"] for p in answer["front"]], [p[metric][stat] for p in answer["front"]],
                "k--", lw=1, label="Pareto front")
    if answer["winner"]:
        w = answer["winner"]
        ax.scatter([w["cost_per_hour"]], [w[metric][stat]], marker="*", s=250, c="gold", edgecolors="k",
                   label="cheapest meeting the SLO", zorder=5)
    ax.set_xlabel("cost per hour")
    ax.set_ylabel(f"{metric[:-2].upper()} {stat} (s)")
    ax.set_yscale("log")
    ax.set_title(f"{answer['name']} (hollow: misses the SLO)")
    ax.legend(fontsize=7)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
