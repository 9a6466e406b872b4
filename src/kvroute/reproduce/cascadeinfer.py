"""CascadeInfer (004_131677394a4b07f8.txt) against the simulator.

Setups: ``scenarios/reproduce/cascadeinfer.yaml`` (16 H100 + Llama-3.2-3B instances, long-context
Poisson arrivals; round robin, Llumnix-like, CascadeInfer and its layouts and refinements) run
at a moderate rate (40 req/s), a heavy one (60 req/s: round robin and Llumnix-like saturate)
and far past capacity (200 req/s, where throughput is the output tokens generated while requests
arrive per second of the arrival window, §6.3, shown beside tokens ÷ time to the last response);
``cascadeinfer-bidask.yaml`` (Fig. 16's 4 × 4 pipeline). The QoE fit and the partition timing
run the pure cores directly on the profile's fitted model.
"""

from __future__ import annotations

import math
import statistics
import time

from kvroute.cascade import partition
from kvroute.perf.loader import load_profile
from kvroute.perf.profile import HardwareProfile
from kvroute.reproduce.common import DIRECTION, NO, YES, Lab, Row, pct, ratio_agreement, unstable_note
from kvroute.sim.cascade_planning import PLAN_PERIOD_S, in_flight_by_littles_law, planning_costs
from kvroute.sim.migration import DEFAULT_KV_BYTES_PER_TOKEN
from kvroute.sim.migration_settings import MigrationSettings
from kvroute.sim.qoe_profiling import fit_profile
from kvroute.workload.long_context import LongContext

PROFILE = "h100-llama3.2-3b"
RATES = {"moderate": 40.0, "heavy": 60.0, "saturated": 200.0}
CASCADE = "cascadeinfer"
CHAIN = "cascadeinfer(layout=chain)"
EXACT = "cascadeinfer(layout=dp)"
NO_PIPELINE = "cascadeinfer(layout=no_pipeline)"
EQUAL_MEMORY = "cascadeinfer(refinement=equal_memory)"
EQUAL_COUNT = "cascadeinfer(refinement=equal_count)"
LLUMNIX = "llumnix(migrate=False)"  # Llumnix's default configuration: no migration (see the scenario)


def _runs(lab: Lab) -> dict[str, dict]:
    return {load: lab.run("cascadeinfer", key=f"cascadeinfer-{load}", overrides={"workload": {"rate": rate}})
            for load, rate in RATES.items()}


def _e2e(res: dict, label: str, stat: str = "mean") -> float:
    return float(res[label]["e2e_s"][stat])


def _served(res: dict, label: str) -> float:
    """System throughput as the paper uses it: the "system-wide token generation rate" (§6.1) while
    the load is applied, i.e. output tokens generated during the arrival window ÷ its length
    (metrics/summary.py: window_output_tps). §6.3: "Throughput declines once the request rate
    exceeds a threshold, as all systems prioritize prefilling over decoding" — a rate that only
    a measure taken while requests arrive can show; tokens ÷ time to the last response cannot
    fall that way. Adopted after the makespan measure's result was seen (issue 21); that measure
    is shown beside it (``_makespan_tps``)."""
    return float(res[label]["window_output_tps"])


def _makespan_tps(res: dict, label: str) -> float:
    """vLLM's serving benchmark's throughput: output tokens ÷ time to the last response."""
    return float(res[label]["output_tps"])


def _thr_text(runs: dict[str, dict], other: str) -> str:
    """Both throughput ratios at saturation, the judged (arrival window) one first."""
    sat = runs["saturated"]
    win = _served(sat, CASCADE) / _served(sat, other)
    mk = _makespan_tps(sat, CASCADE) / _makespan_tps(sat, other)
    return (f"throughput at saturation {win:.2f}× during arrivals ({_served(sat, CASCADE):,.0f} vs "
            f"{_served(sat, other):,.0f} tok/s; judged), {mk:.2f}× to the last response "
            f"({_makespan_tps(sat, CASCADE):,.0f} vs {_makespan_tps(sat, other):,.0f} tok/s)")


