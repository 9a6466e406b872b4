"""Independent simulations on one core, a local process pool or a Ray cluster — one interface.

`simulate --sweep`, `reproduce` and `plan` hand their independent runs to an :class:`Executor`:
``map(fn, items)`` returns ``[fn(x) for x in items]`` in order, whatever ran them. Every task is
self-contained (a scenario's plain data plus what to vary), so a worker process that shares no
memory with the caller — a fresh pool worker or a Ray worker on another machine — rebuilds the same
Scenario and runs the same seeded simulation; the results are the serial run's, bit for bit
(tests/test_parallel.py checks it for the pool and for a real Ray head).

* ``workers=1``: in this process, no pickling (what tests and debuggers want);
* default: a ``forkserver`` process pool with every core (``os.cpu_count()``). Not ``fork``: the
  caller may be drawing a progress bar from a thread, and a forked child of a threaded process
  can inherit a held lock;
* ``ray="auto"`` or ``"HOST:PORT"`` (``ray://HOST:PORT`` for Ray Client): the tasks become Ray
  remote calls on that cluster, one CPU each. Vidur's config explorer runs its searches the
  same way. An address that does not answer is an :class:`ExecutorError` (one line, exit 2).

Registrations the workers need and cannot rebuild from a scenario (a ``--policy-file`` preset)
travel as a *prelude*: ``(module:function, args)`` pairs each worker runs once before its first
task (:func:`add_prelude`).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from kvroute.errors import ServiceError

_PRELUDE: list[tuple[str, tuple]] = []
_done_prelude: set[str] = set()


class ExecutorError(ServiceError, RuntimeError):
    """The executor cannot start (an unreachable Ray address, Ray not installed); one line."""


def add_prelude(target: str, *args: Any) -> None:
    """Have every worker call ``target`` (``"module:function"``) with ``args`` once before its first task."""
    _PRELUDE.append((target, args))


def clear_prelude() -> None:
    """Forget the prelude (a command that added one calls this when it is done)."""
    _PRELUDE.clear()


def _run_prelude(prelude: list[tuple[str, tuple]]) -> None:
    for target, args in prelude:
        key = f"{target}{args!r}"
        if key in _done_prelude:
            continue
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*args)
        _done_prelude.add(key)


def _call(prelude: list[tuple[str, tuple]], fn: Callable[[Any], Any], item: Any) -> Any:
    """One task in a worker: the prelude (once per process), then ``fn(item)``."""
    _run_prelude(prelude)
    return fn(item)


class Executor:
    """Runs ``fn`` over items, in this process (``workers=1``); subclasses run them elsewhere."""

    kind = "serial"

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``[fn(x) for x in items]`` in item order; ``on_done(i, result)`` as each finishes (in this process)."""
        out = []
        for i, item in enumerate(items):
            r = _call(list(_PRELUDE), fn, item)
            if on_done:
                on_done(i, r)
            out.append(r)
        return out

    def describe(self) -> str:
        """A few words for progress lines and reports: where the runs go."""
        return "1 process (serial)"

    def close(self) -> None:
        """Release workers (nothing to release here)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolExecutor(Executor):
    """A local process pool (``forkserver``) of ``workers`` processes, started on first use."""

    kind = "pool"

    def __init__(self, workers: int):
        super().__init__(workers)
        self._pool: ProcessPoolExecutor | None = None

    def _get(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["kvroute.sim.simulation", "kvroute.sim.scenario"])
            self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx)
        return self._pool

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """As :meth:`Executor.map`, on the pool; a single item runs in this process (no start-up to pay)."""
        items = list(items)
        if len(items) <= 1:
            return Executor.map(self, fn, items, on_done)
        pool, prelude = self._get(), list(_PRELUDE)
        futures = {pool.submit(_call, prelude, fn, x): i for i, x in enumerate(items)}
        out: list[Any] = [None] * len(items)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in sorted(done, key=lambda f: futures[f]):
                out[futures[f]] = f.result()
                if on_done:
                    on_done(futures[f], out[futures[f]])
        return out

    def describe(self) -> str:
        """``N local processes``."""
        return f"{self.workers} local processes"

    def close(self) -> None:
        """Stop the pool's processes."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


class RayExecutor(Executor):
    """Tasks as Ray remote calls (one CPU each) on the cluster at ``address`` (``auto``: the one running here)."""

    kind = "ray"

    def __init__(self, address: str):
        try:
            import ray
        except ImportError:
            raise ExecutorError("--ray needs Ray: pip install 'kvroute[ray]'") from None
        _check_reachable(address)
        self._ray = ray
        self.address = address
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False,
                     ignore_reinit_error=True, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ExecutorError(f"--ray {address}: cannot join the Ray cluster: {first}") from None
        self._remote = ray.remote(num_cpus=1)(_call)
        super().__init__(int(ray.cluster_resources().get("CPU", 1)))

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """As :meth:`Executor.map`, every item a remote task on the cluster."""
        ray, prelude = self._ray, list(_PRELUDE)
        refs = [self._remote.remote(prelude, fn, x) for x in items]
        index = {r: i for i, r in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                out[index[ref]] = ray.get(ref)
                if on_done:
                    on_done(index[ref], out[index[ref]])
        return out

    def describe(self) -> str:
        """``Ray cluster ADDRESS (N CPUs)``."""
        return f"Ray cluster {self.address} ({self.workers} CPUs)"

    def close(self) -> None:
        """Leave the cluster (it keeps running)."""
        self._ray.shutdown()


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail fast, in one line, when a Ray address does not answer (``ray.init`` would retry for a minute)."""
    if address == "auto":
        if not os.environ.get("RAY_ADDRESS") and not os.path.exists("/tmp/ray/ray_current_cluster"):
            raise ExecutorError("--ray auto: no Ray cluster is running on this machine (start one with "
                                "`ray start --head`, or give its address: --ray HOST:PORT)")
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ExecutorError(f"--ray {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ExecutorError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                            "start one with `ray start --head` or check the address") from None


def make_executor(workers: int | None = None, ray: str | None = None) -> Executor:
    """The executor a command asked for: Ray when ``ray`` is given, else a pool of ``workers`` (default: every
    core), serial when that is 1."""
    if ray:
        return RayExecutor(ray)
    n = workers or os.cpu_count() or 1
    return Executor(1) if n <= 1 else PoolExecutor(n)


def worker_count(text: str) -> int:
    """``--workers``: a positive integer (anything else: argparse's one line, exit 2)."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of processes (1 = serial)")
    return n


def add_arguments(parser: Any) -> None:
    """``--workers N`` and ``--ray ADDRESS`` on a command that runs independent simulations."""
    parser.add_argument("--workers", type=worker_count, metavar="N",
                        help="simulations in parallel on this machine (default: every core; 1 = serial)")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="run the simulations on a Ray cluster instead: `auto` (the one started here with "
                             "`ray start`) or HOST:PORT of its head (pip install 'kvroute[ray]')")
