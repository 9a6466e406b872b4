"""Hardware profiles by name, for the plugins that model an engine (the llm_d predictor).

The policy layer reads no file, so a profile name is turned into a
:class:`~kvroute.perf.profile.HardwareProfile` by a source the runtime installs once at start-up:
:func:`kvroute.policyfiles.load_entry_points` (called by the CLI, the gateway's config loader and
scenario parsing) installs :func:`kvroute.perf.loader.load_profile`. A program that builds
policies through ``kvroute.policy`` alone installs one itself, or passes profile objects.
"""

from __future__ import annotations

from typing import Protocol

from kvroute.perf.profile import HardwareProfile


class ProfileSource(Protocol):
    """Returns the profile a name (or a file path) means; raises ValueError for an unknown one."""

    def __call__(self, name_or_path: str, /) -> HardwareProfile: ...


_source: list[ProfileSource] = []  # at most one: the installed source


def install_profile_source(source: ProfileSource) -> None:
    """Use ``source`` to resolve profile names from now on (replacing any earlier one)."""
    _source[:] = [source]


def resolve_profile(ref: str | HardwareProfile) -> HardwareProfile:
    """``ref`` as a profile: an object as it is, a name through the installed source."""
    if isinstance(ref, HardwareProfile):
        return ref
    if not _source:
        raise ValueError(f"hardware profile {ref!r}: no profile source is installed (call "
                         "kvroute.policyfiles.load_entry_points() at start-up, or pass a HardwareProfile)")
    return _source[0](ref)
