"""Build a policy by name or from a config mapping; register presets composed in a mapping.

A policy config, as a dict (read from YAML by the caller), names a preset (with constant
overrides) or composes plugins directly (the keys of :mod:`kvroute.policy.compose`)::

    preset: sglang_cache_aware
    params: {cache_threshold: 0.6, admission: pending}

    # or
    admission: pending
    filters: [residency]
    cost: {lmetric: 1}

A preset file adds ``name`` (and optionally ``params``: its own parameters with their
defaults, ``description``, ``source``) and is registered by :func:`register_preset_mapping`.
Everything here is pure: reading the files, and importing presets shipped outside the tree
(the ``kvroute.policies`` entry points), is :mod:`kvroute.policyfiles`' work. An error names
the item it concerns in ``ConfigError.loc``, so the reader of a file can say file:line.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pydantic import Field, create_model

from kvroute.errors import ConfigError
from kvroute.policy import presets as _builtin_presets  # noqa: F401  (registers the built-ins)
from kvroute.policy.base import Policy
from kvroute.policy.catalog import PLUGINS, PRESETS_TABLE, add_preset
from kvroute.policy.compiler import check_preset, compile_preset, parse_params
from kvroute.policy.compose import PRESET_KEYS, Preset
from kvroute.policy.params import AdmissionName, PolicyParams, admission_field

__all__ = ["PRESETS", "ConfigError", "build_policy", "plugin_table", "policy_from_config", "preset_and_params",
           "preset_from_mapping", "register", "register_preset_mapping"]

FILE_KEYS = ("name", "description", "source", "params", "admission", *PRESET_KEYS)

# the registered presets by name, read-only (entry points join once kvroute.policyfiles loads them)
PRESETS: Mapping[str, Preset] = MappingProxyType(PRESETS_TABLE)


def build_policy(preset: str, params: dict[str, Any] | None = None, seed: int = 0) -> Policy:
    """The preset called ``preset`` with ``params`` overriding its defaults; ``seed`` seeds its
    random choices (tie-breaks, sampling)."""
    spec = PRESETS.get(preset)
    if spec is None:
        raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    return compile_preset(spec, parse_params(spec, params), seed=seed)


def register(preset: Preset) -> Preset:
    """Compile ``preset`` with its defaults (a broken one fails here, naming the item), then
    register it: presets from files, mappings and entry points come this way."""
    check_preset(preset)
    return add_preset(preset)


def preset_from_mapping(data: Mapping[str, Any], where: str, name: str | None = None) -> Preset:
    """A preset from a composition mapping (a preset file, or an inline policy config)."""
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(FILE_KEYS)}",
                          (unknown[0],))
    declared = data.get("params") or {}
    if not isinstance(declared, Mapping):
        raise ConfigError(f"{where}: params: expected a mapping of parameter: default", ("params",))
    fields: dict[str, Any] = {}
    for key, default in declared.items():
        if key in PolicyParams.model_fields:
            raise ConfigError(f"{where}: params.{key}: a parameter of every policy; set it with "
                              f"'{key}:' at the top level", ("params", key))
        if not isinstance(default, bool | int | float | str):
            raise ConfigError(f"{where}: params.{key}: a default must be a number, a string or a boolean, "
                              f"got {default!r}", ("params", key))
        fields[key] = (type(default), Field(default))
    if "admission" in data:
        allowed = ("blind", "pending", "outstanding")
        if data["admission"] not in allowed:
            raise ConfigError(f"{where}: admission: {data['admission']!r}; allowed: {', '.join(allowed)}",
                              ("admission",))
        fields["admission"] = (AdmissionName, admission_field(data["admission"]))
    label = str(data.get("name") or name or "composed")
    model = create_model(f"Params_{label}", __base__=PolicyParams, **fields)
    spec = {k: v for k, v in data.items() if k in PRESET_KEYS}
    return Preset(label, model, spec, str(data.get("source", "")), str(data.get("description", "")), where)


def policy_from_config(config: dict[str, Any] | str, seed: int = 0, where: str = "policy",
                       overrides: dict[str, Any] | None = None) -> Policy:
    """Build from ``"name"``, ``{preset: name, params: {...}}`` or a composition mapping;
    ``overrides`` replace parameters whatever the form (e.g. the peer layer's admission)."""
    if isinstance(config, str):
        return build_policy(config, overrides, seed=seed)
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a preset name or a mapping, got {type(config).__name__}")
    if "preset" in config:
        unknown = sorted(set(config) - {"preset", "params"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: preset, params",
                              (unknown[0],))
        params = config.get("params")
        if overrides:
            params = {**(params if isinstance(params, dict) else {}), **overrides}
        return build_policy(config["preset"], params, seed=seed)
    if not set(config) & set(PRESET_KEYS):
        raise ConfigError(f"{where}: missing 'preset' (or a composition: {', '.join(PRESET_KEYS)}); "
                          f"valid presets: {', '.join(PRESETS)}")
    preset = preset_from_mapping(config, where)
    return compile_preset(preset, parse_params(preset, overrides), seed=seed)


def preset_and_params(config: dict[str, Any] | str, where: str = "policy") -> tuple[str, dict[str, Any] | None]:
    """The preset name and params a policy config means, for callers that build by name (the
    simulator's balancers): a composition is registered under its ``name`` (default: ``where``),
    replacing what the same config place registered before."""
    if isinstance(config, str):
        return config, None
    if "preset" in config:
        return config["preset"], config.get("params")
    preset = preset_from_mapping(config, where, name=where)
    old = PRESETS_TABLE.get(preset.name)
    if old is not None and old.origin == where:
        del PRESETS_TABLE[preset.name]
    register(preset)
    return preset.name, None


def register_preset_mapping(data: Any, origin: str) -> str:
    """Register the preset a composition mapping defines (it must have a ``name``); returns the
    name. ``origin`` (e.g. the file it came from) may register the same name again: its new
    version replaces the old; another origin's name is an error at ``name``."""
    if not isinstance(data, dict) or not data.get("name"):
        raise ConfigError(f"{origin}: a preset file needs 'name' (and the keys {', '.join(PRESET_KEYS)})")
    if data["name"] in PRESETS_TABLE and PRESETS_TABLE[data["name"]].origin != origin:
        raise ConfigError(f"name: preset {data['name']!r} already exists", ("name",))
    preset = preset_from_mapping(data, origin)
    check_preset(preset)  # before the old version goes
    PRESETS_TABLE.pop(preset.name, None)  # the same origin registered again: its new version
    add_preset(preset)
    return preset.name


def plugin_table() -> dict[str, dict[str, str]]:
    """Every registered plugin by kind: name → one-line summary."""
    return {kind: {name: cls.summary() for name, cls in table.items()} for kind, table in PLUGINS.items()}
