"""Shared machinery of `kvroute reproduce`: rows, scenario runs, agreement rules.

A row states one claim of a paper, the paper's number, kvroute's number from the closest
simulated setup, whether they agree, and — when they do not — why (setup, model limit, missing
data). The setups are bundled scenario files (``kvroute/scenarios/reproduce/``); anyone can rerun
one with ``kvroute simulate reproduce/NAME``. Agreement is judged on direction first,
then rough size; no model constant is ever adjusted to make a row agree (reproduction.md).

Seeds: a :class:`Lab` runs every scenario at one seed (``Lab.seed``, 1 unless told; the scenario
files all say ``seed: 1``, so seed 1 is the files' own run) and every workload a paper module builds
itself draws from that seed too. ``kvroute reproduce --seeds N`` builds each paper's rows at seeds
1..N (N odd) and judges each row by the *median of its per-seed verdicts* on the ordinal scale
no < direction only < yes (:func:`median_verdict`; "n/a" and "not implemented" rank below "no").
A row's numbers are those of the lowest seed whose verdict is that median, and the row names it
(:func:`combine`, in ``reproduce/seeds.py``). The rule was adopted after issue 21u showed two
CascadeInfer rows changing sign between seeds 1-6: one draw cannot settle a tail or a CV, and the
same holds for every row whose effect is small against the seed spread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvroute.parallel import Executor
from kvroute.sim.runner import run_scenario_on
from kvroute.sim.scenario import SCENARIO_DIR, load_scenario, parse_scenario

QUICK_FRACTION = 0.4  # --quick runs this share of each scenario's requests
QUICK_MIN_REQUESTS = 300

YES, DIRECTION, NO, NOT_IMPLEMENTED, NOT_MODELLED = (
    "yes", "direction only", "no", "not implemented", "n/a")


@dataclass
class Row:
    """One claim: paper vs kvroute."""

    claim: str
    paper: str
    kvroute: str
    agrees: str
    why_not: str = ""
    experiment: str = ""
    seed_note: str = ""  # a few of this seed's numbers, listed for every seed when rows are judged over seeds

    def as_dict(self) -> dict:
        """The row as a plain dict (for JSON)."""
        return asdict(self)


@dataclass
class Lab:
    """Runs the reproduction scenarios (each at most once per set of overrides) and keeps what ran."""

    quick: bool = False
    seed: int = 1  # the seed every scenario (and every workload a paper module builds) draws from
    seeds: tuple[int, ...] = (1,)  # every seed of this reproduction (rows that quote the others read it)
    progress: Callable[[str], None] | None = None
    executor: Executor = field(default_factory=Executor)  # where a scenario's policies run (in parallel)
    runs: dict = field(default_factory=dict)  # experiment key → {label: result}
    meta: dict = field(default_factory=dict)  # experiment key → scenario file, requests, wall time
    rows: list = field(default_factory=list)  # the paper's rows at this seed, once built (reproduce/seeds.py)

    def scenario(self, name: str, overrides: dict | None = None, requests: int | None = None):
        """A reproduction scenario with overrides merged in and the request count scaled for --quick."""
        sc = load_scenario(str(SCENARIO_DIR / "reproduce" / f"{name}.yaml"))
        data = sc.model_dump(exclude_none=True)
        data["seed"] = self.seed  # an override may still name another seed (a row's own check)
        for key, value in (overrides or {}).items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        n = requests or data.get("limits", {}).get("max_requests")
        if n and self.quick:
            n = max(QUICK_MIN_REQUESTS, int(n * QUICK_FRACTION))
        if n:
            data.setdefault("limits", {})["max_requests"] = n
        return parse_scenario(data, f"reproduce/{name}")

    def run(self, name: str, key: str | None = None, overrides: dict | None = None,
            requests: int | None = None) -> dict:
        """Run every policy of a scenario once (cached by key); returns results by policy label."""
        key = key or name
        if key in self.runs:
            return self.runs[key]
        sc = self.scenario(name, overrides, requests)
        if self.progress:
            self.progress(f"running {key} ({sc.limits.max_requests or 'all'} requests, "
                          f"{len(sc.policies)} policies)")
        t0 = time.perf_counter()
        results = {r.label: r.result for r in run_scenario_on(sc, self.executor)}
        self.runs[key] = results
        self.meta[key] = {"scenario": f"reproduce/{name}", "overrides": overrides or {},
                          "requests": sc.limits.max_requests, "wall_s": round(time.perf_counter() - t0, 2),
                          "unstable": [lbl for lbl, r in results.items() if not r["load"]["stable"]]}
        return results


# -- agreement rules ------------------------------------------------------------------------------

# the ordinal scale a row's verdicts are medians on; anything else ("n/a", "not implemented") ranks below "no"
RANK = {NO: 0, DIRECTION: 1, YES: 2}


def median_verdict(verdicts: list[str]) -> str:
    """The median of per-seed verdicts on the scale no < direction only < yes (an odd count: a verdict of
    the list; "n/a" and "not implemented" rank below "no")."""
    if not verdicts or len(verdicts) % 2 == 0:
        raise ValueError(f"a median verdict needs an odd number of verdicts, got {len(verdicts)}")
    return sorted(verdicts, key=lambda v: RANK.get(v, -1))[len(verdicts) // 2]


def ratio_agreement(values: list[float], lo: float, hi: float) -> str:
    """Claims of the form "X is lo–hi times Y" (values are kvroute's X/Y ratios).

    yes: every ratio on the paper's side of 1 and within a factor of two of the paper's effect
    (log-ratio between half the low end's and twice the high end's); direction only: on the
    right side of 1; no: otherwise.
    """
    if not values:
        return NO
    up = hi >= 1 and lo >= 1
    side = all((v > 1) if up else (v < 1) for v in values)
    if not side:
        return NO
    e = [abs(math.log(v)) for v in values]
    elo, ehi = sorted((abs(math.log(lo)), abs(math.log(hi))))
    return YES if all(0.5 * elo <= x <= 2 * ehi for x in e) else DIRECTION


def similar(value: float, tolerance: float = 0.10) -> str:
    """Claims of the form "X ≈ Y": yes within ±10 %, else no."""
    return YES if abs(value - 1) <= tolerance else NO


def fmt_range(values: list[float], fmt: str = "{:.2f}×") -> str:
    """A value, or lo–hi when the values differ."""
    if not values:
        return "–"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if math.isclose(lo, hi, rel_tol=1e-3) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def pct(x: float) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{x * 100:.1f} %"


def unstable_note(lab: Lab, key: str) -> str:
    """A note naming the experiment's runs whose load verdict was unstable (empty when none)."""
    bad = lab.meta.get(key, {}).get("unstable") or []
    return f" (UNSTABLE runs: {', '.join(bad)}; their latencies measure a queue)" if bad else ""
