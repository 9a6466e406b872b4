"""Residency: a request pinned to a zone is served only inside it (pure: no I/O, no clock).

A request is pinned by the ``x-kvroute-residency`` header or by its API key's ``zone``. Every
place that can send a request somewhere keeps it in its zone through the policy's hard filter
(``kvroute.policy.base.hard_filter``): ``Policy.decide`` for replicas, and both peer decisions
(SkyWalker's peer Router runs the same filter; GORGO's cost comparison applies it). A forward
carries the pin in the same header, so the next gateway filters again with its own replicas.
"""

from __future__ import annotations

from kvroute.errors import ClientError

RESIDENCY_HEADER = "x-kvroute-residency"
REGION_HEADER = "x-kvroute-region"  # the client's region (a routing hint, not a pin)


class ResidencyConflict(ClientError):
    """The request asks for a zone its API key is not pinned to (answered 403)."""


def request_zone(header_zone: str | None, key_zone: str | None) -> str | None:
    """The zone a request must stay in: its key's pin, else the header's, else none.

    A header naming another zone than the key's pin is refused rather than ignored: the client
    asked for something the key may not have."""
    if key_zone is None:
        return header_zone or None
    if header_zone and header_zone != key_zone:
        raise ResidencyConflict(f"this API key is pinned to zone {key_zone!r}; the request asked for "
                                f"{header_zone!r} ({RESIDENCY_HEADER})")
    return key_zone


