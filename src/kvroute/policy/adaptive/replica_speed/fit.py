"""Each replica's speed, learned online from the TTFTs and TPOTs the load balancer measures.

A fleet of mixed hardware (two A100s beside six L4s) serves the same request 3× faster on some
replicas than on others. llm-d's predictor reads each replica's hardware profile; a live gateway
may not (issue 22: only its own accounting, engine metrics and measured latencies, a profile
calibrated online). This module calibrates that profile online, per replica:

* **prefill** — at every first token, the TTFT beyond the probed RTT against the prefill work the
  router had queued on the replica when it dispatched the request, this request's uncached
  tokens included (``Endpoint.queued_prefill_tokens`` at dispatch). Exponentially weighted least
  squares ``TTFT − RTT ≈ a_r + b_r · work`` (half-life ``halflife`` observations). The replica's
  prefill *time* is that line evaluated at the fleet's mean work: where an ordinary least squares
  line is most precise, and the same work for every replica, so the intercept (a step's fixed
  cost, scheduling) and the slope (time per token) both count, whatever load each replica had.
* **decode** — at every completion, (E2E − TTFT) / (output tokens − 1): the mean time per output
  token, weighted by tokens, with the same half-life.

Relative speeds are what routing needs: each replica's time over the median of the replicas that
have ``min_samples`` observations (a replica without them counts as the median). The fleet is
judged mixed only when both the prefill times and the decode times spread by more than ``spread``
(max ÷ min, 1.5), and significantly so — some replica's time ``z`` standard errors down above
``spread`` × another's ``z`` standard errors up, so a few noisy samples cannot fake it. On few
observations an estimated standard error is itself uncertain, so the bound is Student's t at the
confidence ``z`` gives under a normal law (``z`` = 2, 95.45 %: 13.97 standard errors at 1 degree of
freedom, 3.31 at 3, 2.09 at 30): the test then needs no sample floor beyond what a standard error
needs (3 first tokens for a line, 2 completions for a mean). The pair
tested is the most certain one (the highest lower bound against the lowest upper bound), not the
two extreme point estimates: those are the replicas with the fewest or noisiest samples, and on 2
A100 + 6 L4 the test on them lost a 2× decode gap whenever load spread the A100s' TPOTs. Another GPU generation
differs in compute and in memory bandwidth alike, while the load imbalance and prefix-cache luck of
a homogeneous fleet move one measure at a time (with prefill alone, tree-of-thought runs flipped to
"mixed" early on a handful of samples). Otherwise every factor is 1 and a fleet of one hardware
kind routes exactly as without this module. Once judged mixed, the fleet stays so (a replica's
hardware does not change under its id): a decode time measured under load mixes the hardware with
the load, and on 2 A100 + 6 L4 at half the knee the A100s' TPOTs, growing with the load sent to them,
closed the decode gap below significance mid-run, the fleet flipped back to "one kind", and the next
burst went to the L4s (22e's diagnosis; the factors keep following the measured times).

:meth:`SpeedFit.predict_ttft` reads each replica's fitted line at the work a request would find
there: a TTFT predicted from the load balancer's own measurements (``lmetric_speed``'s
``ttft_pick``).

The estimate feeds back on itself, stabilisingly: a replica given more load queues more, its
measured times grow, its factor grows, and it is given less. Pure: times arrive as arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import median

DEFAULT_HALFLIFE = 128  # observations per replica over which an old one's weight halves
# the fewest observations a standard error needs: a line through 2 points, a mean of 1, has no residual
LINE_FLOOR, RATIO_FLOOR = 3, 2
Z90 = 1.2815515655446004  # the standard normal's 90th percentile (a replica's p90 TPOT, as llm-d predicts it)


@lru_cache(maxsize=256)
def t_quantile(z: float, dof: int) -> float:
    """Student's t critical value with ``dof`` degrees of freedom at the two-sided confidence that
    ``z`` standard errors give under a normal law (z = 2: 95.45 %; dof 1: 13.97, 3: 3.31, 30: 2.09).

    A standard error estimated from n observations is itself uncertain; ``z`` of them is a valid
    bound only for large n (Student 1908). Bisection on P(|T| ≤ t), Simpson's rule on the density."""
    if dof <= 0:
        return math.inf
    conf = math.erf(z / math.sqrt(2.0))
    c = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def mass(t: float) -> float:
        n, h = 400, t / 400
        acc = 0.0
        for i in range(n + 1):
            density: float = c * math.pow(1.0 + (i * h) ** 2 / dof, -(dof + 1) / 2)
            acc += density * (1 if i in (0, n) else 4 if i % 2 else 2)
        return 2.0 * acc * h / 3.0

    lo, hi = z, max(z, 1e-6)
    while mass(hi) < conf:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mass(mid) < conf else (lo, mid)
    return hi


