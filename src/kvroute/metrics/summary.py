"""Per-request measurements and their summaries.

Values are stored in flat arrays (8 bytes each), so a million-request run keeps ~100 MB of
measurements. Summaries are rounded to microseconds, which keeps JSON output byte-identical
across runs of the same scenario and seed.
"""

from __future__ import annotations

from array import array

import numpy as np

PERCENTILES = (50, 90, 95, 99)


def summarize(values) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    pct = np.percentile(arr, PERCENTILES)
    out = {"mean": round(float(arr.mean()), 6)}
    out.update({f"p{q}": round(float(v), 6) for q, v in zip(PERCENTILES, pct)})
    return out


class Recorder:
    def __init__(self, replica_ids: list[str]):
        self.replica_ids = replica_ids
        self.index = {r: i for i, r in enumerate(replica_ids)}
        self.ttft = array("d")
        self.e2e = array("d")
        self.tpot = array("d")
        self.done_at = array("d")
        self.sent_at = array("d")
        self.lb_queue = array("d")
        self.out_tokens = array("q")
        self.prompt_tokens = array("q")
        self.cached_tokens = array("q")
        self.replica = array("i")
        self.cross_region = 0
        self.forwarded = 0
        self.failed: dict[str, int] = {}
        self.branches: dict[str, int] = {}
        self.sample_t = array("d")
        self.sample_running: list[array] = [array("i") for _ in replica_ids]

    def complete(self, sent: float, first: float, done: float, out: int, prompt: int, cached: int,
                 queue_s: float, replica: str, cross: bool) -> None:
        self.sent_at.append(sent)
        self.ttft.append(first - sent)
        self.e2e.append(done - sent)
        self.tpot.append((done - first) / (out - 1) if out > 1 else 0.0)
        self.done_at.append(done)
        self.lb_queue.append(queue_s)
        self.out_tokens.append(out)
        self.prompt_tokens.append(prompt)
        self.cached_tokens.append(cached)
        self.replica.append(self.index[replica])
        self.cross_region += cross

    def fail(self, reason: str) -> None:
        kind = reason.split(":", 1)[0]
        self.failed[kind] = self.failed.get(kind, 0) + 1

    def sample(self, t: float, running: list[int]) -> None:
        self.sample_t.append(t)
        for col, r in zip(self.sample_running, running):
            col.append(r)

    @property
    def completed(self) -> int:
        return len(self.ttft)

    def imbalance(self) -> tuple[float, float]:
        """Time-averaged CV and max/min of running requests across replicas."""
        if not self.sample_t or len(self.replica_ids) < 2:
            return 0.0, 1.0
        m = np.array([np.frombuffer(c, dtype=np.int32) for c in self.sample_running], dtype=np.float64)
        mean = m.mean(axis=0)
        busy = mean > 0
        cv = float((m.std(axis=0)[busy] / mean[busy]).mean()) if busy.any() else 0.0
        lo, hi = m.min(axis=0), m.max(axis=0)
        ok = lo > 0
        ratio = float((hi[ok] / lo[ok]).mean()) if ok.any() else float("inf") if busy.any() else 1.0
        return cv, ratio

    def result(self, replica_hours: float) -> dict:
        n = self.completed
        start = min(self.sent_at) if n else 0.0
        span = (max(self.done_at) - start) if n else 0.0
        cv, ratio = self.imbalance()
        prompt = sum(self.prompt_tokens)
        return {
            "requests": n,
            "failed": dict(sorted(self.failed.items())),
            "ttft_s": summarize(self.ttft),
            "tpot_s": summarize(self.tpot),
            "e2e_s": summarize(self.e2e),
            "lb_queue_s": summarize(self.lb_queue),
            "throughput_rps": round(n / span, 6) if span > 0 else 0.0,
            "output_tps": round(sum(self.out_tokens) / span, 6) if span > 0 else 0.0,
            "prefix_hit_rate": round(sum(self.cached_tokens) / prompt, 6) if prompt else 0.0,
            "imbalance_cv": round(cv, 6),
            "imbalance_max_min": round(ratio, 6) if ratio != float("inf") else None,
            "cross_region_forwards": self.forwarded,
            "cross_region_served": self.cross_region,
            "branches": dict(sorted(self.branches.items())),
            "makespan_s": round(span, 6),
            "replica_hours": round(replica_hours, 6),
        }
