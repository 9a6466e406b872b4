"""GORGO v1 (001_55e1ee0b5e0d1fc8.txt) and v2 (003_d2195008674d8fa4.txt) against the simulator.

Setups: ``kvroute/scenarios/reproduce/gorgo-v1.yaml`` (three regions, one A100/Mistral-7B each, one load
generator keeping 10 chat requests in flight; distributed GORGO local-first with peer forwarding, the
baselines choosing among every region's server, vs one central proxy) and ``gorgo-v2.yaml`` (one proxy in Ashburn,
three single-engine regions, a Mooncake-format trace; GORGO with the paper's learned weights vs
session affinity). GORGO v2's protocol: ``gorgo_tuned`` tunes online on the scenario's requests
(the tuning window, replayed at the paper's Apr 5 request rate); its learned weights are then frozen and
compared with session affinity on held-out windows (the trace's next two stretches of as many requests,
each replayed from time 0 at the rate the paper ran Apr 6 and Apr 7 at, time_scale 2.0 and 3.0: PAPER_RPS).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import islice

from kvroute.reproduce.common import (
    DIRECTION,
    NO,
    YES,
    Lab,
    Row,
    fmt_range,
    ratio_agreement,
    unstable_note,
)
from kvroute.sim.scenario import Scenario
from kvroute.sim.simulation import Simulation
from kvroute.workload import SimRequest, Workload


class TraceWindow(Workload):
    """Requests ``start`` … ``start + count`` of an open-loop workload, re-timed to begin at 0
    (GORGO v2's held-out windows are later stretches of the same trace)."""

    name = "window"

    def __init__(self, inner: Workload, start: int, count: int):
        self.inner, self.start, self.count = inner, start, count

    def arrivals(self) -> Iterator[SimRequest]:
        """The window's requests, first arrival at time 0."""
        t0 = None
        for sreq in islice(self.inner.arrivals(), self.start, self.start + self.count):
            if t0 is None:
                t0 = sreq.req.arrival_s
            sreq.req.arrival_s -= t0
            yield sreq


# The paper's offered request rate in each window (req/s), which the stand-in trace's windows are re-timed to:
# 0, the tuning window (Apr 5 at its own rate): 7,195 requests in 30 minutes (Table 2); §4: "Due to the greater
# number of requests in Apr 6-7, we increase time_scale to 2.0 and 3.0, respectively": 1, Apr 6: 7,630 requests
# (Table 2) over 30 minutes × 2.0; 2, Apr 7: Table 3's 11,327 input tok/s at time_scale 3.0 over Table 4's
# 7,148-token mean prompt. (Tables as in the released paper/workshop/paper.tex, Arcadia-Research-Team/GORGO.)
PAPER_RPS = {0: 7195 / 1800, 1: 7630 / 3600, 2: 11327 / 7148}
# App. D (Table 7): the Apr 2 12:30-13:00 window, 3,071 requests (no time_scale stated: read as its own rate), where
# "the evolutionary strategy learns to set w_queue to 0 while keeping w_rtt near 0.23", against Table 7's baselines
APPD_RPS = 3071 / 1800
APPD_BASELINES = (("session affinity", "consistent_hash"), ("least-load", "least_load"),
                  ("least-request", "least_request"), ("random", "random"), ("prefix-cache", "aibrix_prefix_cache"))
# §5 "Load Sweep" (Table 3) sweeps Apr 7 (its input rate at time_scale 1.0, 34,064 tok/s, is Apr 7's 540 users ×
# 16.4 requests × 7,148 tokens over 30 minutes within 3 %, where Apr 5 and 6 give 27.5K and 29.7K): the stand-in
# for Apr 7 is held-out window 2, replayed at Table 3's time_scale 1.0 rate and at 3.0 (PAPER_RPS[2])
SWEEP_FULL_RPS = 34064 / 7148
HEAVIER_FACTORS = (0.7, 0.5)  # kvroute's check: the tuner with the tuning window compressed further
OTHER_SEEDS = (2, 3)  # kvroute's check at one seed: where the tuner ends in the same run with other seeds
# (judged over several seeds, `reproduce --seeds N`, the row lists where each seed's own run ends instead)


def native_rps(sc: Scenario, window: int, n: int) -> float:
    """Requests per second of the ``window``-th stretch of ``n`` requests of ``sc``'s trace at time_scale 1."""
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"time_scale": 1.0}),
                               "limits": sc.limits.model_copy(update={"max_requests": n * (window + 1)})})
    last = 0.0
    for sreq in TraceWindow(sc.make_workload(), n * window, n).arrivals():
        last = sreq.req.arrival_s
    return n / last


