"""The deployment controller (SkyWalker §3.4): health of every gateway and replica, gateway
failover, and ``/resolve`` for clients. ``deployment.py`` is its file format, ``controller.py``
the probes, the plan and the HTTP API."""

from kvroute.controller.controller import Controller, start_controller
from kvroute.controller.deployment import Deployment, load_deployment

__all__ = ["Controller", "Deployment", "load_deployment", "start_controller"]
