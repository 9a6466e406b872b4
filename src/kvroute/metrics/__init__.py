"""Latency and throughput summaries, reports and plots.

:mod:`.stats` is pure Python and safe for the gateway; :mod:`.summary` (``Recorder``,
``summarize``) needs numpy (the ``[sim]`` extra) and is imported only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.metrics.summary import Recorder, summarize

__all__ = ["Recorder", "summarize"]


def __getattr__(name: str) -> Any:
    """Load ``Recorder`` / ``summarize`` from :mod:`.summary` on first use (it imports numpy)."""
    if name in __all__:
        from kvroute.metrics import summary
        return getattr(summary, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
