"""The base of every pydantic model that validates a user's file (gateway config, scenario,
deployment, policy parameters). No I/O here, so the pure policy layer can build on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

from kvroute.errors import ConfigError

T = TypeVar("T")


class StrictModel(BaseModel):
    """Base of every model read from user files: an unknown key is an error, not silently ignored,
    so a misspelt option fails at load time with its file:line; so is a NaN or infinite number (YAML's
    ``.nan`` / ``.inf``), which would pass every ``gt``/``le`` bound and compare false ever after."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def checked(check: Callable[[T], object], v: T) -> T:
    """``v`` once ``check(v)`` accepted it (a field validator's body): a ConfigError it raises becomes
    the ValueError pydantic reports at the field, with the file:line of the value."""
    try:
        check(v)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return v
