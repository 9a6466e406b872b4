"""`kvroute bench pd`: aggregated vs disaggregated vs conditional serving, in the simulator.

Four engines of one profile (default ``h100-llama3.2-3b``, whose decode step is derived from
memory bandwidth — the property disaggregation exploits: a decode batch costs little more than
one sequence) serve each workload at several request rates, laid out four ways on the same
hardware:

* **aggregated** — 4 mixed engines, the ``sglang_cache_aware`` preset;
* **disaggregated** — 2 prefill + 2 decode engines, every request split (prefill engine by
  ``sglang_cache_aware``, decode engine by ``pd_decode``);
* **conditional** — the same 2 + 2, split only when the decode engine would compute at least
  ``threshold`` uncached tokens itself (llm-d's decider), else served whole by the decode engine;
* **adaptive** — the same 2 + 2 with kvroute's ``pd_adaptive`` rule.

Workloads: ``chat`` (the synthetic open-loop chat, ``chat-poisson``: multi-turn conversations
whose previous answer joins the next prompt) and ``long`` (the Mooncake conversation trace,
Poisson re-timed: prompts of thousands to over 100K tokens). Per run: goodput (requests/s that
met both the TTFT and the TPOT objective), TPOT p99, TTFT p99, the transfer's mean share of TTFT
of split requests, and whether the run was stable (served ≈ offered, no growing backlog: an
unstable run is saturated, and its goodput is a lower bound of nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.sim.scenario import parse_scenario
from kvroute.sim.simulation import Simulation


@dataclass(frozen=True)
class Workload:
    """One workload of the benchmark: its scenario ``workload`` block, rates and SLO."""

    name: str
    spec: dict[str, Any]
    rates: tuple[float, ...]
    slo_ttft_s: float
    slo_tpot_s: float
    requests: int


# Rates span an idle to a saturated fleet; SLOs are DistServe-style pairs: TTFT a few times an
# idle prefill of a typical prompt, TPOT about 3x (chat) and 6x (long) the idle decode step (3.1 ms
# on the default profile). They were set after one look at idle latencies, identical for every
# layout, and the table also gives TPOT and TTFT percentiles, which do not depend on them.
WORKLOADS = (
    Workload("chat", {"kind": "chat-poisson"}, (10.0, 20.0, 40.0, 80.0), 1.0, 0.01, 1500),
    Workload("long", {"kind": "mooncake", "max_prompt_tokens": 32000}, (1.0, 2.0, 4.0, 8.0), 5.0, 0.02, 600),
)


@dataclass
class Layout:
    """How the four engines are used."""

    name: str
    roles: tuple[tuple[str, int], ...]
    pd: dict[str, Any] | None = None
    policy: str = "sglang_cache_aware"
    notes: list[str] = field(default_factory=list)


def layouts(threshold: int) -> list[Layout]:
    """The four layouts compared (module docstring)."""
    pd_roles = (("prefill", 2), ("decode", 2))
    return [Layout("aggregated", (("mixed", 4),)),
            Layout("disaggregated", pd_roles, {"disaggregate": "always"}, "pd_decode"),
            Layout("conditional", pd_roles, {"disaggregate": {"pd_uncached_at_least": threshold}}, "pd_decode"),
            Layout("adaptive", pd_roles, {"disaggregate": {"pd_adaptive": {"profile": "$profile"}}}, "pd_decode")]


def run_one(w: Workload, layout: Layout, rate: float, profile: str, seed: int, requests: int) -> dict[str, Any]:
    """Simulate one (workload, layout, rate); the row's numbers."""
    pd = None
    if layout.pd is not None:
        pd = {k: v for k, v in layout.pd.items()}
        dis = pd.get("disaggregate")
        if isinstance(dis, dict) and "pd_adaptive" in dis:
            pd["disaggregate"] = {"pd_adaptive": {"profile": profile}}
    data: dict[str, Any] = {
        "name": f"bench pd {w.name}", "seed": seed,
        "replicas": [{"region": "us", "count": n, "profile": profile, "role": role} for role, n in layout.roles],
        "workload": {**w.spec, "rate": rate, "clients": {"us": 1}},
        "limits": {"max_requests": requests}, "slo": {"ttft_s": w.slo_ttft_s, "tpot_s": w.slo_tpot_s},
        "policies": [layout.policy]}
    if pd is not None:
        data["pd"] = pd
    sc = parse_scenario(data, f"bench pd {w.name}/{layout.name}")
    entry = sc.policy_list()[0]
    res = Simulation(sc.setup(entry.topology), entry.preset, entry.params, sc.make_workload()).run()
    slo, load = res["slo"], res["load"]
    pd_res = res.get("pd") or {}
    share = (pd_res.get("transfer_share_of_ttft") or {}).get("mean")
    return {"workload": w.name, "layout": layout.name, "rate": rate,
            "goodput_rps": slo.get("goodput_rps"), "slo_met": slo.get("attainment"),
            "tpot_p99_ms": round(res["tpot_s"]["p99"] * 1000, 2), "ttft_p99_s": round(res["ttft_s"]["p99"], 3),
            "ttft_p50_s": round(res["ttft_s"]["p50"], 3),
            "transfer_share": None if share is None else round(share, 4),
            "split_share": pd_res.get("split_share"), "stable": bool(load.get("stable")),
            "served_rps": load.get("served_rps"), "offered_rps": load.get("offered_rps"),
            "failed": sum(res["failed"].values())}


