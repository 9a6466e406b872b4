"""The built-in plugins, registered on import: filters, scorers, conditions, pickers, routes."""

from kvroute.policy.builtin import conditions, filters, pickers, routes, scorers

__all__ = ["conditions", "filters", "pickers", "routes", "scorers"]
