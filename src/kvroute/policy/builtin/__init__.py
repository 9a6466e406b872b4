"""The built-in plugins, registered on import: filters, scorers, conditions, pickers, routes, and
the plugins that learn while serving (one package each under :mod:`kvroute.policy.adaptive`)."""

# ruff: noqa: I001  (scorers first: listings and error messages name them in this order)
from kvroute.policy.builtin import scorers, filters, conditions, pickers, routes
from kvroute.policy.adaptive import es_tuner, ttft_fit, hotspot, predictor, replica_speed  # noqa: F401  (registers es, calibration, hotspot, predictor, lmetric_speed)
from kvroute.policy.builtin import warmup, pd

__all__ = ["conditions", "filters", "pd", "pickers", "routes", "scorers", "warmup"]
