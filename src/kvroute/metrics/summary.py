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
    """Mean and p50/p90/p95/p99 of ``values`` (zeros when there are none), rounded to µs."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    pct = np.percentile(arr, PERCENTILES)
    out = {"mean": round(float(arr.mean()), 6)}
    out.update({f"p{q}": round(float(v), 6) for q, v in zip(PERCENTILES, pct)})
    return out


def window_token_rate(sent, first, done, out) -> float:
    """Output tokens generated while requests arrive, per second of the arrival window.

    The window runs from the first to the last arrival among ``sent``. A request's tokens count
    by when they are generated: all of them if it finished inside the window, none if its first
    token came after it, else one token at the first token plus the rest spread linearly between
    first token and finish. The simulator does not record each token's time, so that linear
    spread is an approximation of the decode schedule. This is the rate that falls once a
    system is overloaded and puts prefill before decode (CascadeInfer §6.3: "Throughput declines
    once the request rate exceeds a threshold, as all systems prioritize prefilling over
    decoding"); tokens ÷ time to the last response (``output_tps``) cannot fall that way.
    """
    s = np.asarray(sent, dtype=np.float64)
    if s.size == 0:
        return 0.0
    f = np.asarray(first, dtype=np.float64)
    d = np.asarray(done, dtype=np.float64)
    o = np.asarray(out, dtype=np.float64)
    t0, t1 = float(s.min()), float(s.max())
    if t1 <= t0:
        return 0.0
    frac = np.clip((t1 - f) / np.maximum(d - f, 1e-12), 0.0, 1.0)
    partial = np.minimum(o, 1.0 + np.maximum(o - 1.0, 0.0) * frac)
    tokens = np.where(d <= t1, o, np.where(f >= t1, 0.0, partial))
    return float(tokens.sum()) / (t1 - t0)


class Recorder:
    """Per-request measurements of one simulated run, in flat arrays, and the summaries built from them."""

    def __init__(self, replica_ids: list[str], regions: list[str] | None = None):
        self.replica_ids = replica_ids
        self.replica_regions = regions or ["local"] * len(replica_ids)
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
        self.client_regions: dict[str, int] = {}  # region → code in ``client``
        self.client = array("b")  # client region code per completed request
        self.path = array("b")  # 0 local, 1 served in another region by the client's LB, 2 forwarded
        self.failed: dict[str, int] = {}
        self.branches: dict[str, int] = {}
        self.sample_t = array("d")
        self.sample_running: list[array] = [array("i") for _ in replica_ids]
        self.sample_backlog = array("i")  # requests issued and not yet finished or failed
        self.sample_lb_queue = array("i")  # requests held in load-balancer queues
        self.sample_served = array("i")  # completions so far
        self.sample_issued = array("i")  # requests issued so far

    def complete(self, sent: float, first: float, done: float, out: int, prompt: int, cached: int,
                 queue_s: float, replica: str, cross: bool, client_region: str = "local",
                 forwarded: bool = False) -> None:
        """Record one served request: its times (sent, first token, done), tokens, queueing and where it ran."""
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
        code = self.client_regions.get(client_region)
        if code is None:
            code = self.client_regions[client_region] = len(self.client_regions)
        self.client.append(code)
        self.path.append(2 if forwarded else 1 if cross else 0)

    def breakdown(self) -> dict:
        """Per client region and per path (local / remote / forwarded): count, TTFT, E2E, hit rate.

        Pooled percentiles hide what cross-region routing does: a forwarded request trades an
        RTT for a shorter queue or a cache hit, and only these groups show which it got.
        """
        if not self.completed:
            return {"by_client_region": {}, "by_path": {}}
        ttft = np.frombuffer(self.ttft, dtype=np.float64)
        e2e = np.frombuffer(self.e2e, dtype=np.float64)
        prompt = np.frombuffer(self.prompt_tokens, dtype=np.int64)
        cached = np.frombuffer(self.cached_tokens, dtype=np.int64)
        client = np.frombuffer(self.client, dtype=np.int8)
        path = np.frombuffer(self.path, dtype=np.int8)

        def group(mask) -> dict:
            p = int(prompt[mask].sum())
            return {"requests": int(mask.sum()), "ttft_s": summarize(ttft[mask]), "e2e_s": summarize(e2e[mask]),
                    "prefix_hit_rate": round(int(cached[mask].sum()) / p, 6) if p else 0.0}

        by_region = {r: group(client == code) for r, code in sorted(self.client_regions.items())}
        by_path = {name: group(path == code) for code, name in enumerate(("local", "remote", "forwarded"))
                   if (path == code).any()}
        return {"by_client_region": by_region, "by_path": by_path}

    def fail(self, reason: str) -> None:
        """Count a failed request under the reason's kind (the text before the first colon)."""
        kind = reason.split(":", 1)[0]
        self.failed[kind] = self.failed.get(kind, 0) + 1

    def sample(self, t: float, running: list[int], backlog: int = 0, lb_queue: int = 0,
               issued: int = 0) -> None:
        """Record one periodic sample: running requests per replica, backlog, LB queue, requests issued."""
        self.sample_t.append(t)
        for col, r in zip(self.sample_running, running):
            col.append(r)
        self.sample_backlog.append(backlog)
        self.sample_lb_queue.append(lb_queue)
        self.sample_served.append(len(self.ttft))
        self.sample_issued.append(issued)

    def slo(self, ttft_s: float, tpot_s: float, issued: int) -> dict:
        """Requests meeting both the TTFT and the TPOT objective; failed requests never do."""
        n = self.completed
        if not n:
            return {"ttft_s": ttft_s, "tpot_s": tpot_s, "met": 0, "attainment": 0.0, "goodput_rps": 0.0}
        ttft = np.frombuffer(self.ttft, dtype=np.float64)
        tpot = np.frombuffer(self.tpot, dtype=np.float64)
        met = int(np.count_nonzero((ttft <= ttft_s) & (tpot <= tpot_s)))
        span = max(self.done_at) - min(self.sent_at)
        return {"ttft_s": ttft_s, "tpot_s": tpot_s, "met": met,
                "attainment": round(met / issued, 6) if issued else 0.0,
                "goodput_rps": round(met / span, 6) if span > 0 else 0.0}

    def load(self, first_issue: float, last_issue: float, issued: int, closed_loop: bool) -> dict:
        """Offered vs served rate over the arrival window, and whether the backlog kept growing.

        Offered = requests issued ÷ arrival window; served = requests completed within that same
        window ÷ its length (not completed ÷ makespan, which hides a queue that drains after the
        last arrival). An open-loop run is unstable when it served less than 90 % of what was
        offered, or when the backlog (issued, not finished) in the window's last quarter averages
        more than twice its second quarter's. A closed loop is stable by construction — clients
        wait for answers, so the offered rate follows service — and says so.
        """
        window = last_issue - first_issue
        done = np.frombuffer(self.done_at, dtype=np.float64)
        served = int(np.count_nonzero(done <= last_issue)) if done.size else 0
        offered_rps = issued / window if window > 0 else 0.0
        served_rps = served / window if window > 0 else 0.0
        t = np.frombuffer(self.sample_t, dtype=np.float64)
        backlog = np.frombuffer(self.sample_backlog, dtype=np.int32).astype(np.float64)
        growth = 1.0
        if window > 0 and t.size:
            q = lambda a, b: backlog[(t >= first_issue + a * window) & (t <= first_issue + b * window)]  # noqa: E731
            early, late = q(0.25, 0.5), q(0.75, 1.0)
            if early.size and late.size:
                growth = float(late.mean()) / max(1.0, float(early.mean()))
        if closed_loop:
            stable, why = True, "closed loop: the offered rate follows service"
        elif window <= 0:
            stable, why = True, "a single arrival instant"
        elif served_rps < 0.9 * offered_rps or growth > 2.0:
            stable = False
            why = (f"served {served_rps:.3g} of {offered_rps:.3g} req/s offered; the backlog grew "
                   f"{growth:.1f}x over the arrival window")
        else:
            stable, why = True, "served ≥ 90 % of the offered rate, backlog not growing"
        return {"offered_rps": round(offered_rps, 6), "served_rps": round(served_rps, 6),
                "window_s": round(window, 6), "backlog_growth": round(growth, 3),
                "max_backlog": int(backlog.max()) if backlog.size else 0,
                "closed_loop": closed_loop, "stable": stable, "verdict": why}

    @property
    def completed(self) -> int:
        """Number of requests served."""
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

    def window_output_tps(self) -> float:
        """Output tokens generated between the first and the last arrival of the served requests,
        per second of that window (see ``window_token_rate``; failed requests are not in it)."""
        sent = np.frombuffer(self.sent_at, dtype=np.float64)
        first = sent + np.frombuffer(self.ttft, dtype=np.float64)
        return window_token_rate(sent, first, np.frombuffer(self.done_at, dtype=np.float64),
                                 np.frombuffer(self.out_tokens, dtype=np.int64))

    def result(self, replica_hours: float) -> dict:
        """The run's summary: latency percentiles, throughput, hit rate, imbalance, failures, load verdict."""
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
            "window_output_tps": round(self.window_output_tps(), 6),
            "prefix_hit_rate": round(sum(self.cached_tokens) / prompt, 6) if prompt else 0.0,
            "imbalance_cv": round(cv, 6),
            "imbalance_max_min": round(ratio, 6) if ratio != float("inf") else None,
            "cross_region_forwards": self.forwarded,
            "cross_region_served": self.cross_region,
            "branches": dict(sorted(self.branches.items())),
            "makespan_s": round(span, 6),
            "replica_hours": round(replica_hours, 6),
            **self.breakdown(),
        }
