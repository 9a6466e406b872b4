"""kvroute: a KV-cache-aware, multi-region load balancer for LLM inference.

The policy layer (``kvroute.policy``) is pure: the live gateway and the discrete-event
simulator drive the same :class:`~kvroute.policy.router.Router` with endpoint views they
produce themselves.
"""

import os as _os

__version__ = "0.1.0"

if _os.environ.get("KVROUTE_PURE"):  # run the pure-Python modules of a compiled install (buildinfo.py)
    from kvroute.buildinfo import force_pure as _force_pure

    _force_pure()