@dataclass(slots=True)
class _Line:
    """Exponentially weighted least squares of y on x (sums of weights, x, x², y, y², x·y)."""

    n: int = 0
    w: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.n += 1
        self.w = self.w * decay + 1.0
        self.sx = self.sx * decay + x
        self.sxx = self.sxx * decay + x * x
        self.sy = self.sy * decay + y
        self.syy = self.syy * decay + y * y
        self.sxy = self.sxy * decay + x * y

    def _slope(self) -> tuple[float, float, float, float]:
        """(mean x, mean y, slope ≥ 0, weighted variance of x)."""
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        slope = (self.sxy / self.w - mx * my) / var if var > 1e-9 * max(1.0, mx * mx) else 0.0
        return mx, my, max(0.0, slope), var

    def at(self, x: float) -> float:
        """The fitted line at ``x`` (the mean of y when x did not vary); never below 0."""
        mx, my, slope, _ = self._slope()
        return max(0.0, my + slope * (x - mx))

    def resid_sd(self) -> float:
        """Standard deviation of the residuals around the line (inf for two observations or fewer)."""
        if self.w <= 2.0 + 1e-9:
            return float("inf")
        mx, my, slope, var = self._slope()
        vy = self.syy / self.w - my * my
        cov = self.sxy / self.w - mx * my
        return math.sqrt(max(0.0, vy - 2.0 * slope * cov + slope * slope * var) * self.w / (self.w - 2.0))

    def se_at(self, x: float) -> float:
        """Standard error of :meth:`at` (the sum of weights standing for the sample size); inf for two
        observations or fewer (a line through them has no residual)."""
        if self.w <= 2.0 + 1e-9:
            return float("inf")
        mx, my, slope, var = self._slope()
        vy = self.syy / self.w - my * my
        cov = self.sxy / self.w - mx * my
        rss = max(0.0, vy - 2.0 * slope * cov + slope * slope * var) * self.w  # residual sum of squares
        s2 = rss / (self.w - 2.0)
        lever = (x - mx) ** 2 / (var * self.w) if var > 1e-9 * max(1.0, mx * mx) else 0.0
        return math.sqrt(s2 * (1.0 / self.w + lever))


@dataclass(slots=True)
class _Ratio:
    """Exponentially weighted ratio of sums (decode seconds over output tokens), with the weighted
    moments of the per-observation ratios for its standard error."""

    n: int = 0
    num: float = 0.0
    den: float = 0.0
    w: float = 0.0
    r: float = 0.0
    rr: float = 0.0

    def add(self, num: float, den: float, decay: float) -> None:
        self.n += 1
        self.num = self.num * decay + num
        self.den = self.den * decay + den
        q = num / den if den > 0 else 0.0
        self.w = self.w * decay + 1.0
        self.r = self.r * decay + q
        self.rr = self.rr * decay + q * q

    def sd(self) -> float:
        """Weighted standard deviation of the per-observation ratios; 0 for one observation."""
        if self.w <= 1.0 + 1e-9:
            return 0.0
        m = self.r / self.w
        return math.sqrt(max(0.0, self.rr / self.w - m * m) * self.w / (self.w - 1.0))

    def se(self) -> float:
        """Standard error of the mean per-observation ratio; inf for one observation."""
        if self.w <= 1.0 + 1e-9:
            return float("inf")
        m = self.r / self.w
        var = max(0.0, self.rr / self.w - m * m) * self.w / (self.w - 1.0)
        return math.sqrt(var / self.w)


