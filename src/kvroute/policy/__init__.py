"""The pure policy layer: filters, admission, scorers and pickers, presets, and the Router."""

from kvroute.errors import ConfigError  # re-exported: plugin authors raise it
from kvroute.policy.base import Policy, PolicyParams, View
from kvroute.policy.pacing import DEFAULT_TICK_S, DispatchPacer
from kvroute.policy.registry import PRESETS, build_policy, policy_from_config
from kvroute.policy.router import Router

__all__ = ["DEFAULT_TICK_S", "PRESETS", "ConfigError", "DispatchPacer", "Policy", "PolicyParams", "Router", "View",
           "build_policy", "policy_from_config"]