def paper_scale(sc: Scenario, window: int, n: int, rps: float | None = None) -> float:
    """The time_scale that replays that stretch at ``rps`` (default: the paper's rate for the window,
    :data:`PAPER_RPS`)."""
    return native_rps(sc, window, n) / (rps or PAPER_RPS[window])


def held_out(lab: Lab, window: int, policies: list[tuple[str, dict]], rps: float | None = None) -> dict[str, dict]:
    """Run ``policies`` on the ``window``-th held-out stretch (1, 2) of the gorgo-v2 trace at ``rps`` (default:
    the paper's offered rate for that window, :data:`PAPER_RPS`)."""
    key = f"gorgo-v2-heldout{window}-{rps}-{policies!r}"
    if key in lab.runs:
        return lab.runs[key]
    sc = lab.scenario("gorgo-v2")
    # as many requests per window as the tuning run (fewer with --quick)
    n = sc.limits.max_requests or 3000
    scale = paper_scale(sc, window, n, rps)
    sc = lab.scenario("gorgo-v2", overrides={"workload": {"time_scale": scale}})
    sc = sc.model_copy(update={"limits": sc.limits.model_copy(update={"max_requests": n * (window + 1)})})
    out = {}
    for preset, params in policies:
        wl = TraceWindow(sc.make_workload(), n * window, n)
        out[preset if not params else f"{preset}{params}"] = Simulation(sc.setup(None), preset, params, wl).run()
    lab.runs[key] = out
    lab.meta[key] = {"scenario": "reproduce/gorgo-v2", "overrides": {"held_out_window": window,
                                                                     "time_scale": round(scale, 4)},
                     "requests": n, "wall_s": 0.0,
                     "unstable": [lbl for lbl, r in out.items() if not r["load"]["stable"]]}
    return out


def tuner_state(result: dict) -> dict[str, float]:
    """The (1+1)-ES's exported state in a simulate result, keyed without its plugin prefix."""
    return {k.rsplit(".", 1)[-1]: v for k, v in result.get("policy_state", {}).items()}


LEARNED = "gorgo(w_queue=0.5,w_rtt=0.276)"
# GORGO v2 §4's other baselines, by their kvroute presets
BASELINES_V2 = (("least-load", "least_load"), ("least-request", "least_request"),
                ("prefix-cache", "aibrix_prefix_cache"))
HACKED = {"w_rtt": 0.23, "w_queue": 0.0}


def _pick(results: dict, preset: str, topology: str) -> dict:
    """The one result of ``preset`` run on ``topology`` (labels carry the scenario's params)."""
    found = [v for k, v in results.items() if k.split("(")[0].split("@")[0] == preset and k.endswith(f"@{topology}")]
    if len(found) != 1:
        raise KeyError(f"gorgo-v1: expected one {preset}@{topology} run, found {len(found)}")
    return found[0]


def _remote_share(result: dict) -> float:
    """Share of requests served outside their client's region."""
    return result["by_path"].get("remote", {}).get("requests", 0) / max(1, result["requests"])


