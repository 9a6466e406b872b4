"""The base of every pydantic model that validates a user's file (gateway config, scenario,
deployment, policy parameters). No I/O here, so the pure policy layer can build on it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of every model read from user files: an unknown key is an error, not silently ignored,
    so a misspelt option fails at load time with its file:line."""

    model_config = ConfigDict(extra="forbid")