# What issue 21r checked of kvroute's CascadeInfer against the paper's algorithm (CascadeInfer has
# no public code: facts.md), quoted in the rows that stay "no".
IMPLEMENTATION = (
    "The mechanisms were checked against the paper's text: Eq. (1)'s batch QoE n·Σ D_k F_k over "
    "(1, n, ΣI, ΣI², ΣL), fitted by least squares on exponential length buckets × batch sizes 1, 2, 4, ... "
    "(cascade/qoe.py, sim/qoe_profiling.py, §4.1); the recursion f[s,e,l] = min f[s−1,e',l'] + "
    "(e−e')·Q^{n_{l',l}/(e−e')} + c_{l'} with the footnote's set division (sort, from the k/2-th take "
    "every k-th) and the two-phase heuristic (one instance per stage, then greedy merges by largest "
    "gain) (cascade/partition.py, §4.2); arrival at the earliest stage covering the prompt, hand-over "
    "when the sequence passes its stage's bound, bid-ask receivers (drop the more loaded half, keep the "
    "three earliest starts, first reply), at most three transfers, skipped without free KV "
    "(presets/cascadeinfer.py, sim/migration.py, cascade/bidask.py, §3.2, §4.4, §5); §4.3's split "
    "argmin Q(R[:i]) + Q(R[i:]) over the stage's sequences beside one average successor instance, "
    "EMA-smoothed, frozen under five (cascade/ranges.py). One declared difference: one boundary per "
    "pair of stages, not one per instance. Plans are made on §4.2's set of requests: one period's, each once "
    "(\"CascadeInfer collects request statistics over the period (input and output lengths)\"; pipeline "
    "quality is \"the total QoE of all instances processing all requests\"), at start-up and every planning period. ")


def _saturation(lab: Lab) -> str:
    """Which latency runs were saturated (their latencies measure a queue)."""
    parts = []
    for load in ("moderate", "heavy"):
        bad = lab.meta.get(f"cascadeinfer-{load}", {}).get("unstable") or []
        if bad:
            parts.append(f"at {RATES[load]:g} req/s {', '.join(bad)}")
    return f" (UNSTABLE, their latencies measure a queue: {'; '.join(parts)})" if parts else ""


def qoe_row(prof: HardwareProfile) -> Row:
    """§4.1 / §6.5: the QoE model's mean relative error on held-back profiling runs (of the model
    the planner uses: the scenario's profile)."""
    fit = fit_profile(prof)
    err, static = fit.model_error, fit.static_error
    agree = YES if err <= 2 * 0.089 and static >= 3 * err else DIRECTION if err < static else NO
    return Row("QoE model mean relative error (held-back runs)", "8.9 % (static mean predictor 64 %)",
               f"{pct(err)} (static mean predictor {pct(static)}); {fit.fit_requests} fitting and "
               f"{fit.validation_requests} validation requests on the {prof.name} engine model "
               f"(batch cap {prof.max_running})",
               agree, "" if agree == YES else "model: the simulated engine is not the paper's vLLM; errors "
               "concentrate where a request's TTFT (prefill of a long prompt over few output tokens) "
               "dominates its normalized latency, which the batch features describe only on average",
               "qoe fit")


def _profile(lab: Lab) -> HardwareProfile:
    """The scenario's engine profile as the simulator builds it (the batch cap is §6.1's 1024)."""
    group = lab.scenario("cascadeinfer").replicas[0]
    prof = load_profile(group.profile)
    return prof.model_copy(update={"max_running": group.max_running}) if group.max_running else prof


def _planning_costs(prof: HardwareProfile, rate: float, instances: int,
                    period_s: float, seed: int = 1) -> tuple[partition.StageCosts, int]:
    """The start-up plan's costs as the simulator builds them (sim/cascade_planning.py): one
    period's requests of the workload's statistics at ``seed`` (the run's), each once (§4.2's "set of
    requests")."""
    sample = LongContext(rate, ["local"], seed=seed).length_sample(int(round(rate * period_s)))
    n = in_flight_by_littles_law(prof, rate, sample, instances)
    bytes_per_token = prof.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN
    tokens_per_s = MigrationSettings().transfer_gb_s * 1e9 / bytes_per_token
    costs = planning_costs(prof, fit_profile(prof).model, sample, n, instances, tokens_per_s, seed=seed)
    return costs, len(costs.cuts) - 1