def rows_v1(lab: Lab) -> list[Row]:
    """GORGO v1's TTFT claims (central proxy vs least-load, prefix-trie and distributed GORGO; distributed
    GORGO's P99), paper beside simulator."""
    r = lab.run("gorgo-v1")
    proxy = _pick(r, "gorgo", "global")
    dist = _pick(r, "gorgo", "two-layer")
    others = {"least-load": _pick(r, "least_load", "distributed"),
              "prefix-trie": _pick(r, "sglang_cache_aware", "distributed"), "distributed GORGO": dist}
    note = unstable_note(lab, "gorgo-v1")
    ratios = [o["ttft_s"]["p50"] / proxy["ttft_s"]["p50"] for o in others.values()]
    agree = ratio_agreement(ratios, 2.4, 2.5)
    itl = f"TPOT p50 {proxy['tpot_s']['p50'] * 1000:.1f} ms behind the proxy vs {dist['tpot_s']['p50'] * 1000:.1f} ms"
    text = (f"{proxy['ttft_s']['p50'] * 1000:.0f} vs "
            + " / ".join(f"{o['ttft_s']['p50'] * 1000:.0f}" for o in others.values())
            + f" ms ({fmt_range(ratios)}; {itl})" + note)
    why = ("" if agree == YES else
           "checked: §5 credits the proxy's \"information advantage\" (\"by retaining the full-picture of every "
           "node's KV-Cache and end-to-end latencies from proxy to node\"); kvroute's proxy sits with the one "
           "load generator (§4.3) and serves most requests on nearby servers while the regional balancers "
           f"pay the tunnel's WAN hop (distributed GORGO forwarded {dist['cross_region_forwards']} requests; the "
           f"baselines sent {_remote_share(others['least-load']) * 100:.0f} % / "
           f"{_remote_share(others['prefix-trie']) * 100:.0f} % to other regions), but the gap is smaller than "
           "the paper's")
    out = [Row("median TTFT: central GORGO proxy vs least-load / prefix-trie / distributed GORGO",
               "225 vs 568 / 565 / 539 ms (2.5×)", text, agree, why, "gorgo-v1")]
    d = dist["ttft_s"]["p99"]
    base = [others["least-load"]["ttft_s"]["p99"], others["prefix-trie"]["ttft_s"]["p99"]]
    ratios = [b / d for b in base]
    agree = ratio_agreement(ratios, 15.1, 17.2)
    ll = others["least-load"]
    out.append(Row("P99 TTFT: distributed GORGO vs least-load / prefix-trie", "1.2 s vs 18.1 / 20.6 s",
                   f"{d:.2f} s vs {base[0]:.2f} / {base[1]:.2f} s ({fmt_range(ratios)})" + note, agree,
                   "" if agree == YES else "checked: the baselines' tails do come from cross-region sends "
                   f"({_remote_share(ll) * 100:.0f} % of least-load's requests served in another region; GORGO "
                   "serves locally while a server admits, as §3.3 has it), but 10 requests in flight (§4.6) on "
                   "three simulated A100s never queue long (least-load's LB queue p99 "
                   f"{ll['lb_queue_s']['p99']:.2f} s, {ll['preemptions']} preemptions), so a tail is one WAN "
                   "round trip plus a long prefill. The paper's 18-21 s P99s (Tables 2-3: P95 11.5 / 7.1 s, "
                   "max 24.2 / 20.6 s, out of 100 and 85 requests) are several seconds of waiting the paper "
                   "does not break down; §8 reports that \"GPU health was a major issue in high-throughput "
                   "benchmark testing\", which a simulator does not model", "gorgo-v1"))
    return out


def _unstable_count(results: dict) -> int:
    """How many of a scenario's runs had an unstable load verdict."""
    return sum(1 for x in results.values() if not x["load"]["stable"])