class SpeedFit:
    """Per-replica prefill and decode times from measured TTFTs and completions, and the relative
    factors routing multiplies a replica's load by (1 = the fleet's median speed)."""

    def __init__(self, min_samples: int = 16, halflife: int = DEFAULT_HALFLIFE, spread: float = 1.5,
                 z: float = 2.0):
        if z < 0:
            raise ValueError(f"z must be >= 0, got {z}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        if halflife < 1:
            raise ValueError(f"halflife must be >= 1, got {halflife}")
        if spread < 1:
            raise ValueError(f"spread must be >= 1, got {spread}")
        self.min_samples, self.spread, self.z = min_samples, spread, z
        self.decay = 0.5 ** (1.0 / halflife)
        self._prefill: dict[str, _Line] = {}
        self._decode: dict[str, _Ratio] = {}
        self._work = _Ratio()  # the fleet's mean prefill work per request (num: tokens, den: requests)
        self._wait = _Ratio()  # the fleet's mean TTFT − RTT per request (num: seconds, den: requests)
        self._pending: dict[str, tuple[str, float, float]] = {}  # req → (replica, work, rtt)
        self._ttft: dict[str, float] = {}  # req → measured TTFT
        # the load: this fit's requests in flight per replica, each request's count at dispatch (its own included),
        # and per replica a line of time per output token on that count (read as the requests' mean count over
        # their lifetime: the count at dispatch and at completion, averaged)
        self._where: dict[str, str] = {}
        self._count: dict[str, int] = {}
        self._n0: dict[str, int] = {}
        self._tpot: dict[str, _Line] = {}
        # recomputed at each observation, never while deciding (Router.decide stays a dry run)
        self._factors: tuple[dict[str, float], dict[str, float]] = ({}, {})
        self.judged_mixed = False  # set once, when both spreads first stood the test
        self.version = 0  # counts observations (a cache of anything derived from the estimates keys on it)

    # ---- observations -------------------------------------------------------------------------
    def dispatched(self, req_id: str, endpoint_id: str, work_tokens: int, rtt_s: float) -> None:
        """``req_id`` went to ``endpoint_id`` with ``work_tokens`` of prefill queued there (its own included)."""
        if req_id not in self._where:  # a shared fit hears each dispatch once per copy: count it once
            self._where[req_id] = endpoint_id
            n = self._count[endpoint_id] = self._count.get(endpoint_id, 0) + 1
            self._n0[req_id] = n
        self._pending[req_id] = (endpoint_id, float(work_tokens), rtt_s)

    def first_token(self, req_id: str, ttft_s: float) -> None:
        """The measured TTFT: one prefill observation for the request's replica."""
        p = self._pending.pop(req_id, None)
        if p is None:
            return
        ep, work, rtt = p
        self._ttft[req_id] = ttft_s
        line = self._prefill.get(ep)
        if line is None:
            line = self._prefill[ep] = _Line()
        line.add(work, max(0.0, ttft_s - rtt), self.decay)
        self._work.add(work, 1.0, self.decay)
        self._wait.add(max(0.0, ttft_s - rtt), 1.0, self.decay)
        self._refresh()

    def finished(self, req_id: str, endpoint_id: str, e2e_s: float, output_tokens: int) -> None:
        """A completion: one decode observation when its TTFT was seen and it decoded past one token."""
        self._pending.pop(req_id, None)
        ttft = self._ttft.pop(req_id, None)
        n1 = self._count.get(endpoint_id, 0)
        n0 = self._leave(req_id)
        if ttft is None or output_tokens < 2 or e2e_s <= ttft:
            return
        if n0 is not None:
            line = self._tpot.get(endpoint_id)
            if line is None:
                line = self._tpot[endpoint_id] = _Line()
            line.add((n0 + n1) / 2.0, (e2e_s - ttft) / (output_tokens - 1), self.decay)
        r = self._decode.get(endpoint_id)
        if r is None:
            r = self._decode[endpoint_id] = _Ratio()
        r.add(e2e_s - ttft, float(output_tokens - 1), self.decay)
        self._refresh()

    def forget(self, req_id: str) -> None:
        """The request failed or was re-routed: no observation."""
        self._pending.pop(req_id, None)
        self._ttft.pop(req_id, None)
        self._leave(req_id)

    def _leave(self, req_id: str) -> int | None:
        """The request is no longer in flight: its replica's count drops; returns its count at dispatch."""
        ep = self._where.pop(req_id, None)
        if ep is not None:
            self._count[ep] -= 1
        return self._n0.pop(req_id, None)

    # ---- estimates ----------------------------------------------------------------------------
    def _prefill_est(self) -> dict[str, tuple[float, float]]:
        """Per replica with enough first tokens (``min_samples``, at least 3): (fitted TTFT − RTT at the fleet's
        mean work, its SE × the t / z ratio for the line's n − 2 degrees of freedom)."""
        if self._work.den <= 0:
            return {}
        ref, floor = self._work.num / self._work.den, max(self.min_samples, LINE_FLOOR)
        return {ep: (line.at(ref), self._wide(line.se_at(ref), round(line.w) - 2)) for ep, line in self._prefill.items()
                if line.n >= floor}

    def _decode_est(self) -> dict[str, tuple[float, float]]:
        """Per replica with enough completions (``min_samples``, at least 2): (mean time per output token, its
        SE × the t / z ratio for n − 1 degrees of freedom)."""
        floor = max(self.min_samples, RATIO_FLOOR)
        return {ep: (r.num / r.den, self._wide(r.se(), round(r.w) - 1)) for ep, r in self._decode.items()
                if r.n >= floor and r.den > 0}

    def _wide(self, se: float, dof: int) -> float:
        """``se`` widened by Student's t over z for ``dof`` degrees of freedom, so that ``z`` × the result
        is the t bound (the test below multiplies by ``z``); 0 stays 0 (observations that agree exactly)."""
        if se <= 0 or self.z <= 0:
            return se
        return se * t_quantile(self.z, dof) / self.z

    def prefill_s(self) -> dict[str, float]:
        """Per replica with ``min_samples`` first tokens: its fitted TTFT − RTT at the fleet's mean work."""
        return {ep: t for ep, (t, _) in self._prefill_est().items()}

    def decode_s(self) -> dict[str, float]:
        """Per replica with ``min_samples`` completions: its mean time per output token."""
        return {ep: t for ep, (t, _) in self._decode_est().items()}

    def decode_p90_s(self) -> dict[str, float]:
        """Per replica with ``min_samples`` completions: its 90th percentile time per output token, read as
        the mean + 1.28 standard deviations of its recent requests' own times per token (normal law;
        llm-d's SLO scorer likewise compares a predicted p90 TPOT with the request's SLO)."""
        floor = max(self.min_samples, RATIO_FLOOR)
        return {ep: r.num / r.den + Z90 * r.sd() for ep, r in self._decode.items() if r.n >= floor and r.den > 0}

    def tpot_at(self, endpoint_id: str, inflight: float) -> tuple[float, float] | None:
        """The replica's time per output token predicted at ``inflight`` requests in flight: (mean, p90 — the
        line + 1.28 residual standard deviations); None before 3 completions. A replica's decode step grows with
        its batch (the requests it serves at once), which the load balancer's own count in flight is, always
        current — while a time measured at completion lags the load sent since by a request's lifetime."""
        line = self._tpot.get(endpoint_id)
        if line is None or line.n < LINE_FLOOR:
            return None
        mean = line.at(inflight)
        return mean, mean + Z90 * line.resid_sd()

    def wait_p90_s(self) -> float:
        """The fleet's 90th percentile TTFT − RTT, read as the weighted mean + 1.28 standard deviations of the
        measured waits (0 before any first token)."""
        return self.mean_wait_s() + Z90 * self._wait.sd() if self._wait.den > 0 else 0.0

    def _relative(self, est: dict[str, tuple[float, float]], test: bool = True) -> dict[str, float]:
        """Each time over the median; with ``test``, empty (all 1) unless some replica's time, ``z``
        standard errors down, is still more than ``spread`` × another's, ``z`` standard errors up: a
        spread that few noisy observations could fake does not count."""
        positive = {ep: te for ep, te in est.items() if te[0] > 0}
        if len(positive) < 2:
            return {}
        if test:
            slow = max(t - self.z * se for t, se in positive.values())
            fast = min(t + self.z * se for t, se in positive.values())
            if slow <= self.spread * fast:
                return {}
        mid = median(t for t, _ in positive.values())
        return {ep: t / mid for ep, (t, _) in positive.items()}

    def _refresh(self) -> None:
        self.version += 1
        test = not self.judged_mixed
        pf, df = self._relative(self._prefill_est(), test), self._relative(self._decode_est(), test)
        # hardware apart shows in both (compute and memory bandwidth); one measure alone apart is noise
        self._factors = (pf, df) if pf and df else ({}, {})
        self.judged_mixed = bool(pf and df) or self.judged_mixed

    def predict_ttft(self, work: list[tuple[str, float]]) -> list[float]:
        """Predicted TTFT − RTT per ``(replica, prefill work queued there with the request's own)``: the
        replica's fitted line at that work; a replica without ``min_samples`` (at least 3) first tokens gets the
        median of the others' predictions (0 when none has them)."""
        out = [self.line_at(ep, w) for ep, w in work]
        known = [v for v in out if v is not None]
        mid = median(known) if known else 0.0
        return [mid if v is None else v for v in out]

    def mean_wait_s(self) -> float:
        """The fleet's exponentially weighted mean TTFT − RTT (0 before any first token)."""
        return self._wait.num / self._wait.den if self._wait.den > 0 else 0.0

    def line_at(self, endpoint_id: str, work: float) -> float | None:
        """The replica's fitted TTFT − RTT at ``work`` prefill tokens; None without ``min_samples`` (at least 3)
        first tokens."""
        line = self._prefill.get(endpoint_id)
        return line.at(work) if line is not None and line.n >= max(self.min_samples, LINE_FLOOR) else None

    def factors(self) -> tuple[dict[str, float], dict[str, float]]:
        """(prefill, decode) factors per replica; a replica not listed counts as 1."""
        return self._factors

    def state(self) -> dict[str, float]:
        """Per replica: learned prefill time (ms at the fleet's mean work), decode ms per token, their
        factors and observations; ``mixed`` 1 while some factor is in use."""
        pf, df = self.factors()
        pre, dec = self.prefill_s(), self.decode_s()
        out: dict[str, float] = {"mixed": 1.0 if pf or df else 0.0}
        for ep in sorted(set(self._prefill) | set(self._decode)):
            out[f"{ep}.samples"] = float(self._prefill[ep].n if ep in self._prefill else 0)
            if ep in pre:
                out[f"{ep}.prefill_ms"] = 1000.0 * pre[ep]
            if ep in dec:
                out[f"{ep}.decode_ms_per_token"] = 1000.0 * dec[ep]
            out[f"{ep}.prefill_factor"] = pf.get(ep, 1.0)
            out[f"{ep}.decode_factor"] = df.get(ep, 1.0)
        return out
