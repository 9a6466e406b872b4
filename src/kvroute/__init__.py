"""kvroute: a KV-cache-aware, multi-region load balancer for LLM inference.

The policy layer (``kvroute.policy``) is pure: the live gateway and the discrete-event
simulator drive the same :class:`~kvroute.policy.router.Router` with endpoint views they
produce themselves.
"""

__version__ = "0.1.0"