def rows_v2(lab: Lab) -> list[Row]:
    """GORGO v2's claims: the weights the online (1+1)-ES learns, the tuning window, held-out windows with the
    learned weights frozen vs session affinity, the paper's learned weights, the load sweep and reward
    hacking at w_queue = 0."""
    r = lab.run("gorgo-v2")  # the tuning window, at the paper's rate (the scenario's time_scale)
    sa, learned, start = r["consistent_hash"], r[LEARNED], r["gorgo"]
    note = unstable_note(lab, "gorgo-v2")
    base_scale = lab.scenario("gorgo-v2").workload.time_scale
    # App. D's reward hacking: its window's rate, its weights, its table's baselines
    sc = lab.scenario("gorgo-v2")
    appd = lab.run("gorgo-v2", key="gorgo-v2-appD", overrides={
        "workload": {"time_scale": paper_scale(sc, 0, sc.limits.max_requests or 3000, APPD_RPS)},
        "policies": [label for _, label in APPD_BASELINES] + [{"preset": "gorgo", "params": HACKED}]})
    appd_note = unstable_note(lab, "gorgo-v2-appD")
    st = tuner_state(r["gorgo_tuned"])
    w_rtt, w_queue = st["parent_w_rtt"], st["parent_w_queue"]
    conv = (f"converged after {st['converged_at']:.0f} samples" if st["converged"]
            else f"not converged after {st['samples']:.0f} samples (σ {st['sigma']:.3f})")
    # heavier than the paper's unscaled rate: where its tuning window stood (§5: baselines "over saturating")
    heavier = {}
    for ts in HEAVIER_FACTORS:
        h = lab.run("gorgo-v2", key=f"gorgo-v2-tune-ts{ts:g}", overrides={
            "workload": {"time_scale": base_scale * ts}, "policies": ["gorgo_tuned", "consistent_hash"]})
        hs = tuner_state(h["gorgo_tuned"])
        heavier[ts] = (hs["parent_w_rtt"], hs["parent_w_queue"], h["consistent_hash"])
    trend = "; ".join(f"{ts:g}× the gaps: w_rtt {a:.3f}, w_queue {b:.3f} (session affinity p95 E2E "
                      f"{sa_h['e2e_s']['p95']:.1f} s{'' if sa_h['load']['stable'] else ', UNSTABLE'})"
                      for ts, (a, b, sa_h) in heavier.items())
    ends = []
    for seed in OTHER_SEEDS if len(lab.seeds) == 1 else ():
        o = lab.run("gorgo-v2", key=f"gorgo-v2-tune-seed{seed}",
                    overrides={"seed": seed, "policies": ["gorgo_tuned"]})
        os_ = tuner_state(o["gorgo_tuned"])
        ends.append(f"seed {seed}: w_rtt {os_['parent_w_rtt']:.3f}, w_queue {os_['parent_w_queue']:.3f} "
                    f"(p95 TTFT {o['gorgo_tuned']['ttft_s']['p95']:.2f} s)")

    def off(a: float, b: float) -> float:  # log-space distance from the paper's learned weights
        return math.hypot(math.log(a / 0.276), math.log(b / 0.5))

    nearer = all(off(a, b) < off(w_rtt, w_queue) for a, b, _ in heavier.values())
    moved = w_rtt < 0.5 and w_queue > 0.1
    agree = (YES if 0.138 <= w_rtt <= 0.552 and 0.25 <= w_queue <= 0.5 else DIRECTION if moved else NO)
    out = [Row("learned weights: (1+1)-ES on p95 TTFT, start w_rtt 0.5, w_queue 0.1",
               "w_rtt 0.276, w_queue 0.5 after 672 samples",
               f"w_rtt {w_rtt:.3f}, w_queue {w_queue:.3f}, {conv}; {st['accepted']:.0f} of "
               f"{st['proposed']:.0f} offspring accepted", agree,
               "" if agree == YES else "checked: the tuner follows §4 (\"the p95 TTFT of a rolling 128-request "
               "window with hop size 32\", ranges [0.05, 2.0] and [0.05, 0.5], starts 0.5 / 0.1) and §2.2 "
               "(log-space mutation, Eq. 4; accept when the offspring \"beats\" the parent; σ by \"Rechenberg's "
               "1/5 success rule\"), with the details of GORGO's released gorgo/tuner.py (σ0 0.5, factor 0.817 "
               "once eight outcomes are in, stop under 0.05; accept when −p95 > −parent·1.005, which lets ties "
               "and regressions under 0.5 % pass) on the tuning window at the paper's offered "
               f"rate ({PAPER_RPS[0]:.2f} req/s: 7,195 requests in 30 minutes, Table 2; §4 raises time_scale "
               "only for the held-out days), 64 requests in flight at most (the released replay client's "
               "concurrency), on SGLang-style engines. "
               f"w_queue ends at {w_queue:.3f} (the paper: 0.5), w_rtt at {w_rtt:.3f} (the paper: 0.276). The "
               "landscape it climbs is flat here: p95 TTFT over the window is "
               f"{start['ttft_s']['p95']:.2f} s with the starting weights fixed, {learned['ttft_s']['p95']:.2f} s "
               f"with the paper's learned ones, {r['gorgo_tuned']['ttft_s']['p95']:.2f} s tuning; no baseline "
               f"saturates at this rate ({_unstable_count(r)} of {len(r)} runs unstable), where §5 has \"most "
               "policies other than GORGO ... over saturating replicas\", so the queue term buys little. "
               f"With the window compressed further ({trend}; session affinity "
               f"{sa['e2e_s']['p95']:.1f} s at the paper's rate) it ends "
               + ("nearer the paper's weights. " if nearer else "no nearer the paper's weights. ")
               + (f"The same run with other seeds ends at {'; '.join(ends)}" if ends else
                  "Where the same run ends at each seed is listed in the kvroute column") +
               ": on a landscape this flat where a "
               "(1+1)-ES stops is set by the noise of 128-sample p95s as much as by the weights, and the paper "
               "reports one run. kvroute's deployment stands in for the paper's with another engine (an "
               "H20/Qwen3-30B-A3B profile for 2xL40S/Qwen3.5-35B-A3B, "
               "which kvroute has no profile for), another trace (Mooncake conversation for the ART-Chat "
               "windows) and assumed RTTs (Fig. 2 plots them without values)", "gorgo-v2",
               seed_note=f"w_rtt {w_rtt:.3f}, w_queue {w_queue:.3f} "
                         f"(p95 TTFT {r['gorgo_tuned']['ttft_s']['p95']:.2f} s)")]
    tuned_p95 = r["gorgo_tuned"]["ttft_s"]["p95"]
    bases = {"session affinity": sa, **{name: r[label] for name, label in BASELINES_V2 if label in r}}
    beaten = [name for name, b in bases.items() if tuned_p95 > b["ttft_s"]["p95"]]
    worse = bool(beaten)
    best_name = min(bases, key=lambda name: bases[name]["ttft_s"]["p95"])
    out.append(Row("tuning window: GORGO, exploring, slightly underperforms the baselines (p95 TTFT)",
                   "2.51 s vs session affinity 2.43 s, least-load 2.45 s (behind both by 3.5 / 2.7 %), "
                   "least-request 3.97 s, prefix-cache 6.78 s (Table 2)",
                   f"{tuned_p95:.2f} s tuning online vs "
                   + ", ".join(f"{name} {b['ttft_s']['p95']:.2f} s" for name, b in bases.items())
                   + f" ({start['ttft_s']['p95']:.2f} s with the starting weights fixed"
                   + ("; behind " + ", ".join(f"{name} by {(tuned_p95 / bases[name]['ttft_s']['p95'] - 1) * 100:.1f} %"
                                              for name in beaten) if beaten else "") + ")" + note,
                   YES if worse else NO,
                   "" if worse else "checked: §5 says GORGO \"slightly underperforms baseline policies on the "
                   "tuning window because the evolutionary strategy actively explores the space of parameters and "
                   "tests worse weights than the learned solution\"; in its Table 2 GORGO trails the two best "
                   "baselines by 3.5 and 2.7 % and beats the other two. Here every baseline's p95 (the paper's four, "
                   f"§4) is worse than GORGO's with the weights the search served (the best, {best_name}, by "
                   f"{(bases[best_name]['ttft_s']['p95'] / tuned_p95 - 1) * 100:.1f} %) with the paper's setup "
                   f"followed where it is published (offered load {PAPER_RPS[0]:.2f} req/s, 7,195 requests in 30 "
                   "minutes; the replay client's 64 requests in flight, timed from their send; SGLang engines; "
                   "probes every 30 s): on this trace and deployment the cost's prefix and queue terms win at least "
                   "as much as exploring loses", "gorgo-v2"))
    frozen = {"w_rtt": round(w_rtt, 4), "w_queue": round(w_queue, 4)}
    n = lab.scenario("gorgo-v2").limits.max_requests or 3000
    for window in (1, 2):
        h = held_out(lab, window, [("consistent_hash", {}), ("gorgo", frozen)])
        base, g = h["consistent_hash"], h[f"gorgo{frozen}"]
        dt = g["ttft_s"]["p95"] / base["ttft_s"]["p95"] - 1
        de = g["e2e_s"]["p95"] / base["e2e_s"]["p95"] - 1
        agree = (YES if -0.31 <= dt <= -0.035 and -0.62 <= de <= -0.07 else
                 DIRECTION if dt < 0 and de < 0 else NO)
        bad = [lbl for lbl, x in h.items() if not x["load"]["stable"]]
        out.append(Row(f"held-out window {window} (trace requests {window * n}–{window * n + n - 1}), "
                       "learned weights frozen vs session affinity: p95 TTFT / p95 E2E",
                       "−6.9 to −15.5 % / −14.3 to −30.9 %",
                       f"{dt * 100:+.1f} % / {de * 100:+.1f} %"
                       + (f" (UNSTABLE: {', '.join(bad)})" if bad else ""), agree,
                       "" if agree == YES else "setup: held-out windows are later stretches of the Mooncake "
                       "conversation trace, not the paper's ART-Chat days; simulated H20s stand in for L40S",
                       "gorgo-v2"))
    d_ttft = learned["ttft_s"]["p95"] / sa["ttft_s"]["p95"] - 1
    agree = YES if -0.31 <= d_ttft <= -0.035 else DIRECTION if d_ttft < 0 else NO
    out.append(Row("p95 TTFT vs session affinity (the paper's learned weights, tuning window)", "−6.9 to −15.5 %",
                   f"{d_ttft * 100:+.1f} %" + note, agree,
                   "" if agree == YES else "setup: Mooncake conversation trace and the H20/Qwen3-30B-A3B "
                   "profile stand in for ART-Chat on L40S/Qwen3.5; the held-out windows are not "
                   "reproducible", "gorgo-v2"))
    d_e2e = learned["e2e_s"]["p95"] / sa["e2e_s"]["p95"] - 1
    agree = YES if -0.62 <= d_e2e <= -0.07 else DIRECTION if d_e2e < 0 else NO
    out.append(Row("p95 E2E vs session affinity (the paper's learned weights, tuning window)", "−14.3 to −30.9 %",
                   f"{d_e2e * 100:+.1f} %" + note, agree,
                   "" if agree == YES else "setup: as above; output capped at 128 tokens makes E2E mostly "
                   "TTFT plus a short decode", "gorgo-v2"))
    paper_w = [("gorgo", {"w_rtt": 0.276, "w_queue": 0.5})]  # Table 3's gorgo: the learned weights, frozen
    (h,) = held_out(lab, 2, paper_w, SWEEP_FULL_RPS).values()  # Apr 7's stand-in at time_scale 1.0 ...
    (h3,) = held_out(lab, 2, paper_w).values()  # ... and at 3.0
    gain = h["ttft_s"]["p95"] / h3["ttft_s"]["p95"]
    agree = YES if gain > 3 else DIRECTION if gain > 1 else NO
    stable = "stable" if h["load"]["stable"] else "UNSTABLE"
    out.append(Row("load sweep: p95 TTFT improves > 3× from time_scale 1.0 to ≥ 3.0", "> 3× (gorgo: 8.26 → 1.38 s, "
                   "Table 3, Apr 7)",
                   f"{gain:.2f}× ({h['ttft_s']['p95']:.2f} → {h3['ttft_s']['p95']:.2f} s; held-out window 2 at "
                   f"{h['load']['offered_rps']:.2f} and {h3['load']['offered_rps']:.2f} req/s, Table 3's rates; "
                   f"the time_scale 1.0 run {stable})",
                   agree, "" if agree == YES else "checked: §5 \"Load Sweep\": \"the policies experience a 3× "
                   "improvement in p95 TTFT and p95 E2E latency after time_scale=3.0 is reached\", its L40S engines "
                   "saturating at 1.0; " + ("kvroute's three simulated H20s (for 2xL40S) serve the capped (128-token) "
                                   "trace at Table 3's full-load rate without a growing queue, so there is less to "
                                   "recover"
                                   if h["load"]["stable"] else "kvroute's run saturates too, but its queue "
                                   "grows more slowly than the paper's"), "gorgo-v2"))
    (hacked,) = [v for k, v in appd.items() if k.startswith("gorgo")]
    base = {name: appd[label] for name, label in APPD_BASELINES}
    near = hacked.get("by_path", {}).get("local", {}).get("requests", 0) / max(1, hacked["requests"])
    worst_e2e = hacked["e2e_s"]["p95"] > max(b["e2e_s"]["p95"] for b in base.values())
    best_ttft = hacked["ttft_s"]["p95"] < min(b["ttft_s"]["p95"] for b in base.values())
    agree = YES if near > 0.95 and worst_e2e and best_ttft else DIRECTION if near > 0.5 and worst_e2e else NO
    out.append(Row("reward hacking, w_queue = 0: all traffic to the nearest replica, best TTFT, worst E2E",
                   "~100 % nearest; p95 TTFT 1.07 s vs 1.29-1.72 s, E2E p95 12.5 s vs 2.6-3.9 s (Table 7)",
                   f"{near * 100:.0f} % nearest; p95 TTFT {hacked['ttft_s']['p95']:.2f} s vs "
                   + fmt_range([b["ttft_s"]["p95"] for b in base.values()], "{:.2f}") + " s, E2E p95 "
                   f"{hacked['e2e_s']['p95']:.2f} s vs "
                   + fmt_range([b["e2e_s"]["p95"] for b in base.values()], "{:.2f}") + " s (Table 7's "
                   f"baselines; w_rtt 0.23, w_queue 0, {APPD_RPS:.2f} req/s: 3,071 requests in 30 minutes); the "
                   f"tuner itself ended at w_queue {w_queue:.3f} (its range's floor is 0.05: the guard)" + appd_note,
                   agree,
                   "" if agree == YES else "checked (App. D: \"GORGO chose to send 100% of requests to the "
                   "closest replica\"; \"learns to set w_queue to 0 while keeping w_rtt near 0.23\"; Table 7's "
                   "window, 3,071 requests, and baselines): traffic does go to the nearest replica and its E2E is "
                   "worst, as in the paper, but its p95 TTFT is not the best: one simulated H20 serving the whole "
                   "trace queues its prefills, which outweighs the 90–180 ms RTT it saves; the paper's "
                   "'best TTFT' means its nearest engine was not prefill-bound at that load; in a lighter "
                   "cross-region setup (3 A100s, 300/400 ms RTTs, 2 req/s: tests/test_adaptive_sim.py) "
                   "w_queue ≈ 0 does win p95 TTFT while E2E p95 collapses (more than 3× worse; the test asserts both)",
                   "gorgo-v2"))
    return out
