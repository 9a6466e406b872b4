"""LMetric (002_8c097f52e4fa5054.txt) against the simulator.

Setup: ``kvroute/scenarios/reproduce/lmetric.yaml`` — 16 H20 / Qwen3-30B-A3B replicas, the Mooncake
conversation trace. As in the paper, the load is set from the testbed's maximum: kvroute first
measures the deployment's saturated throughput (round robin, trace compressed until the
backlog grows), then replays the trace at half of it, and sweeps 30–90 % for the "every rate"
claim.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvroute.model import Request
from kvroute.reproduce.common import (
    DIRECTION,
    NO,
    NOT_IMPLEMENTED,
    NOT_MODELLED,
    YES,
    Lab,
    Row,
    unstable_note,
)
from kvroute.workload import SimRequest, Workload


class HotspotWorkload(Workload):
    """LMetric §5.2's failure pattern, synthetic: Poisson arrivals where a share ``hot`` of the
    requests carry one long shared prefix (``prefix_blocks`` blocks) and a one-block unique tail,
    and the rest are short unique prompts — the class whose P-token on its cache holder is a
    small fraction of its prompt. Mooncake-style 512-token blocks; deterministic under ``seed``."""

    name = "hotspot"

    def __init__(self, rate: float, requests: int, hot: float = 0.7, prefix_blocks: int = 40,
                 cold_blocks: int = 4, output_tokens: int = 128, region: str = "us", seed: int = 0):
        self.rate, self.requests, self.hot = rate, requests, hot
        self.prefix_blocks, self.cold_blocks, self.output_tokens = prefix_blocks, cold_blocks, output_tokens
        self.region, self.seed = region, seed

    def arrivals(self) -> Iterator[SimRequest]:
        """The requests, in arrival order."""
        rng = random.Random(self.seed)
        shared = tuple(range(1, self.prefix_blocks + 1))
        t, fresh = 0.0, 1 << 40  # unique block ids start far above the shared ones
        for i in range(self.requests):
            t += rng.expovariate(self.rate)
            if rng.random() < self.hot:
                ids = (*shared, fresh)
                fresh += 1
            else:
                ids = tuple(range(fresh, fresh + self.cold_blocks))
                fresh += self.cold_blocks
            req = Request(id=f"h{i}", arrival_s=t, region=self.region, block_hashes=ids, block_tokens=512,
                          prompt_tokens=512 * len(ids), max_output_tokens=self.output_tokens)
            yield SimRequest(req, self.output_tokens)


BASELINES = ("vllm_jsq", "bailian_linear", "dynamo_kv", "aibrix_prefix_cache", "llm_d")
SWEEP = (0.3, 0.5, 0.7, 0.9)
def why_trace(res: dict) -> str:
    """Evidence for the LMetric rows: how much prefix reuse the stand-in trace offers."""
    hits = ", ".join(f"{lbl} {r['prefix_hit_rate']:.0%}" for lbl, r in res.items() if lbl in ("lmetric", "vllm_jsq"))
    return ("setup: the Mooncake conversation trace stands in for ChatBot/Coder/Agent (the Bailian traces "
            f"are not reachable); its prefix reuse on this deployment is low (hit {hits}), and LMetric's "
            "margin over load-only routing comes from the prefill it saves by following the cache")


def capacity(lab: Lab) -> tuple[float, float]:
    """(saturated throughput in req/s, the trace's own request rate at time_scale 1)."""
    sat = lab.run("lmetric", key="lmetric-saturated", overrides={"workload": {"time_scale": 0.02},
                                                                  "policies": ["round_robin"]})["round_robin"]
    sc = lab.scenario("lmetric")
    times = [s.req.arrival_s / sc.workload.time_scale for s in sc.make_workload().arrivals()]
    return sat["throughput_rps"], len(times) / (times[-1] - times[0])


def rows(lab: Lab) -> list[Row]:
    cap, trace_rate = capacity(lab)
    half = lab.run("lmetric", key="lmetric-50", overrides={"workload": {"time_scale": trace_rate / (0.5 * cap)}})
    lm = half["lmetric"]
    note = unstable_note(lab, "lmetric-50")
    where = f" (capacity {cap:.1f} req/s measured; run at 50 %)"
    WHY_TRACE = why_trace(half)
    out = []
    for name, label, paper, (t_lo, t_hi), (p_lo, p_hi) in (
            ("vLLM (JSQ)", "vllm_jsq", "TTFT −92 %, TPOT −24 %", (-0.95, -0.46), (-0.48, -0.12)),
            ("Bailian's tuned linear combination", "bailian_linear", "TTFT −52 %, TPOT −20 %",
             (-0.76, -0.26), (-0.40, -0.10))):
        b = half[label]
        dt = lm["ttft_s"]["mean"] / b["ttft_s"]["mean"] - 1
        dp = lm["tpot_s"]["mean"] / b["tpot_s"]["mean"] - 1
        agree = YES if t_lo <= dt <= t_hi and p_lo <= dp <= p_hi else DIRECTION if dt < 0 and dp <= 0 else NO
        out.append(Row(f"mean TTFT / mean TPOT vs {name}", paper,
                       f"TTFT {dt * 100:+.1f} %, TPOT {dp * 100:+.1f} %" + where + note, agree,
                       "" if agree == YES else WHY_TRACE, "lmetric"))
    d = half["llm_d"]
    dp99 = lm["tpot_s"]["p99"] / d["tpot_s"]["p99"] - 1
    dttft = lm["ttft_s"]["mean"] / d["ttft_s"]["mean"] - 1
    out.append(Row("P99 TPOT vs llm-d (simulator-based, second best), similar TTFT", "−13 %",
                   f"P99 TPOT {dp99 * 100:+.1f} %, mean TTFT {dttft * 100:+.1f} %" + note, NOT_MODELLED,
                   "missing baseline: kvroute's llm_d is llm-d's weighted scorer (queue 2, kv 2, prefix 3), "
                   "not the latency-predicting simulator LMetric compared against", "lmetric"))
    best_at = []
    for level in SWEEP:
        key = f"lmetric-{round(level * 100)}"
        res = half if level == 0.5 else lab.run(
            "lmetric", key=key, overrides={"workload": {"time_scale": trace_rate / (level * cap)}})
        means = {lbl: r["ttft_s"]["mean"] for lbl, r in res.items()}
        best_at.append((level, min(means, key=lambda lbl: means[lbl])))
    wins = sum(1 for _, b in best_at if b == "lmetric")
    agree = YES if wins == len(SWEEP) else DIRECTION if wins >= len(SWEEP) / 2 else NO
    out.append(Row("best mean TTFT of all baselines at every rate", "yes (one exception: ToolAgent vs llm-d)",
                   ", ".join(f"{lvl:.0%}: {b}" for lvl, b in best_at), agree,
                   "" if agree == YES else WHY_TRACE + "; at low load every policy finds an idle replica",
                   "lmetric"))
    out.append(Row("multiplication fails only in rare, detectable conditions (KV hotspot)", "two-phase detector",
                   "–", NOT_IMPLEMENTED, "LMetric's KV-hotspot detector is not built (no code published)",
                   "lmetric"))
    return out