def _prefill_share(res: dict, label: str, seed: int = 1) -> str:
    """What the saturated run's start-up plan gives the stage with the most prefill per instance,
    computed from the workload's length distribution and the profile's prefill time (no queueing,
    no decoding): its share of the workload's prefill seconds against its share of the instances."""
    plans = res[label].get("migration", {}).get("plans") or []
    if not plans:
        return ""
    sizes, bounds = plans[0]["sizes"], plans[0]["bounds"]
    edges = [0, *bounds, math.inf]
    prof = load_profile(PROFILE)
    sample = LongContext(RATES["saturated"], ["local"], seed=seed).length_sample(20_000)
    work = [0.0] * len(sizes)  # prefill seconds by stage of the prompt
    for i, _ in sample:
        work[partition.stage_of(bounds, i)] += prof.prefill_time(i)
    worst = max(range(len(sizes)), key=lambda s: work[s] / sizes[s])
    share = work[worst] / sum(work)
    count = sum(1 for i, _ in sample if edges[worst] <= i < edges[worst + 1]) / len(sample)
    return (f"the saturated run's start-up plan {sizes} at {bounds} gives prompts of {edges[worst]:.0f}+ tokens "
            f"({count:.1%} of requests, {share:.0%} of the workload's prefill time, computed from its lengths "
            f"and the profile's prefill time) {sizes[worst]} of the {sum(sizes)} instances, "
            f"{share / (sizes[worst] / sum(sizes)):.1f}× an even share of prefill per instance")


def _throughput_why(runs: dict[str, dict], seed: int = 1) -> str:
    """Why throughput at saturation falls short (the clause this measures)."""
    replans = len(runs["saturated"][CASCADE].get("migration", {}).get("plans") or [None]) - 1
    return (f"throughput at saturation ({RATES['saturated']:g} req/s: output tokens generated during the "
            "arrival window ÷ its length) is set by the stages of the longest prompts: "
            + _prefill_share(runs["saturated"], CASCADE, seed)
            + f" (§4.3's refinement then moves the bounds to {_bounds(runs['saturated'], CASCADE)}); §6.1's envelope "
            "allows at most 4 instances a stage (\"each stage comprising 1 to 4 instances\")"
            + (", and the run's arrivals end before its first re-plan" if replans == 0 else
               f"; it re-planned {replans} time{'s' if replans > 1 else ''}") + ". " + MEASURE)


# Why the rows judge throughput over the arrival window (stated in every row that is not met).
MEASURE = ("The paper's throughput is the \"system-wide token generation rate\" (§6.1) and §6.3 says "
           "\"Throughput declines once the request rate exceeds a threshold, as all systems prioritize "
           "prefilling over decoding\": a decline from prefill priority shows only in the rate measured while "
           "requests still arrive, so the rows judge output tokens generated in the arrival window ÷ its length "
           "(decode tokens placed linearly between first token and finish, an approximation). This measure was "
           "adopted after the result on vLLM's benchmark_serving measure (tokens ÷ time to the last response, "
           "shown beside it, where the slowest stage's drain sets the rate) was seen; the reason is §6.3's "
           "sentence. It favours a system that defers long prompts past the window")


def _envelope(lab: Lab) -> MigrationSettings:
    """The scenario's simulator settings (§6.1's stage envelope, the planning period)."""
    return MigrationSettings(**(lab.scenario("cascadeinfer").simulator or {}))


def _bounds(res: dict, label: str) -> list[int]:
    """A run's stage bounds when it ended."""
    return list(res[label].get("migration", {}).get("bounds") or [])


def _shapes(res: dict, label: str) -> str:
    """The plans a run made: start-up, then each period's."""
    plans = res[label].get("migration", {}).get("plans") or []
    return " → ".join(str(p["sizes"]) for p in plans) or "–"


