"""State that the plugins of one policy share, by name, while the policy compiles.

A preset may name the same learning plugin in several places: ``auto`` judges with the incumbent's
score (``lmetric_speed``) in its final rule, in the challenger's trust regions and in the least-work
rule's trust region, each a copy built from the same settings. Each copy learning a replica-speed fit
of its own repeats the same arithmetic at every first token and completion (the fit's refresh was most
of ``auto``'s CPU per request). :func:`shared` lets such copies build one object between them:
:func:`kvroute.policy.compiler.compile_preset` opens a scope (:func:`sharing`) per policy it compiles,
so the copies of one policy share, and two policies — two load balancers, two presets side by side —
never do. Outside a scope every call builds its own object, as before. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

T = TypeVar("T")

_SCOPE: ContextVar[dict[Hashable, Any] | None] = ContextVar("kvroute_policy_shared", default=None)


@contextmanager
def sharing() -> Iterator[None]:
    """A scope in which :func:`shared` hands one object per key to every plugin built inside it."""
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def shared(key: Hashable, make: Callable[[], T]) -> T:
    """The object built for ``key`` in the current scope (``make()`` the first time); outside a scope,
    ``make()``. The key must name everything the object depends on (its settings), so that only
    plugins that would have built equal objects get the same one."""
    table = _SCOPE.get()
    if table is None:
        return make()
    if key not in table:
        table[key] = make()
    obj: T = table[key]
    return obj
