"""Build a policy by name, from a config mapping, or from a YAML file.

A policy config, in YAML or as a dict, names a preset (with constant overrides) or composes
plugins directly (the keys of :mod:`kvroute.policy.compose`)::

    preset: sglang_cache_aware
    params: {cache_threshold: 0.6, admission: pending}

    # or
    admission: pending
    filters: [residency]
    cost: {lmetric: 1}

A preset file adds ``name`` (and optionally ``params``: its own parameters with their
defaults, ``description``, ``source``) and is registered by :func:`register_preset_file`.
Presets shipped outside the tree register through the entry-point group ``kvroute.policies``
(an entry point names a module that registers with the decorators of
:mod:`kvroute.policy.catalog`, or a :class:`~kvroute.policy.compose.Preset`, or a plugin
class); those load once, on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import Field, create_model

from kvroute import yamlconf
from kvroute.policy import presets as _builtin_presets  # noqa: F401  (registers the built-ins)
from kvroute.policy.base import Policy
from kvroute.policy.catalog import PLUGINS, PRESETS_TABLE, add_preset, register_plugin, register_policy_class
from kvroute.policy.compiler import compile_preset, instantiate, parse_params
from kvroute.policy.compose import PRESET_KEYS, ConfigError, Preset
from kvroute.policy.params import AdmissionName, PolicyParams, admission_field
from kvroute.policy.plugins import Plugin

__all__ = ["PRESETS", "ConfigError", "build_policy", "load_entry_points", "load_policy_file", "plugin_table",
           "policy_from_config", "preset_and_params", "preset_from_mapping", "register_preset_file"]

ENTRY_POINT_GROUP = "kvroute.policies"
FILE_KEYS = ("name", "description", "source", "params", "admission", *PRESET_KEYS)
_entry_points_loaded = False


def load_entry_points(force: bool = False) -> None:
    """Import what the ``kvroute.policies`` entry points name (once; ``force``: again)."""
    global _entry_points_loaded
    if _entry_points_loaded and not force:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if isinstance(obj, Preset):
                add_preset(obj)
            elif isinstance(obj, type) and issubclass(obj, Plugin):
                register_plugin(obj)
            elif isinstance(obj, type) and issubclass(obj, Policy):
                register_policy_class(obj)
        except Exception as exc:  # one line naming the broken entry point, never a traceback
            raise ConfigError(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP} "
                              f"failed to load: {type(exc).__name__}: {exc}") from None


class _Presets(Mapping[str, Preset]):
    """The registered presets by name; entry points load on first access."""

    def __getitem__(self, name: str) -> Preset:
        load_entry_points()
        return PRESETS_TABLE[name]

    def __iter__(self) -> Iterator[str]:
        load_entry_points()
        return iter(list(PRESETS_TABLE))

    def __len__(self) -> int:
        load_entry_points()
        return len(PRESETS_TABLE)


PRESETS: Mapping[str, Preset] = _Presets()


def build_policy(preset: str, params: dict[str, Any] | None = None, seed: int = 0) -> Policy:
    """The preset called ``preset`` with ``params`` overriding its defaults; ``seed`` seeds its
    random choices (tie-breaks, sampling)."""
    spec = PRESETS.get(preset)
    if spec is None:
        raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    return instantiate(spec, parse_params(spec, params), seed=seed)


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
    load_entry_points()
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
    load_entry_points()
    preset = preset_from_mapping(config, where, name=where)
    old = PRESETS_TABLE.get(preset.name)
    if old is not None and old.origin == where:
        del PRESETS_TABLE[preset.name]
    add_preset(preset)
    return preset.name, None


def _at(path: str | Path, text: str, exc: ConfigError) -> ConfigError:
    """``exc`` with file:line in front (the line of the item its ``loc`` names)."""
    line = yamlconf.line_of(text, exc.loc) if exc.loc else None
    msg = str(exc)
    if msg.startswith(f"{path}: "):
        msg = msg[len(f"{path}: "):]
    return ConfigError(f"{path}:{line}: {msg}" if line else f"{path}: {msg}", exc.loc)


def load_policy_file(path: str | Path, seed: int = 0) -> Policy:
    """A policy from a YAML file: ``{preset, params}`` or a composition; errors name file:line."""
    try:
        data, text = yamlconf.read(path)
    except yamlconf.ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return policy_from_config(data, seed=seed, where=str(path))
    except ConfigError as exc:
        raise _at(path, text, exc) from None


def register_preset_file(path: str | Path) -> str:
    """Register the preset a YAML file composes (it must have a ``name``); returns the name."""
    try:
        data, text = yamlconf.read(path)
    except yamlconf.ConfigFileError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(data, dict) or not data.get("name"):
        raise ConfigError(f"{path}: a preset file needs 'name' (and the keys {', '.join(PRESET_KEYS)})")
    load_entry_points()
    if data["name"] in PRESETS_TABLE and PRESETS_TABLE[data["name"]].origin != str(path):
        raise _at(path, text, ConfigError(f"name: preset {data['name']!r} already exists", ("name",)))
    try:
        preset = preset_from_mapping(data, str(path))
        PRESETS_TABLE.pop(preset.name, None)  # the same file registered again: its new version
        add_preset(preset)
    except ConfigError as exc:
        raise _at(path, text, exc) from None
    return preset.name


def plugin_table() -> dict[str, dict[str, str]]:
    """Every registered plugin by kind: name → one-line summary."""
    load_entry_points()
    return {kind: {name: cls.summary() for name, cls in table.items()} for kind, table in PLUGINS.items()}