def partition_rows(lab: Lab) -> list[Row]:
    """§6.5: partition time at 16 instances and 128K, and the heuristic against the exact DP."""
    env = _envelope(lab)
    k, stages = env.max_stage_instances, env.stages
    # the planner's own CPU time (this thread's: with several seeds other threads share the process):
    # wall time on a shared host counts the other tenants too (1 s+ under load 6-8 in a test run,
    # where it takes ~0.08 s alone)
    t0 = time.thread_time()
    period = env.replan_interval_s or PLAN_PERIOD_S
    prof = _profile(lab)
    costs, tiers = _planning_costs(prof, RATES["moderate"], 16, period, lab.seed)
    heur = partition.heuristic(costs, 16, k, stages)
    t_heur = time.thread_time() - t0
    t1 = time.thread_time()
    exact = partition.exact(costs, 16, k, stages)
    t_exact = time.thread_time() - t1
    free = partition.heuristic(costs, 16)
    agree = YES if t_heur < 1.0 else NO
    timing = Row("stage partition with 16 instances, 128K length", "0.06 s",
                 f"{t_heur:.3f} s of CPU with the two-phase heuristic (stage costs included; {tiers} length tiers, "
                 f"{len(costs.running)} requests, one {period:g} s period at {RATES['moderate']:g} req/s); "
                 "the exact DP over the same tiers then takes "
                 f"{t_exact:.3f} s more", agree,
                 "" if agree == YES else "machine: a slower CPU", "partition")
    gaps = []
    for e in (2, 4, 8, 16):
        c, _ = _planning_costs(prof, RATES["moderate"], e, period, lab.seed)
        shape = stages if e >= 16 else None  # 4-6 stages need enough instances
        h, x = partition.heuristic(c, e, k, shape), partition.exact(c, e, k, shape)
        gaps.append((e, h.cost / x.cost - 1 if x.cost else 0.0))
    runs = _runs(lab)
    realized = [_e2e(runs[load], CASCADE) / _e2e(runs[load], EXACT) for load in ("moderate", "heavy")]
    quality = Row("two-phase heuristic vs exact DP (predicted pipeline quality); plan shapes",
                  "not reported (heuristic used); §6.1: 4 to 6 stages of 1 to 4 instances",
                  "predicted quality gap " + ", ".join(f"{e} instances {g * 100:+.1f} %" for e, g in gaps)
                  + f"; at 16 within §6.1's envelope: heuristic {heur.sizes} at {heur.bounds}, exact {exact.sizes} "
                  f"at {exact.bounds} (start-up statistics; without the envelope the heuristic makes {free.sizes}); "
                  f"the 40 req/s run's plans every {env.replan_interval_s or 0:g} s: "
                  f"{_shapes(runs['moderate'], CASCADE)}; "
                  f"simulated mean E2E heuristic vs exact-DP plan "
                  f"{(realized[0] - 1) * 100:+.0f} % / {(realized[1] - 1) * 100:+.0f} % (40 / 60 req/s)",
                  DIRECTION if all(g >= -1e-9 for _, g in gaps) else NO,
                  "the paper gives no number to compare; the heuristic is never better than the DP on the "
                  "model (it is a restriction of it). Simulated latency can disagree with the predicted "
                  "quality: the QoE model is linear in batch sums, the engine model is not. Shapes: kept in "
                  "§6.1's envelope by the scenario (simulator.stages, max_stage_instances); the period plans "
                  "move because each period's finished requests are a different, short-biased sample",
                  "partition")
    return [timing, quality]


def _layout_row(lab: Lab, runs: dict[str, dict], other: str, claim: str, paper: str,
                lat: float, thr: float, why: str) -> Row:
    lat_ratios = [_e2e(runs[load], CASCADE) / _e2e(runs[load], other) for load in ("moderate", "heavy")]
    thr_ratio = _served(runs["saturated"], CASCADE) / _served(runs["saturated"], other)
    a_lat = ratio_agreement(lat_ratios, lat, lat)
    a_thr = ratio_agreement([thr_ratio], thr, thr)
    agree = YES if a_lat == YES and a_thr == YES else DIRECTION if NO not in (a_lat, a_thr) else NO
    why += "; " + (_throughput_why(runs, lab.seed) if a_thr == NO else MEASURE)
    text = (f"mean E2E {(lat_ratios[0] - 1) * 100:+.0f} % (40 req/s), {(lat_ratios[1] - 1) * 100:+.0f} % (60 req/s); "
            + _thr_text(runs, other))
    return Row(claim, paper, text, agree, MEASURE if agree == YES else why + _saturation(lab), "cascadeinfer")


def bidask_row(lab: Lab) -> Row:
    """Fig. 16: per-stage CV of output tokens per instance in a 4 × 4 pipeline."""
    res = lab.run("cascadeinfer-bidask")
    cvs = {}
    for label, r in res.items():
        mig = r["migration"]
        tokens = mig["out_tokens"]
        per_stage = []
        for ids in mig["stages"]:
            v = [tokens[i] for i in ids]
            mu = statistics.fmean(v)
            per_stage.append(statistics.pstdev(v) / mu if mu else 0.0)
        mode = "round robin" if "within=round_robin" in label else ("inter-stage only" if "handover" in label
                                                                     else "full bid-ask")
        cvs[mode] = statistics.fmean(per_stage)
    rr, inter, full = cvs["round robin"], cvs["inter-stage only"], cvs["full bid-ask"]
    agree = YES if full < inter < rr else DIRECTION if full < rr else NO
    return Row("bid-ask vs round robin, output-token imbalance (mean per-stage CV, 4 × 4 pipeline)",
               "CV −47 % vs round robin, −40 % vs inter-stage-only bid-ask (Fig. 16)",
               f"round robin {rr:.3f}, inter-stage only {inter:.3f}, full {full:.3f} "
               f"(full vs round robin {(full / rr - 1) * 100:+.0f} %, "
               f"vs inter-stage {(full / inter - 1) * 100:+.0f} %)",
               agree, "" if agree == YES else _bidask_why(agree) + unstable_note(lab, "cascadeinfer-bidask"),
               "cascadeinfer-bidask", seed_note=f"CV round robin {rr:.3f}, inter-stage {inter:.3f}, full {full:.3f}")


