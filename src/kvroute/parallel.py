"""Independent simulations on one core, a local process pool or a Ray cluster — one interface.

`simulate --sweep`, `reproduce` and `plan` hand their independent runs to an :class:`Executor`:
``map(fn, items)`` returns ``[fn(x) for x in items]`` in order, whatever ran them. Every task is
self-contained (a scenario's plain data plus what to vary), so a worker process that shares no
memory with the caller — a fresh pool worker or a Ray worker on another machine — rebuilds the same
Scenario and runs the same seeded simulation; the results are the serial run's, bit for bit
(tests/test_parallel.py checks it for the pool and for a real Ray head).

* ``workers=1``: in this process, no pickling (what tests and debuggers want);
* default: a process pool with every core (``os.cpu_count()``), started once when the executor
  is made and reused: ``fork`` while the caller runs one thread, else ``forkserver`` (the caller
  may be drawing a progress bar from a thread, and a forked child of a threaded process can
  inherit a held lock);
* ``ray="auto"`` or ``"HOST:PORT"`` (``ray://HOST:PORT`` for Ray Client): the tasks become Ray
  remote calls on that cluster, one CPU each. Vidur's config explorer runs its searches the
  same way. An address that does not answer is an :class:`ExecutorError` (one line, exit 2).

Registrations the workers need and cannot rebuild from a scenario (a ``--policy-file`` preset)
travel as a *prelude*: ``(module:function, args)`` pairs each worker runs once before its first
task (:func:`add_prelude`).
"""

from __future__ import annotations

import gc
import importlib
import logging
import multiprocessing
import os
import socket
import threading
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


class Task:
    """A submitted task: its ``result`` once ``done`` (see :meth:`Executor.submit`)."""

    __slots__ = ("done", "handle", "result")

    def __init__(self, handle: Any = None, result: Any = None, done: bool = False):
        self.handle = handle
        self.result = result
        self.done = done


class Executor:
    """Runs ``fn`` over items, in this process (``workers=1``); subclasses run them elsewhere.

    Two ways in: :meth:`map` (a batch, results in order) and :meth:`submit` / :meth:`wait` (tasks
    handed over one by one as the caller decides them, up to :attr:`workers` in flight, so a search
    keeps every worker busy without waiting for a whole batch: plan/search.py)."""

    kind = "serial"

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)

    def submit(self, fn: Callable[[Any], Any], item: Any) -> Task:
        """Start ``fn(item)``; here it runs at once and the task comes back done."""
        return Task(result=_call(list(_PRELUDE), fn, item), done=True)

    def wait(self, tasks: Iterable[Task]) -> list[Task]:
        """Block until at least one of ``tasks`` is done; every done one, in the order given."""
        return [t for t in tasks if t.done]

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

    def _map_tasks(self, fn: Callable[[Any], Any], items: list[Any],
                   on_done: Callable[[int, Any], None] | None) -> list[Any]:
        """:meth:`map` through :meth:`submit` / :meth:`wait` (every item handed over at once)."""
        tasks = [self.submit(fn, x) for x in items]
        index = {id(t): i for i, t in enumerate(tasks)}
        pending = list(tasks)
        while pending:
            done = self.wait(pending)
            finished = {id(t) for t in done}
            pending = [t for t in pending if id(t) not in finished]
            for t in done:
                if on_done:
                    on_done(index[id(t)], t.result)
        return [t.result for t in tasks]

    def describe(self) -> str:
        """A few words for progress lines and reports: where the runs go."""
        return "1 process (serial)"

    def close(self) -> None:
        """Release workers (nothing to release here)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ready() -> None:
    """A pool worker's first task: nothing (it makes the pool start every process at once)."""


class PoolExecutor(Executor):
    """A local process pool of ``workers`` processes, started when it is made and reused for every task.

    ``fork`` when this process runs a single thread at that moment (a worker starts in
    milliseconds with every module already imported), else ``forkserver``: a forked child of a
    threaded process (a progress bar's thread) can inherit a held lock."""

    kind = "pool"

    def __init__(self, workers: int):
        super().__init__(workers)
        self._pool: ProcessPoolExecutor | None = None
        self._get()

    def _get(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx: Any = multiprocessing.get_context("fork" if threading.active_count() == 1 else "forkserver")
            if ctx.get_start_method() == "forkserver":
                ctx.set_forkserver_preload(["kvroute.sim.simulation", "kvroute.sim.scenario"])
            # forked workers share this process's memory until they write to it; the cyclic
            # collector writes to every object it walks, so objects that exist now are frozen
            # (never walked) while the workers fork, else each worker copies most of the heap
            freeze = ctx.get_start_method() == "fork" and gc.get_freeze_count() == 0
            if freeze:
                gc.freeze()
            try:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=ctx)
                for f in [self._pool.submit(_ready) for _ in range(self.workers)]:
                    f.result()  # every worker is up before the first real task
            finally:
                if freeze:
                    gc.unfreeze()  # here only: the workers keep theirs frozen
        return self._pool

    def submit(self, fn: Callable[[Any], Any], item: Any) -> Task:
        """Queue ``fn(item)`` on the pool."""
        return Task(self._get().submit(_call, list(_PRELUDE), fn, item))

    def wait(self, tasks: Iterable[Task]) -> list[Task]:
        """As :meth:`Executor.wait`, on the pool's futures."""
        tasks = list(tasks)
        if not any(t.done for t in tasks):
            wait([t.handle for t in tasks], return_when=FIRST_COMPLETED)
        for t in tasks:
            if not t.done and t.handle.done():
                t.result, t.done = t.handle.result(), True
        return [t for t in tasks if t.done]

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """As :meth:`Executor.map`, on the pool; a single item runs in this process (no hand-over to pay)."""
        items = list(items)
        if len(items) <= 1:
            return Executor.map(self, fn, items, on_done)
        return self._map_tasks(fn, items, on_done)

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

    def submit(self, fn: Callable[[Any], Any], item: Any) -> Task:
        """``fn(item)`` as a remote task on the cluster."""
        return Task(self._remote.remote(list(_PRELUDE), fn, item))

    def wait(self, tasks: Iterable[Task]) -> list[Task]:
        """As :meth:`Executor.wait`, on the tasks' object refs."""
        tasks = list(tasks)
        pending = [t.handle for t in tasks if not t.done]
        if pending:
            ready, _ = self._ray.wait(pending, num_returns=1)
            more, _ = self._ray.wait(pending, num_returns=len(pending), timeout=0)
            ready_ids = {r.hex() for r in ready + more}
            for t in tasks:
                if not t.done and t.handle.hex() in ready_ids:
                    t.result, t.done = self._ray.get(t.handle), True
        return [t for t in tasks if t.done]

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """As :meth:`Executor.map`, every item a remote task on the cluster."""
        return self._map_tasks(fn, list(items), on_done)

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
