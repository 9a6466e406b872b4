"""Turn a preset's spec and a parameter instance into a :class:`~kvroute.policy.compose.Pipeline`.

Errors are :class:`~kvroute.policy.compose.ConfigError` with the path of the offending item
(``loc``), naming the valid plugins or arguments, so a YAML caller can point at file:line.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvroute.errors import ConfigError
from kvroute.policy.catalog import PLUGINS
from kvroute.policy.compose import PRESET_KEYS, RULE_KEYS, Pipeline, Preset, Rule
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import Condition, Filter, Picker, Plugin, Route, Scorer, check_inputs
from kvroute.policy.shared import sharing
from kvroute.policy.state import Turns

Loc = tuple[str | int, ...]


def resolve(value: Any, params: PolicyParams, loc: Loc) -> Any:
    """``value`` with every ``"$name"`` replaced by that parameter's value (recursively)."""
    if isinstance(value, str) and value.startswith("$"):
        name = value[1:]
        if not hasattr(params, name):
            valid = ", ".join(type(params).model_fields)
            raise ConfigError(f"{'.'.join(map(str, loc))}: unknown parameter {value!r}; parameters: {valid}", loc)
        return getattr(params, name)
    if isinstance(value, Mapping):
        return {resolve(k, params, loc): resolve(v, params, (*loc, str(k))) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [resolve(v, params, (*loc, i)) for i, v in enumerate(value)]
    return value


def make_plugin(kind: str, ref: Any, params: PolicyParams, loc: Loc, seed: int = 0) -> Plugin:
    """One plugin from ``name``, ``{name: value}`` or ``{name: {arg: value}}``."""
    where = ".".join(map(str, loc))
    if isinstance(ref, Mapping) and len(ref) == 1:
        ((name, args),) = ref.items()
    elif isinstance(ref, str):
        name, args = ref, None
    else:
        raise ConfigError(f"{where}: expected a {kind} name or {{name: arguments}}, got {ref!r}", loc)
    name = resolve(name, params, loc)
    table = PLUGINS[kind]
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"{where}: unknown {kind} {name!r}; valid {kind}s: {', '.join(table)}", loc)
    args = resolve(args, params, loc)
    sig = inspect.signature(cls.__init__)
    extra = {"seed": seed} if "seed" in sig.parameters else {}  # stateful plugins seed their RNGs
    try:
        if args is None:
            plugin = cls(**extra)
        elif isinstance(args, Mapping):
            plugin = cls(**args, **extra)
        else:
            plugin = cls(args, **extra)  # type: ignore[call-arg]  # one argument, given plainly
    except (TypeError, ValueError) as exc:
        allowed = [p for p in sig.parameters if p not in ("self", "seed")]
        msg = str(exc) if isinstance(exc, ValueError) else (
            f"bad arguments {args!r}; arguments: {', '.join(allowed) or 'none'}")
        raise ConfigError(f"{where}: {kind} {name!r}: {msg}", loc) from None
    try:  # an instance may widen its class's inputs (a tuned sum reads what its terms read)
        check_inputs(f"{kind} {name!r}", plugin.inputs)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}", loc) from None
    plugin.config = args
    return plugin


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def compile_rule(spec: Mapping[str, Any], params: PolicyParams, loc: Loc, keys: tuple[str, ...],
                 seed: int = 0) -> Rule | None:
    """One rule (None when ``enabled`` resolves false)."""
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise ConfigError(f"{'.'.join(map(str, loc)) or 'policy'}: unknown key(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(keys)}", (*loc, unknown[0]))
    if "enabled" in spec and not resolve(spec["enabled"], params, (*loc, "enabled")):
        return None
    branch = str(resolve(spec.get("branch", "rule"), params, (*loc, "branch")))
    when = tuple(make_plugin("condition", r, params, (*loc, "when", i), seed)
                 for i, r in enumerate(_listed(spec.get("when", []))))
    among = tuple(make_plugin("filter", r, params, (*loc, "among", i), seed)
                  for i, r in enumerate(_listed(spec.get("among", []))))
    plugins: list[Plugin] = [*when, *among]
    if "route" in spec:
        clash = sorted({"cost", "score", "picker"} & set(spec))
        if clash:
            raise ConfigError(f"{'.'.join(map(str, (*loc, 'route')))}: a coded route scores and picks "
                              f"itself; drop {', '.join(clash)}", (*loc, clash[0]))
        route = make_plugin("route", spec["route"], params, (*loc, "route"), seed)
        assert isinstance(route, Route)
        return Rule(branch, _typed(when, Condition), _typed(among, Filter), route=route,
                    plugins=(*plugins, route))
    if "cost" in spec and "score" in spec:
        raise ConfigError(f"{'.'.join(map(str, loc)) or 'policy'}: give cost (raw, lower wins) or score "
                          "(normalised, higher wins), not both", (*loc, "score"))
    normalised = "score" in spec
    key = "score" if normalised else "cost"
    weights = resolve(spec.get(key, {}), params, (*loc, key))
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{'.'.join(map(str, (*loc, key)))}: expected {{scorer: weight}}, got {weights!r}",
                          (*loc, key))
    scorers: list[tuple[Scorer, float]] = []
    for name, w in weights.items():
        at = (*loc, key, name)
        args = None
        if isinstance(w, Mapping):  # {scorer: {weight: w, argument: value, ...}}
            args = {k: v for k, v in w.items() if k != "weight"}
            w = w.get("weight", 1.0)
        if not isinstance(w, int | float) or isinstance(w, bool):
            raise ConfigError(f"{'.'.join(map(str, at))}: weight must be a number, got {w!r}", at)
        s = make_plugin("scorer", {name: args} if args else name, params, at, seed)  # checked even when off
        assert isinstance(s, Scorer)
        if w == 0:  # adds 0 × its value: not scored, and its lifecycle hooks not called (issue 25: auto's
            continue  # behind_prefill, 0 by default, kept waiting counts on every request otherwise)
        scorers.append((s, float(w)))
    default_picker = "argmax" if normalised else "argmin"
    picker = make_plugin("picker", spec.get("picker", default_picker), params, (*loc, "picker"), seed)
    assert isinstance(picker, Picker)
    if picker.needs_values and not weights:  # terms all weighted 0 still score: all equal
        raise ConfigError(f"{'.'.join(map(str, loc)) or 'policy'}: picker {picker.name!r} needs scores: "
                          "add cost or score", (*loc, "picker"))
    turns = getattr(picker, "turns", None)  # plain round robin: the rule takes the turn itself (compose.py)
    return Rule(branch, _typed(when, Condition), _typed(among, Filter), tuple(scorers), normalised, picker,
                plugins=(*plugins, *(s for s, _ in scorers), picker),
                turns=turns if isinstance(turns, Turns) and not scorers else None)


