"""Workloads: synthetic generators (closed and open loop) and trace loaders."""

from kvroute.workload.base import Program, SimRequest, Workload

__all__ = ["Program", "SimRequest", "Workload"]