def _bidask_why(agree: str) -> str:
    """Why full bid-ask does not even out output tokens as Fig. 16 has it (direction only, or not at all)."""
    why = ("checked: Fig. 16's text has full bid-ask mitigate \"the variability from unpredictable output\" beyond "
           "inter-stage-only; ")
    if agree == DIRECTION:
        return why + ("here the round-robin ordering holds but within a stage least load (or round robin) over "
                      "identical instances already spreads output tokens evenly at this load; the overload trigger "
                      "(25 % above the stage mean in KV) then moves sequences that are long in context, not in "
                      "output, so the output-token CV is not what it evens out")
    return why + ("here full bid-ask ends above round robin at this seed. The CV over a stage's four instances is "
                  "one seed's draw and swings with it: over seeds 1-6 of this scenario issue 21u found full bid-ask "
                  "below round robin at seeds 2-6 and above it at seed 1 (run over several seeds, the kvroute "
                  "column lists each seed's CVs). Its bids and overload trigger read KV in use, and a "
                  "vLLM v1 engine holds only the chunks of a long prompt scheduled so far (kv_cache_manager "
                  "allocate_slots; its reported usage is allocated blocks, block_pool), so a stage prefilling long "
                  "prompts looks lighter than it will be; the trigger (25 % above the stage mean in KV) moves "
                  "sequences long in context, not in output, so the output-token CV is not what it evens out")


def _end_to_end_why(runs: dict[str, dict], agrees: list[str], seed: int = 1) -> str:
    """The end-to-end rows' reasons, for the clauses (mean, tail, throughput) that are not met."""
    parts = []
    if NO in agrees[:2]:
        parts.append("latency: the paper's gains are \"under heavy load\" (§6.2: mean TTFT −67–78 % vs vLLM, "
                     "−36–66 % vs Llumnix; \"under light load ... comparable to Llumnix\"); short requests gain "
                     "here (homogeneous stages), the prompts over 32K queue on the longest stages (plans "
                     f"{_shapes(runs['moderate'], CASCADE)}, inside §6.1's 1-4 instances per stage): Eq. (1) has no "
                     "queueing term")
    if agrees[2] == NO:
        parts.append(_throughput_why(runs, seed))
    return (("Not met: " + "; ".join(parts) + ". " if parts else "")
            + ("" if agrees[2] == NO else MEASURE + ". ") + "The baselines are "
            "§6.1's: round robin over plain vLLM instances (batch cap 1024) and Llumnix \"using its "
            "default configuration\" (its llumnix/config/default.py: dispatch by 'load' on remaining "
            "steps, i.e. free KV per request, and ENABLE_MIGRATION = False). The lengths are assumed: "
            "§6.1 builds the workload from ShareGPT \"conversation histories\" and gives no quantiles, "
            "and the ShareGPT lengths published elsewhere are of single turns (vLLM's SOSP '23 artifact, "
            "sosp-ae-39/sosp-ae-astra datasets/: \"extracting the first round of each conversation\"), "
            "not of the histories up to 128K that the paper replays (Fig. 1)")


