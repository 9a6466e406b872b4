"""Hardware profiles from disk: the bundled ``kvroute/profiles/*.yaml`` (package data) or a YAML file.

The edge of :mod:`kvroute.perf`: nothing here runs at import (no directory listing, no read), so
importing the policy layer or the simulator opens no data file; runtimes call :func:`load_profile`
when a scenario, a config or a command names a profile.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from kvroute.errors import ConfigError
from kvroute.perf.profile import HardwareProfile


class ProfileError(ConfigError):
    """An unknown or invalid hardware profile."""


def profile_dir() -> Path:
    """The folder of the bundled profiles (package data)."""
    return Path(str(resources.files("kvroute") / "profiles"))


def available_profiles() -> list[str]:
    """Names of the bundled profiles (``src/kvroute/profiles/*.yaml``)."""
    return sorted(p.stem for p in profile_dir().glob("*.yaml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """A bundled profile by name, or a profile YAML file by path; unknown names list the bundled ones, invalid
    fields are named (ProfileError)."""
    path = profile_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        path = Path(name_or_path)
    if not path.is_file():
        raise ProfileError(f"unknown profile {name_or_path!r}; available: {', '.join(available_profiles())}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping of profile fields")
    try:
        return HardwareProfile(**data)
    except ValidationError as err:
        e = err.errors()[0]
        raise ProfileError(f"{path}: field {'.'.join(map(str, e['loc']))}: {e['msg']}") from None
