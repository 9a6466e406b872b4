"""The one tree of errors kvroute raises on purpose.

Every error a user can cause or meet derives from :class:`KvrouteError`, so ``cli.main`` catches
one class and prints one line (never a traceback). Three branches say whose fault it is:

* :class:`ConfigError` — a file, flag, preset, scenario, profile or trace that cannot be used
  (exit code 2). Its message names file:line / the field / the allowed values; ``loc`` is the
  path of the offending item inside its file, for a caller that holds the text to name the line.
* :class:`ClientError` — an HTTP request the gateway cannot serve as sent: the ``status`` to
  answer and the ``param`` it concerns (the OpenAI error object's ``param``).
* :class:`ServiceError` — something kvroute talks to or runs failed or refused: an engine, a
  peer gateway, a child process, a measurement (exit code 1).

This module imports nothing from kvroute: every layer may raise these.
"""

from __future__ import annotations

Loc = tuple[str | int, ...]


class KvrouteError(Exception):
    """Base of every error kvroute raises on purpose (reported as one line)."""


class ConfigError(KvrouteError, ValueError):
    """An unusable configuration; ``loc`` is the path of the offending item (keys and list
    indices) inside its file. A ValueError too, so pydantic validators may raise it."""

    def __init__(self, msg: str, loc: Loc = ()):
        super().__init__(msg)
        self.loc = loc


class ClientError(KvrouteError, ValueError):
    """A request that cannot be served as sent: answer ``status`` with the message, naming
    ``param`` (the request field it concerns) when known."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class ServiceError(KvrouteError):
    """A component kvroute depends on at run time failed or refused (engine, peer, process,
    measurement)."""


def exit_code(exc: KvrouteError) -> int:
    """The command-line exit code for ``exc``: 2 for bad input (configuration, request), else 1."""
    return 1 if isinstance(exc, ServiceError) else 2