def run_bench(profile: str = "h100-llama3.2-3b", seed: int = 0, threshold: int = 512, scale: float = 1.0,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every workload × layout × rate; ``scale`` shrinks the request counts (``--quick``)."""
    rows = []
    for w in WORKLOADS:
        n = max(50, int(w.requests * scale))
        for rate in w.rates:
            for layout in layouts(threshold):
                if progress is not None:
                    progress(f"{w.name} {layout.name} {rate:g} req/s")
                rows.append(run_one(w, layout, rate, profile, seed, n))
    return {"profile": profile, "seed": seed, "threshold": threshold, "engines": 4,
            "workloads": [{"name": w.name, "workload": w.spec, "rates": list(w.rates), "slo_ttft_s": w.slo_ttft_s,
                           "slo_tpot_s": w.slo_tpot_s, "requests": max(50, int(w.requests * scale))}
                          for w in WORKLOADS],
            "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    """The benchmark's table, one row per (workload, rate, layout)."""
    out = [f"Profile {result['profile']}, 4 engines, seed {result['seed']}, conditional threshold "
           f"{result['threshold']} uncached tokens.", ""]
    for w in result["workloads"]:
        out += [f"**{w['name']}** ({w['workload']['kind']}, {w['requests']} requests per run; SLO: TTFT ≤ "
                f"{w['slo_ttft_s']:g} s and TPOT ≤ {w['slo_tpot_s'] * 1000:g} ms)", "",
                "| rate (req/s) | layout | goodput (req/s) | SLO met | TPOT p99 (ms) | TTFT p50 / p99 (s) | "
                "transfer share of TTFT | split | stable |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            if r["workload"] != w["name"]:
                continue
            share = "—" if r["transfer_share"] is None else f"{r['transfer_share'] * 100:.1f} %"
            split = "—" if r["split_share"] is None else f"{r['split_share'] * 100:.0f} %"
            met = "—" if r["slo_met"] is None else f"{r['slo_met'] * 100:.0f} %"
            out.append(f"| {r['rate']:g} | {r['layout']} | {r['goodput_rps']:.2f} | {met} | {r['tpot_p99_ms']} | "
                       f"{r['ttft_p50_s']} / {r['ttft_p99_s']} | {share} | {split} | "
                       f"{'yes' if r['stable'] else 'no (saturated)'} |")
        out.append("")
    return "\n".join(out)
