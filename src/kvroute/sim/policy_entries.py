"""One entry of a scenario's ``policies`` list: validated, labelled, with its own topology and
its simulator settings (what ``Scenario.policy_list`` returns, one entry at a time).

An entry is a preset name, ``{preset, params, topology, simulator}`` or a composition of plugins
(``{name, rules, cost, ...}``, docs/policies.md). ``simulator`` holds the simulator-only settings
of the migrating presets (``sim/migration_settings.py``); older files put them under ``params``,
which still works: the policy is built without them, and the run (its label, the Simulation)
carries both, for the simulator to split off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvroute.errors import ConfigError
from kvroute.policy import policy_from_config
from kvroute.policy.registry import preset_and_params
from kvroute.sim import migration_settings
from kvroute.sim.tracefiles import ScenarioError


class PolicyEntry(NamedTuple):
    """One policy to compare: its label in results, preset, parameters and an optional topology of its own."""

    label: str
    preset: str
    params: dict | None
    topology: str | None  # overrides the scenario's topology for this policy


def policy_entry(i: int, entry: str | dict[str, Any], topologies: Sequence[str], has_balancers: bool,
                 defaults: dict[str, Any] | None = None) -> PolicyEntry:
    """``policies[i]`` validated now (a typo fails before any run); ``defaults``: the scenario's
    simulator settings, under the entry's own and not in its label."""
    topo = None
    simulator: dict[str, Any] | None = None
    if isinstance(entry, dict) and ("topology" in entry or "simulator" in entry):
        entry = dict(entry)
        topo = entry.pop("topology", None)
        simulator = entry.pop("simulator", None)
        if topo is not None and topo not in topologies:
            raise ScenarioError(f"policies[{i}].topology: {topo!r}; allowed: {', '.join(topologies)}")
        if topo is not None and has_balancers:
            raise ScenarioError(f"policies[{i}].topology: give either 'balancers' or topologies, not both")
        if simulator is not None and not isinstance(simulator, dict):
            raise ScenarioError(f"policies[{i}].simulator: a mapping of simulator settings "
                                f"(sim/migration_settings.py), got {simulator!r}")
    try:
        if isinstance(entry, dict) and "preset" in entry:
            raw = entry.get("params") or {}
            if not isinstance(raw, dict):
                raise ScenarioError(f"policies[{i}].params: a mapping, got {raw!r}")
            own, _ = migration_settings.split(raw, simulator, f"policies[{i}].simulator")
            policy_from_config({**entry, "params": own or {}}, where=f"policies[{i}]")
            preset, params = entry["preset"], {**raw, **(simulator or {})} or None
        else:
            if simulator:
                raise ScenarioError(f"policies[{i}].simulator: give the policy as {{preset: NAME, simulator: {{...}}}}")
            policy_from_config(entry, where=f"policies[{i}]")
            preset, params = preset_and_params(entry, where=f"policies[{i}]")  # a composition: registered
    except (ConfigError, ValueError) as exc:
        raise ScenarioError(str(exc)) from None
    label = preset if not params else f"{preset}({','.join(f'{k}={v}' for k, v in sorted(params.items()))})"
    if topo:
        label += f"@{topo}"
    if defaults:
        params = {**defaults, **(params or {})}
    return PolicyEntry(label, preset, params, topo)
