"""Policies from outside the process: YAML files and the ``kvroute.policies`` entry points.

The policy layer (``kvroute.policy``) does no I/O, so what reads files or imports installed
packages lives here and hands the pure registry mappings and classes:

* :func:`load_policy_file` and :func:`register_preset_file` read a YAML file with
  :mod:`kvroute.yamlconf` and pass its mapping to :mod:`kvroute.policy.registry`; an error the
  registry raises names the item it concerns (``ConfigError.loc``), which becomes file:line here.
* :func:`load_entry_points` installs :func:`kvroute.perf.loader.load_profile` as the policy
  layer's profile source (:mod:`kvroute.policy.profiles`), then imports what the
  ``kvroute.policies`` entry points name (a module that registers with the decorators of
  :mod:`kvroute.policy.catalog`, a :class:`~kvroute.policy.compose.Preset` or a plugin class)
  and registers it.
  Runtimes call it once at start-up: the CLI, :func:`kvroute.gateway.config.load_config`, the
  gateway and the simulator's scenario parsing. A program that builds policies through
  ``kvroute.policy`` alone calls it first to see presets shipped outside the tree.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from kvroute import yamlconf
from kvroute.errors import ConfigError
from kvroute.perf.loader import load_profile
from kvroute.policy.base import Policy
from kvroute.policy.catalog import PRESETS_TABLE, add_preset, register_plugin
from kvroute.policy.compiler import check_preset
from kvroute.policy.compose import Preset
from kvroute.policy.plugins import Plugin
from kvroute.policy.profiles import install_profile_source
from kvroute.policy.registry import policy_from_config, register_preset_mapping

ENTRY_POINT_GROUP = "kvroute.policies"
_entry_points_loaded = False


def load_entry_points(force: bool = False) -> None:
    """Install the hardware-profile loader, then import and register what the ``kvroute.policies``
    entry points name (once; ``force``: again), compiling each preset they add with its defaults.
    A broken entry point is a one-line ConfigError naming it."""
    global _entry_points_loaded
    if _entry_points_loaded and not force:
        return
    _entry_points_loaded = True
    install_profile_source(load_profile)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        before = set(PRESETS_TABLE)
        try:
            obj = ep.load()
            if isinstance(obj, Preset):
                add_preset(obj)
            elif isinstance(obj, type) and issubclass(obj, Plugin):
                register_plugin(obj)
            for name in set(PRESETS_TABLE) - before:  # checked here: decorators only register
                check_preset(PRESETS_TABLE[name])
        except Exception as exc:  # one line naming the broken entry point, never a traceback
            raise ConfigError(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP} "
                              f"failed to load: {type(exc).__name__}: {exc}") from None


def _at(path: str | Path, text: str, exc: ConfigError) -> ConfigError:
    """``exc`` with file:line in front (the line of the item its ``loc`` names)."""
    line = yamlconf.line_of(text, exc.loc) if exc.loc else None
    msg = str(exc)
    if msg.startswith(f"{path}: "):
        msg = msg[len(f"{path}: "):]
    return ConfigError(f"{path}:{line}: {msg}" if line else f"{path}: {msg}", exc.loc)


def _read(path: str | Path) -> tuple[Any, str]:
    try:
        return yamlconf.read(path)
    except yamlconf.ConfigFileError as exc:
        raise ConfigError(str(exc)) from None


def load_policy_file(path: str | Path, seed: int = 0) -> Policy:
    """A policy from a YAML file: ``{preset, params}`` or a composition; errors name file:line."""
    load_entry_points()
    data, text = _read(path)
    try:
        return policy_from_config(data, seed=seed, where=str(path))  # a non-mapping is its error to name
    except ConfigError as exc:
        raise _at(path, text, exc) from None


def register_preset_file_text(source: str, text: str) -> str:
    """:func:`register_preset_file` on a file's text (a parallel worker that cannot read the caller's file)."""
    import yaml

    load_entry_points()
    try:
        return register_preset_mapping(yaml.safe_load(text), source)  # the caller parsed it once already
    except ConfigError as exc:
        raise _at(source, text, exc) from None


def register_preset_file(path: str | Path) -> str:
    """Register the preset a YAML file composes (it must have a ``name``); returns the name."""
    load_entry_points()
    data, text = _read(path)
    try:
        return register_preset_mapping(data, str(path))
    except ConfigError as exc:
        raise _at(path, text, exc) from None