def rows(lab: Lab) -> list[Row]:
    """Every CascadeInfer claim kvroute can check, paper beside simulator."""
    out = [qoe_row(_profile(lab)), *partition_rows(lab)]
    runs = _runs(lab)
    out.append(_layout_row(lab, runs, CHAIN, "vs chain layout (one instance per stage)",
                           "30 % lower latency, 7.1 % higher throughput", 0.70, 1.071,
                           "checked: §6.5 blames the chain's \"overly long pipeline, which incurs higher migration "
                           "overhead and complicates load balancing across stages\"; in kvroute a hand-over costs "
                           "only its transfer time (live migration "
                           "overlaps decoding, the last round is free) and the chain's one-instance stages "
                           "are the most homogeneous, so the chain loses less than in the paper; both layouts "
                           "share the long stages' queueing (see the end-to-end rows)"))
    out.append(_layout_row(lab, runs, EQUAL_MEMORY, "vs memory-based range refinement",
                           "21 % lower latency, 12 % higher throughput", 0.79, 1.12,
                           "checked: " + IMPLEMENTATION +
                           "§6.5 says the memory-based scheme \"fails to account for request "
                           "heterogeneity as in §4.3\"; kvroute's memory split equalises summed sequence lengths "
                           "on the same merged list the QoE split reads (one average instance of the stage beside "
                           "one of its successors, §4.3's set division), reading \"equalizes per-stage memory "
                           "usage\" per instance within §4.3's framework rather than as stage totals (which would "
                           "load a one-instance stage like a four-instance one). Both refinements only move "
                           "boundaries between "
                           "stages whose instance counts the plan fixed (and the periodic plans reset them), and "
                           "both push the upper boundaries up (the QoE split isolates the heaviest sequences; "
                           "equal memory balances KV across stages of unequal size), so at 40 req/s they end "
                           f"close together (final bounds: adaptive {_bounds(runs['moderate'], CASCADE)}, memory "
                           f"{_bounds(runs['moderate'], EQUAL_MEMORY)}); at saturation the QoE split moves the last "
                           "boundary further up, leaving the longest prompts to the stage below it (adaptive "
                           f"{_bounds(runs['saturated'], CASCADE)}, memory "
                           f"{_bounds(runs['saturated'], EQUAL_MEMORY)})"))
    layouts = (CASCADE, CHAIN, NO_PIPELINE)
    refinements = (CASCADE, EQUAL_MEMORY, EQUAL_COUNT)

    def worst(labels: tuple[str, ...], load: str) -> str:
        return max(labels, key=lambda lbl: _e2e(runs[load], lbl))

    worst_layout = [worst(layouts, load) for load in ("moderate", "heavy")]
    worst_refine = [worst(refinements, load) for load in ("moderate", "heavy")]
    a = (YES if worst_layout == [NO_PIPELINE] * 2 and worst_refine == [EQUAL_COUNT] * 2 else
         DIRECTION if NO_PIPELINE in worst_layout or EQUAL_COUNT in worst_refine else NO)
    out.append(Row("no-pipeline layout performs worst of the layouts; quantity-based refinement poorest of the "
                   "refinements (mean E2E)", "direction (Figs. 14-15)",
                   f"worst layout: {worst_layout[0]} / {worst_layout[1]}; worst refinement: {worst_refine[0]} / "
                   f"{worst_refine[1]} (40 / 60 req/s)", a,
                   "" if a == YES else "model: see the layout and refinement rows" + _saturation(lab), "cascadeinfer"))
    for base, name in (("round_robin", "round robin (vLLM)"), (LLUMNIX, "Llumnix-like")):
        mean = [_e2e(runs[load], CASCADE) / _e2e(runs[load], base) for load in ("moderate", "heavy")]
        tail = [_e2e(runs[load], CASCADE, "p99") / _e2e(runs[load], base, "p99") for load in ("moderate", "heavy")]
        thr = _served(runs["saturated"], CASCADE) / _served(runs["saturated"], base)
        agrees = [ratio_agreement(mean, 0.33, 1.0), ratio_agreement(tail, 0.31, 1.0), ratio_agreement([thr], 1.0, 2.89)]
        agree = YES if all(x == YES for x in agrees) else DIRECTION if NO not in agrees else NO
        out.append(Row(f"end to end vs {name}", "up to 67 % lower E2E, 69 % lower tail, up to 2.89× throughput",
                       f"mean E2E {(mean[0] - 1) * 100:+.0f} % / {(mean[1] - 1) * 100:+.0f} %, P99 E2E "
                       f"{(tail[0] - 1) * 100:+.0f} % / {(tail[1] - 1) * 100:+.0f} % (40 / 60 req/s); "
                       + _thr_text(runs, base), agree,
                       MEASURE if agree == YES else "checked: " + IMPLEMENTATION
                       + _end_to_end_why(runs, agrees, lab.seed) + _saturation(lab), "cascadeinfer",
                       seed_note=f"mean E2E {(mean[0] - 1) * 100:+.0f} / {(mean[1] - 1) * 100:+.0f} %, P99 E2E "
                                 f"{(tail[0] - 1) * 100:+.0f} / {(tail[1] - 1) * 100:+.0f} %, throughput {thr:.2f}×"))
    out.append(bidask_row(lab))
    return out
