"""Which build of kvroute is running: pure Python, or with its hot modules compiled by mypyc.

``COMPILED`` is the one list of modules the optional compiled build compiles (setup.py reads it
without importing kvroute; README "Compiled build"). The pure-Python package is the default and
the reference: a compiled module is the same source turned into a C extension, loaded instead of
its ``.py`` because Python's import system prefers an extension module to a source file beside it.

``KVROUTE_PURE=1`` in the environment makes this process load every listed module from its
``.py`` even where a compiled one is installed: `kvroute bench sim-speed` runs both builds of
one install that way, and a suspected compiler difference can be checked without reinstalling.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# the simulator's per-event path, measured (cProfile on bench sim-speed's workload; docs/compiled.md
# says why each is here and what a listed module must keep to); the one place modules are named
COMPILED: tuple[str, ...] = (
    "kvroute.sim.events",
    "kvroute.sim.seq",
    "kvroute.sim.kvcache",
    "kvroute.sim.batch",
    "kvroute.sim.handover",
    "kvroute.sim.engine",
    "kvroute.sim.host",
    "kvroute.sim.flight",
    "kvroute.sim.balancer",
    "kvroute.sim.simulation",
    "kvroute.metrics.summary",
    "kvroute.prefix.index",
    "kvroute.model.endpoint",
    "kvroute.model.request",
    "kvroute.model.decision",
    "kvroute.policy.router",
    "kvroute.policy.state",
    "kvroute.policy.compose",
    "kvroute.policy.selection",
    "kvroute.workload.traces",
    # the gateway's per-request path (issue 25: callgrind, docs/hot-path.md "Compiled build")
    "kvroute.gateway.deadlines",
    "kvroute.gateway.httpmsg",
    "kvroute.gateway.httpwork",
    "kvroute.gateway.httpconn",
    "kvroute.gateway.http",
    "kvroute.gateway.upstream",
    "kvroute.gateway.upstream_conn",
    "kvroute.gateway.tokens",
    "kvroute.gateway.legs",
    "kvroute.gateway.continuation",
    "kvroute.gateway.openai",
    "kvroute.gateway.proxy",
    "kvroute.gateway.front",
    "kvroute.gateway.runtime",
    "kvroute.gateway.holdqueue",
    "kvroute.gateway.metrics",
    "kvroute.gateway.server",
    "kvroute.gateway.peers",
    "kvroute.gateway.auth",
    "kvroute.gateway.breaker",
    "kvroute.gateway.tracing",
    "kvroute.gateway.outlier",
    "kvroute.gateway.retry",
    "kvroute.gateway.hotconfig",
    "kvroute.gateway.replica",
    "kvroute.gateway.hops",
    "kvroute.prefix.keys",
    "kvroute.prefix.blocks",
)

PURE_ENV = "KVROUTE_PURE"


def module_path(name: str) -> str:
    """The source file of a listed module, relative to the repository root (for setup.py)."""
    return "src/" + name.replace(".", "/") + ".py"


def is_compiled(mod: ModuleType) -> bool:
    """Whether ``mod`` was loaded from an extension module rather than from Python source."""
    f = getattr(mod, "__file__", None) or ""
    return f.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def compiled_modules(names: Sequence[str] = COMPILED) -> list[str]:
    """The listed modules this process runs compiled (importing each one)."""
    out = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if is_compiled(mod):
            out.append(name)
    return out


def compiled_available(names: Sequence[str] = COMPILED) -> bool:
    """Whether every listed module has a compiled file installed beside its source (found on disk,
    whether or not ``KVROUTE_PURE`` keeps this process from loading them)."""
    for name in names:
        package, _, leaf = name.rpartition(".")
        spec = importlib.util.find_spec(package)
        dirs = list(spec.submodule_search_locations or []) if spec else []
        if not any(os.path.isfile(os.path.join(d, leaf + sfx))
                   for d in dirs for sfx in importlib.machinery.EXTENSION_SUFFIXES):
            return False
    return bool(names)


def describe() -> str:
    """One line: which build this process runs (for --version and the benchmarks)."""
    done = compiled_modules()
    if not done:
        forced = " (KVROUTE_PURE=1)" if os.environ.get(PURE_ENV) else ""
        return f"pure Python{forced}"
    if len(done) == len(COMPILED):
        return f"compiled (mypyc): all {len(COMPILED)} listed modules"
    missing = sorted(set(COMPILED) - set(done))
    return f"partly compiled (mypyc): {len(done)} of {len(COMPILED)} listed modules; pure: {', '.join(missing)}"


class _SourceFirst:
    """A meta-path finder that loads the listed modules from their ``.py`` (``KVROUTE_PURE=1``)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if name not in COMPILED or not path:
            return None
        leaf = name.rpartition(".")[2] + ".py"
        for d in path:
            f = os.path.join(d, leaf)
            if os.path.isfile(f):
                return importlib.util.spec_from_file_location(name, f)
        return None


def force_pure() -> None:
    """Load the listed modules from source from now on (called on import when KVROUTE_PURE is set)."""
    if not any(isinstance(f, _SourceFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFirst())
