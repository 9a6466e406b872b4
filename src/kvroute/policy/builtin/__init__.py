"""The built-in plugins, registered on import: filters, scorers, conditions, pickers, routes, and
the plugins that learn while serving (``learning``)."""

# ruff: noqa: I001  (scorers first: listings and error messages name them in this order)
from kvroute.policy.builtin import scorers, filters, conditions, pickers, routes, learning, warmup, pd

__all__ = ["conditions", "filters", "learning", "pd", "pickers", "routes", "scorers", "warmup"]
