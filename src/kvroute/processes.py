"""Child processes of a live run: started, watched, killed, frozen and restarted by PID.

Every replica, gateway and the controller is a ``kvroute`` subprocess, so a kill is a real
SIGKILL and a pause a real SIGSTOP. Each child announces its address on stderr ("... on
http://127.0.0.1:PORT"); its stderr is copied to a log file in the run's folder. On Linux a child
also dies with its parent (``PR_SET_PDEATHSIG``), so even a SIGKILLed ``kvroute live`` leaves
nothing behind; ``stop_all`` ends the rest by PID: SIGCONT, SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.errors import ServiceError

READY = re.compile(rb" on (https?://[0-9.]+:(\d+))")


class ProcessError(ServiceError, RuntimeError):
    """A child did not come up; the message names it and ends with its last log lines."""


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One ``kvroute`` subprocess."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None
    url: str = ""
    port: int = 0
    paused: bool = False
    starts: int = 0
    pids: list[int] = field(default_factory=list)  # every process this child has been
    _reader: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        """The current process id (None before start)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.returncode is None

    async def start(self, timeout_s: float = 30.0) -> str:
        """Spawn and wait for the "on http://..." line; returns the URL."""
        env = {**os.environ, **self.env}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute", *self.args, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
            preexec_fn=die_with_parent if sys.platform == "linux" else None)
        self.starts += 1
        self.pids.append(self.proc.pid)
        self.paused = False
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # an exit after a cancelled start (Ctrl-C) sets an exception nobody awaits: mark it seen
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._reader = asyncio.create_task(self._copy_log(ready))
        try:
            self.url = await asyncio.wait_for(asyncio.shield(ready), timeout_s)
        except (TimeoutError, ProcessError):
            await self.kill()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:] \
                if self.log_path.exists() else []
            raise ProcessError(f"{self.name} did not start within {timeout_s:g} s; its log "
                               f"({self.log_path}) ends: {' | '.join(tail) or '(empty)'}") from None
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

    async def _copy_log(self, ready: asyncio.Future[str]) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts}: pid {self.proc.pid}\n".encode())
            async for line in self.proc.stderr:
                log.write(line)
                log.flush()
                if not ready.done() and (m := READY.search(line)):
                    ready.set_result(m.group(1).decode())
        if not ready.done():
            ready.set_exception(ProcessError(f"{self.name} exited"))

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to this child's PID (nothing when it is not running)."""
        if self.alive and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the process stays, answers nothing."""
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT."""
        self.signal(signal.SIGCONT)
        self.paused = False

    async def kill(self) -> None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        await self._reap(5.0)

    async def stop(self, grace_s: float = 3.0) -> None:
        """SIGCONT (a frozen process cannot act on SIGTERM), SIGTERM, SIGKILL after ``grace_s``."""
        if not self.alive:
            await self._reap(1.0)
            return
        self.resume()
        self.signal(signal.SIGTERM)
        if not await self._reap(grace_s):
            self.signal(signal.SIGKILL)
            await self._reap(5.0)

    async def _reap(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            return False
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 1.0)
        return True


@dataclass
class Fleet:
    """Every child of a run, by name; stopped together, each by its PID."""

    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)

    def add(self, name: str, args: list[str]) -> Child:
        """Register a child (not started yet)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        child = Child(name, args, self.folder / f"{safe}.log", dict(self.env))
        self.children[name] = child
        return child

    async def start(self, names: list[str], timeout_s: float = 30.0) -> None:
        """Start these children concurrently; if one fails, the error names it."""
        results = await asyncio.gather(*(self.children[n].start(timeout_s) for n in names), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def stop_all(self) -> None:
        """Stop every child by its PID, all at once."""
        await asyncio.gather(*(c.stop() for c in self.children.values()), return_exceptions=True)

    def all_pids(self) -> list[int]:
        """Every PID this fleet started, restarts included."""
        return [pid for c in self.children.values() for pid in c.pids]
