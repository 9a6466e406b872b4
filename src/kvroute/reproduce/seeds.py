"""A paper's rows judged over several seeds: each seed's rows built on its own :class:`Lab`, then one
row per claim whose verdict is the median of the per-seed verdicts.

The rule (common.py's docstring has why): the verdict is :func:`~kvroute.reproduce.common.median_verdict`
of the seeds' verdicts (an odd number of seeds); the numbers, the "why not" and the seed note are those
of the lowest seed whose verdict is the median, and the row says which seed that is and lists every
seed's verdict ("seeds 1–3: no, yes, yes"). Every seed's own row travels in the JSON (``per_seed``).

The seeds' scenarios go to the same executor as the policies do: with a process pool or Ray, each
seed's rows are built in a thread of their own that hands its runs to the shared executor, so the
seeds' simulations run side by side; a serial executor builds the seeds one after another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvroute.parallel import Executor
from kvroute.reproduce.common import Lab, Row, median_verdict


def seed_span(seeds: list[int]) -> str:
    """``seed 1`` or ``seeds 1–3`` (consecutive) or ``seeds 1, 4, 5``."""
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}–{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


class _Shared(Executor):
    """One seed's view of the shared executor: every run is a submitted task (a pool would run a
    one-policy run in the calling thread, where it would hold the interpreter the other seeds need)."""

    def __init__(self, inner: Executor):
        super().__init__(inner.workers)
        self.inner = inner
        self.kind = inner.kind

    def submit(self, fn: Callable[[Any], Any], item: Any) -> Any:
        """As the shared executor's."""
        return self.inner.submit(fn, item)

    def wait(self, tasks: Iterable[Any]) -> list[Any]:
        """As the shared executor's."""
        return self.inner.wait(tasks)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Every item a task of the shared executor, results in item order."""
        return self._map_tasks(fn, list(items), on_done)

    def describe(self) -> str:
        """As the shared executor's."""
        return self.inner.describe()


def run_seeds(fn: Callable[[Lab], list[Row]], seeds: list[int], quick: bool, executor: Executor,
              progress: Callable[[str], None] | None = None) -> dict[int, Lab]:
    """Build a paper's rows at every seed; returns each seed's Lab with its rows in ``lab.rows``."""
    def build(seed: int, ex: Executor) -> Lab:
        say = progress if progress is None or len(seeds) == 1 else (lambda m, s=seed: progress(f"seed {s}: {m}"))
        lab = Lab(quick=quick, seed=seed, seeds=tuple(seeds), progress=say, executor=ex)
        lab.rows = fn(lab)
        return lab

    if len(seeds) == 1 or executor.kind == "serial":
        return {s: build(s, executor) for s in seeds}
    with ThreadPoolExecutor(len(seeds), thread_name_prefix="reproduce-seed") as threads:
        futures = {s: threads.submit(build, s, _Shared(executor)) for s in seeds}
        return {s: f.result() for s, f in futures.items()}


def combine(per_seed: dict[int, list[Row]]) -> list[dict]:
    """One row per claim: the median verdict over the seeds, the numbers of the lowest seed with that
    verdict (``seed``), every seed's verdict (``seed_verdicts``) and row (``per_seed``)."""
    seeds = sorted(per_seed)
    counts = {len(rows) for rows in per_seed.values()}
    if len(counts) != 1:
        raise RuntimeError(f"reproduce: the seeds built different numbers of rows ({sorted(counts)})")
    out = []
    for i in range(counts.pop()):
        rows = [per_seed[s][i] for s in seeds]
        if len({r.claim for r in rows}) != 1:
            raise RuntimeError(f"reproduce: row {i} states different claims at different seeds: {rows[0].claim!r}")
        verdicts = [r.agrees for r in rows]
        median = median_verdict(verdicts)
        shown = verdicts.index(median)
        out.append({**rows[shown].as_dict(), "agrees": median, "seed": seeds[shown], "seeds": seeds,
                    "seed_verdicts": verdicts, "per_seed": [r.as_dict() for r in rows]})
    return out


def agrees_cell(row: dict) -> str:
    """The verdict, and over several seeds each seed's verdict and whose numbers the row shows: ``yes (seeds
    1–3: all yes)`` (the numbers are the first seed's), ``yes (seeds 1–3: no, yes, yes; numbers: seed 2)``."""
    seeds = row.get("seeds") or []
    if len(seeds) <= 1:
        return row["agrees"]
    verdicts = row["seed_verdicts"]
    if len(set(verdicts)) == 1:
        return f"{row['agrees']} ({seed_span(seeds)}: all {row['agrees']})"
    return f"{row['agrees']} ({seed_span(seeds)}: {', '.join(verdicts)}; numbers: seed {row['seed']})"


def kvroute_cell(row: dict) -> str:
    """kvroute's numbers, and over several seeds each seed's note when the row keeps one."""
    per = row.get("per_seed") or []
    if len(per) <= 1 or not any(r.get("seed_note") for r in per):
        return row["kvroute"]
    notes = "; ".join(f"seed {s}: {r['seed_note']} ({r['agrees']})" for s, r in zip(row["seeds"], per, strict=True))
    return f"{row['kvroute']}. Per seed: {notes}"