def _typed(items: tuple[Plugin, ...], cls: type[Any]) -> tuple[Any, ...]:
    assert all(isinstance(p, cls) for p in items)
    return items


def compile_preset(preset: Preset, params: PolicyParams, seed: int = 0) -> Pipeline:
    """The policy ``preset`` composes, with ``params`` bound into its plugins; plugins of this policy that
    ask for shared state by one name get one object (:mod:`kvroute.policy.shared`), other policies their own."""
    with sharing():
        return _compile_preset(preset, params, seed)


def _compile_preset(preset: Preset, params: PolicyParams, seed: int) -> Pipeline:
    spec = preset.spec
    unknown = sorted(set(spec) - set(PRESET_KEYS))
    if unknown:
        raise ConfigError(f"preset {preset.name!r}: unknown key(s) {', '.join(unknown)}; "
                          f"allowed: {', '.join(PRESET_KEYS)}", (unknown[0],))
    filters = tuple(make_plugin("filter", r, params, ("filters", i), seed)
                    for i, r in enumerate(_listed(spec.get("filters", []))))
    rules: list[Rule] = []
    for i, r in enumerate(_listed(spec.get("rules", []))):
        if not isinstance(r, Mapping):
            raise ConfigError(f"rules.{i}: expected a mapping of {', '.join(RULE_KEYS)}", ("rules", i))
        rule = compile_rule(r, params, ("rules", i), RULE_KEYS, seed)
        if rule is not None:
            rules.append(rule)
    final = {k: v for k, v in spec.items() if k in ("cost", "score", "picker", "route", "branch")}
    if final:
        rule = compile_rule(final, params, (), RULE_KEYS, seed)
        if rule is not None:
            rules.append(rule)
    if not rules:
        raise ConfigError(f"preset {preset.name!r}: no rule (give cost, score, picker or rules)", ())
    return Pipeline(preset, params, seed, _typed(filters, Filter), tuple(rules))


def parse_params(preset: Preset, values: Mapping[str, Any] | None) -> PolicyParams:
    """Validate user overrides against the preset's parameter model (strict: unknown → error)."""
    if values is not None and not isinstance(values, Mapping):
        raise ConfigError(f"preset {preset.name!r}: params must be a mapping, got {type(values).__name__}",
                          ("params",))
    try:
        return preset.params(**(values or {}))
    except ValidationError as err:
        valid = ", ".join(preset.params.model_fields)
        lines: list[str] = []
        loc: Loc = ("params",)
        for e in err.errors():
            fld = ".".join(str(x) for x in e["loc"]) or "params"
            loc = ("params", *e["loc"])
            if e["type"] == "extra_forbidden":
                lines.append(f"unknown parameter {fld!r}; valid parameters: {valid}")
            else:
                msg = e["msg"].removeprefix("Value error, ")
                lines.append(f"parameter {fld!r}: {msg} (got {e.get('input')!r})")
        raise ConfigError(f"preset {preset.name!r}: " + "; ".join(lines), loc) from None


def check_preset(preset: Preset) -> None:
    """Compile ``preset`` with its default parameters, so a broken one fails when registered."""
    compile_preset(preset, parse_params(preset, None))
