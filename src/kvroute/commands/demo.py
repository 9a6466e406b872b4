"""`make demo` / `kvroute demo`: the main job, end to end.

1. A walk-through of every preset on sample requests: two users hold three-turn conversations
   over a shared system prompt while bursts of unrelated one-shot prompts arrive, on four
   replicas; where each request went, which branch decided, prefix reuse and load spread.
2. The routing benchmark, short.
3. A simulated comparison: SkyWalker's skewed 3-region setting under several presets, at a
   stated share of the setup's capacity knee (``DEMO_LOAD`` × ``KNEE_FACTOR``).
4. Live: for each of a few presets, a gateway in front of four emulated engines and 16 chat
   clients over real HTTP, with live progress and a summary table.
5. Live, 3 regions (``kvroute live``): region-local gateways vs SkyWalker's two layers vs GORGO's
   central proxy on skewed load, every process real and every cross-region link delayed, one
   gateway killed mid-run and restarted; the same scenario simulated beside it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from kvroute.argtypes import positive_float, positive_int
from kvroute.commands.simulate import run_simulation
from kvroute.model import Endpoint, Request
from kvroute.policy import PRESETS, Router, build_policy
from kvroute.prefix import BlockHasher, chat_key
from kvroute.report import console, err, routing_table, write_json

SYSTEM = "You are a meticulous assistant for an infrastructure team. Answer precisely. " * 12


def sample_requests() -> list[Request]:
    """Two users' three chat turns over a shared system prompt, interleaved with one-shot prompts: enough to
    show cache affinity and load spreading."""
    hasher = BlockHasher()
    reqs: list[Request] = []
    convs = {"alice": [{"role": "system", "content": SYSTEM}],
             "bob": [{"role": "system", "content": SYSTEM}]}
    for turn in range(3):
        for user, msgs in convs.items():
            msgs.append({"role": "user", "content": f"{user} question {turn}: " + "details " * 150})
            hashes, tokens = hasher(chat_key(msgs))
            reqs.append(Request(id=f"{user}-t{turn}", routing_key=user, block_hashes=hashes,
                                prompt_tokens=tokens, tenant=user))
            msgs.append({"role": "assistant", "content": f"answer {turn} for {user} " * 60})
        for k in range(3):
            text = f"one-shot prompt {turn}-{k} " + "unrelated words " * (60 + 20 * k)
            hashes, tokens = hasher(chat_key([{"role": "user", "content": text}]))
            reqs.append(Request(id=f"burst-{turn}-{k}", block_hashes=hashes, prompt_tokens=tokens))
    return reqs


@dataclass
class WalkResult:
    """What one preset did with the sample requests: (request, target, branch) per request, prefix tokens
    reused, requests per replica."""

    preset: str
    routes: list[tuple[str, str, str]]  # (request id, target, branch)
    hit_tokens: int
    prompt_tokens: int
    spread: list[int]


def walk(preset: str, reqs: list[Request]) -> WalkResult:
    """Route ``reqs`` through ``preset`` over four idle replicas, finishing requests now and then so load
    moves."""
    eps = [Endpoint(f"r{i}", waiting=0) for i in range(4)]
    router = Router(build_policy(preset), eps)
    routes, hit, total = [], 0, 0
    served = {e.id: 0 for e in eps}
    for i, req in enumerate(reqs):
        cached = router.prefix.match(req.block_hashes)  # what each replica holds before routing
        d = router.route(req)
        routes.append((req.id, d.target or "-", d.branch))
        if d.dispatched and d.target is not None:
            hit += req.prompt_tokens - req.new_prefill_tokens(cached.get(d.target, 0))
            total += req.prompt_tokens
            served[d.target] += 1
        if i % 3 == 2:  # requests finish now and then, so load moves
            for r in reqs[i - 2: i]:
                router.on_finish(r.id)
    for r in reqs:
        router.on_finish(r.id)
    assert all(e.inflight == 0 for e in eps)
    return WalkResult(preset, routes, hit, total, list(served.values()))


def walk_all() -> list[WalkResult]:
    """:func:`walk` for every registered preset on the same sample requests."""
    reqs = sample_requests()
    return [walk(name, reqs) for name in PRESETS]


def run_demo(out: str, decisions: int, sim_requests: int, live_policies: list[str], live_seconds: float,
             live_requests: int) -> None:
    """The `kvroute demo` tour (see :func:`cmd_demo`); writes its JSON and plots under ``out``."""
    from kvroute.bench import routing

    console.rule("[bold]kvroute demo: policy walk-through on sample requests")
    results = walk_all()
    table = Table(title="2 users × 3 chat turns over a shared system prompt, plus one-shot bursts; 4 replicas")
    table.add_column("preset", style="bold cyan")
    table.add_column("alice's turns →")
    table.add_column("branches taken")
    table.add_column("prefix reuse", justify="right")
    table.add_column("requests per replica", justify="right")
    for r in results:
        alice = " ".join(t for rid, t, _ in r.routes if rid.startswith("alice"))
        branches = ", ".join(sorted({b for _, _, b in r.routes}))
        table.add_row(r.preset, alice, branches, f"{r.hit_tokens / max(1, r.prompt_tokens):.0%}",
                      " ".join(map(str, r.spread)))
    console.print(table)
    console.rule("[bold]routing benchmark (short run)")
    result = routing.run(decisions=decisions)
    console.print(routing_table(result))
    console.print(f"index memory: {result['index_bytes_per_block']:.1f} bytes/block   "
                  f"220 KB chat keyed+hashed+routed: {result['chat_220kb_ms']:.2f} ms")
    write_json(str(Path(out) / "bench-routing.json"), result)

    from kvroute.sim.scenario import load_scenario, parse_scenario

    data = load_scenario(DEMO_SCENARIO).model_dump(exclude_none=True)
    base = data["workload"]["clients"]
    clients = data["workload"]["clients"] = demo_clients(base)
    data["limits"]["max_requests"] = sim_requests
    console.rule(f"[bold]simulated comparison: 3 regions, 12 L4 replicas, skewed clients "
                 f"{'/'.join(map(str, clients.values()))} = {DEMO_LOAD:.0%} of the capacity knee")
    console.print(load_statement(base))
    run_simulation(parse_scenario(data), str(Path(out) / "simulate.json"), str(Path(out) / "plots"))

    console.rule("[bold]live: gateway + 4 emulated replicas, chat clients over real HTTP")
    live = live_comparison(live_policies, live_seconds, live_requests)
    write_json(str(Path(out) / "live.json"), live)

    live_regions(out)


# The simulated table's load, relative to the setup's capacity knee. The knee: the highest load at
# which some policy still serves ≥ 90 % of requests within the default SLO (TTFT ≤ 5 s, TPOT ≤
# 100 ms), as `kvroute simulate chat-3region-skewed --sweep --max-requests 2000` finds it: x0.707
# of the file's 120/40/40 clients (sglang_cache_aware@global and gorgo@global, 6.88 req/s; round
# robin x0.403, skywalker x0.42), measured 2026-11-25 with SGLang admission and waiting gauge on the L4s.
# The demo runs at 70 % of it: loaded, below saturation for the best policy — where the papers
# compare (reproduction.md) — so the table shows who degrades first. Rerun the sweep after a
# model change and update KNEE_FACTOR (tests/test_demo_load.py checks both sides of the knee).
DEMO_SCENARIO = "chat-3region-skewed"
KNEE_FACTOR = 0.707
DEMO_LOAD = 0.7


def demo_clients(base: dict[str, int]) -> dict[str, int]:
    """The scenario's clients scaled to DEMO_LOAD of the knee (the sweep's rounding)."""
    return {r: max(1, round(n * KNEE_FACTOR * DEMO_LOAD)) for r, n in base.items()}


def load_statement(base: dict[str, int]) -> str:
    """One line saying how loaded the simulated table is (``base``: the scenario's own clients) and how
    the knee was found."""
    clients = demo_clients(base)
    knee = {r: round(n * KNEE_FACTOR) for r, n in base.items()}
    return (f"load: {'/'.join(map(str, clients.values()))} closed-loop clients (US/EU/Asia) = {DEMO_LOAD:.0%} of the "
            f"capacity knee ({'/'.join(map(str, knee.values()))} clients: the highest load at which a policy still "
            "serves ≥ 90 % of requests within TTFT ≤ 5 s and TPOT ≤ 100 ms, found by `kvroute simulate "
            f"{DEMO_SCENARIO} --sweep`)")


LIVE_SCENARIO = "live-3region-skewed"
LIVE_KILL = "gateway:eu@6s+4s"  # eu's gateway dies 6 s in and is back 4 s later


def live_regions(out: str, seconds: float = 12.0, drain_s: float = 10.0) -> dict:
    """Issue 10's live section: the bundled live-size skewed scenario, its three policies live,
    a gateway killed mid-run (clients fail over through the controller's /resolve, its replicas
    move to the nearest gateway), then the same scenario simulated and both side by side."""
    from kvroute.commands.live import execute
    from kvroute.live.faults import parse_fault
    from kvroute.sim.scenario import load_scenario

    sc = load_scenario(LIVE_SCENARIO)
    console.rule(f"[bold]live, 3 regions on 127.0.0.1: {sc.name}; {LIVE_KILL.replace('@', ' killed at ')} "
                 "(regional and two-layer runs)")
    rep = execute(sc, [parse_fault("kill", LIVE_KILL)], max_requests=sc.limits.max_requests, duration_s=seconds,
                  compare_sim=True, drain_s=drain_s)
    write_json(str(Path(out) / "live-3region.json"), rep)
    return rep


def live_comparison(policies: list[str], seconds: float, max_requests: int) -> dict:
    """Each policy in turn: a fresh emulated deployment, the same chat load, a summary row."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvroute.live.embedded import start_deployment
    from kvroute.live.loadgen import run_chat_load

    results: dict[str, dict] = {}
    with Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err) as progress:
        for policy in policies:
            task = progress.add_task(policy, total=max_requests)

            async def one(policy=policy, task=task) -> dict:
                dep = await start_deployment(replicas=4, policy=policy, port=0)
                try:
                    res = await run_chat_load(dep.url, clients=16, max_requests=max_requests, duration_s=seconds,
                                              on_done=lambda n: progress.update(task, completed=n))
                    summary = res.summary()
                    rt = dep.gateway.runtime
                    summary["inflight_after"] = sum(e.inflight for e in rt.router.endpoints)
                    return summary
                finally:
                    await dep.stop()

            results[policy] = asyncio.run(one())
    table = Table(title="live gateway, 4 emulated H100/Llama-3.2-3B replicas, 16 chat clients")
    for col in ("policy", "requests", "errors", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "req/s",
                "engine cache hits", "requests per replica"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for policy, s in results.items():
        table.add_row(policy, str(s["requests"]), str(s["errors"]), f"{s['ttft_p50_s'] * 1000:.0f} ms",
                      f"{s['ttft_p99_s'] * 1000:.0f} ms", f"{s['e2e_p50_s'] * 1000:.0f} ms",
                      f"{s['e2e_p99_s'] * 1000:.0f} ms", f"{s['throughput_rps']:.1f}",
                      f"{s['cached_ratio']:.1%}", " ".join(str(v) for v in s["replicas"].values()))
    console.print(table)
    return {"results": results}


def cmd_demo(args: argparse.Namespace) -> int:
    """`kvroute demo`: every preset routing sample chat turns, a short routing benchmark, a simulated
    three-region comparison and live runs over emulated replicas; JSON and plots go to --out."""
    run_demo(args.out, args.decisions, args.sim_requests, args.live_policies.split(","), args.live_seconds,
             args.live_requests)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the command."""
    demo = sub.add_parser("demo", help="the main job: walk-through, benchmark, simulation, gateway")
    demo.add_argument("--out", default="out", help="folder for JSON results and plots")
    demo.add_argument("--decisions", type=positive_int, default=500)
    demo.add_argument("--sim-requests", type=positive_int, default=3000, dest="sim_requests")
    demo.add_argument("--live-policies", default="round_robin,sglang_cache_aware,skywalker,lmetric",
                      dest="live_policies")
    demo.add_argument("--live-seconds", type=positive_float, default=10.0, dest="live_seconds",
                      help="time limit per policy for the live run")
    demo.add_argument("--live-requests", type=positive_int, default=400, dest="live_requests")
    demo.set_defaults(func=cmd_demo)
