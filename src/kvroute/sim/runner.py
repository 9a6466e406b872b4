"""Run every policy of a scenario on the identical workload and collect the results."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvroute.metrics import Recorder
from kvroute.parallel import Executor
from kvroute.sim.scenario import Scenario, parse_scenario
from kvroute.sim.simulation import Simulation


@dataclass
class PolicyRun:
    """One policy's simulated run: its label, result dict, the Recorder with per-request data, and trace lines
    skipped."""

    label: str
    result: dict
    recorder: Recorder
    skipped_lines: int = 0


def run_scenario(sc: Scenario, on_start: Callable[[str], None] | None = None,
                 on_progress: Callable[[str, int], None] | None = None) -> list[PolicyRun]:
    """Simulate every policy of ``sc`` on a freshly seeded copy of the same workload; ``on_start`` /
    ``on_progress`` report per policy."""
    policies = sc.policy_list()
    setups = {topo: sc.setup(topo) for topo in {p.topology for p in policies}}
    runs = []
    for label, preset, params, topo in policies:
        setup = setups[topo]
        workload = sc.make_workload()  # fresh and identically seeded for every policy
        if on_start:
            on_start(label)
        progress = (lambda n, label=label: on_progress(label, n)) if on_progress else None
        sim = Simulation(setup, preset, params, workload, progress)
        result = sim.run()
        skipped = getattr(workload, "skipped", 0)
        if skipped:
            result["skipped_lines"] = skipped
        runs.append(PolicyRun(label, result, sim.recorder, skipped))
        if on_progress:
            on_progress(label, sim.recorder.completed)
    return runs


def policy_task(task: tuple[dict, str]) -> PolicyRun:
    """One policy of a scenario from ``(scenario data, policy label)``: self-contained, for any executor."""
    data, label = task
    sc = parse_scenario(data, data.get("name", "scenario"))
    for entry in sc.policy_list():
        if entry.label == label:
            workload = sc.make_workload()
            sim = Simulation(sc.setup(entry.topology), entry.preset, entry.params, workload)
            result = sim.run()
            skipped = getattr(workload, "skipped", 0)
            if skipped:
                result["skipped_lines"] = skipped
            return PolicyRun(label, result, sim.recorder, skipped)
    raise KeyError(label)


def run_scenario_on(sc: Scenario, executor: Executor) -> list[PolicyRun]:
    """:func:`run_scenario` with every policy a task of ``executor`` (same results, in policy order)."""
    data = sc.model_dump(exclude_none=True)
    return executor.map(policy_task, [(data, p.label) for p in sc.policy_list()])


def report(sc: Scenario, runs: list[PolicyRun]) -> dict:
    """The JSON document `kvroute simulate` writes: scenario, seed, replica count, workload, SLO and each
    policy's result."""
    return {"scenario": sc.name, "seed": sc.seed,
            "replicas": sum(g.count for g in sc.replicas),
            "workload": sc.workload.kind,
            "slo": sc.slo.model_dump(),
            "results": {r.label: r.result for r in runs}}
