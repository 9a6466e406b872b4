"""What can be composed: the registered plugins and presets, and the decorators that add to them.

Built-in plugins register on import (:mod:`kvroute.policy.builtin`), built-in presets likewise
(:mod:`kvroute.policy.presets`); packages outside the tree register theirs the same way from an
entry point of the group ``kvroute.policies`` (loaded by :mod:`kvroute.policy.registry`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from kvroute.errors import ConfigError
from kvroute.policy.compose import Preset
from kvroute.policy.params import PolicyParams
from kvroute.policy.plugins import KINDS, Plugin, Scorer, check_inputs

P = TypeVar("P", bound=type[Plugin])
T = TypeVar("T", bound=type[PolicyParams])

PLUGINS: dict[str, dict[str, type[Plugin]]] = {kind: {} for kind in KINDS}
PRESETS_TABLE: dict[str, Preset] = {}


def register_plugin(cls: P) -> P:
    """Class decorator: make a plugin available by its ``name`` to every preset and config."""
    if not cls.name or cls.kind not in PLUGINS:
        raise TypeError(f"{cls.__name__}: a plugin needs a name and must subclass one of "
                        f"{', '.join(k.__name__ for k in KINDS.values())}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TypeError(f"{cls.__name__}: a {cls.kind} plugin must implement {missing}")
    try:
        check_inputs(f"{cls.kind} {cls.name!r}", cls.inputs)
    except ValueError as exc:
        raise TypeError(str(exc)) from None
    table = PLUGINS[cls.kind]
    if table.get(cls.name, cls) is not cls:
        raise ConfigError(f"{cls.kind} {cls.name!r} is already registered (by {table[cls.name].__module__})")
    table[cls.name] = cls
    return cls


def new_scorer(name: str, args: dict[str, Any] | None = None) -> Scorer:
    """A registered scorer, built with ``args`` (none: its defaults), for plugins that combine others'
    values. An unknown name or a bad argument is a ``ValueError`` naming what is allowed."""
    cls = PLUGINS["scorer"].get(name)
    if cls is None:
        raise ValueError(f"unknown scorer {name!r}; valid scorers: {', '.join(PLUGINS['scorer'])}")
    try:
        scorer = cls(**(args or {}))
    except TypeError:
        allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ValueError(f"scorer {name!r}: bad arguments {args!r}; arguments: {', '.join(allowed) or 'none'}") \
            from None
    assert isinstance(scorer, Scorer)
    return scorer


def add_preset(preset: Preset) -> Preset:
    """Register ``preset`` under its name (a second preset of the same name is an error). Not
    compiled here: :func:`kvroute.policy.registry.register` checks a preset from data first."""
    old = PRESETS_TABLE.get(preset.name)
    if old is not None and old != preset:
        raise ConfigError(f"preset {preset.name!r} is already registered (from {old.origin})")
    PRESETS_TABLE[preset.name] = preset
    return preset


def register_preset(name: str, *, source: str = "", **spec: Any) -> Callable[[T], T]:
    """Decorator on a parameter model: register a preset called ``name`` whose parameters are
    keys of :mod:`kvroute.policy.compose`). It is compiled when first built, not on import: a
    plugin may need what the runtime provides at start-up (a hardware profile); the tests compile
    every built-in preset, and :func:`kvroute.policyfiles.load_entry_points` those of other
    packages."""

    def wrap(params: T) -> T:
        add_preset(Preset(name, params, spec, source, params.__doc__ or "", params.__module__))
        return params
    return wrap
