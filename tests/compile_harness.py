"""The compiled build for tests/test_compiled_build.py, started in the background during the run,
so that the mypyc compile (one gcc process on one core, about four and a half minutes on this
2-core machine) overlaps the rest of the suite, which mostly waits on sockets and subprocesses.
tests/conftest.py moves that file's tests to the end of the run and starts the compile once the
files that time an emulator's steps against a fitted model (``test_calibrate*``) have run: two of
their fits failed in a CI run beside starting vLLM engines, and one in a run beside the compile
(ci12's notes, session 12); where none of them is selected it starts at once. The tests'
``compiled`` fixture waits for it. The build is the same one `make compiled` makes
(``KVROUTE_COMPILE=1 pip install --no-deps --target``), at setup.py's default optimisation level.

The compiler runs at a lower CPU priority (``nice``), so the tests that time something keep their
share of the CPU while it runs; on an idle machine it gets a whole core either way. It stays in the
test run's session: with Linux's autogroup scheduling (sched_autogroup_enabled) a nice value counts
only against processes of the same session, so a session of its own would undo it. It runs in a
process group of its own, whose id is its PID, and is stopped by that PID (with the compilers it
spawned) when the session ends, whether or not it finished.

Its limits are on work, not on wall time, so that a loaded machine slows it without failing it: the
compile measured 323.6 s user + 11.0 s sys of CPU (ci16, session 16) and took 1,401 s of wall at load
~12, past the 900 s wall limit this file had. A compile fails (with pip's last output) when its
process group has used more than ``CPU_BUDGET_S`` of CPU (a compiler spinning) or no CPU at all for
``STALL_S`` of wall while it waits (one blocked: a niced process on a busy machine still gets a small
share, never none for minutes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvroute.calibrate.host_cpu import process_stats

ROOT = Path(__file__).resolve().parent.parent
TEST_FILE = "test_compiled_build.py"
NICE = 10  # below the suite's processes, above nothing: a busy machine still runs it
CPU_BUDGET_S = 1200.0  # about 3.6x the ~335 CPU-s it takes (ci16)
STALL_S = 300.0  # of wall with no CPU used by any of its processes
POLL_S = 1.0


class BackgroundCompile:
    """One ``pip install`` of the package with its listed modules compiled, into a folder of its own."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-compiled-"))
        self.site = self.dir / "site"
        self.log_path = self.dir / "pip.log"
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        """Launch the compile; returns at once."""
        env = dict(os.environ, KVROUTE_COMPILE="1", KVROUTE_COMPILE_BUILD=str(self.dir / "build"))
        cmd = ["nice", "-n", str(NICE), sys.executable, "-m", "pip", "install", "-q", "--no-deps",
               "--target", str(self.site), str(ROOT)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, process_group=0)
        self.started = time.monotonic()

    def wait(self) -> Path:
        """Until the compile ends; the installed folder, or an AssertionError with pip's last output
        (also when it ran over its CPU budget or stalled: :func:`watch`)."""
        assert self.proc is not None, "the compile was never started"
        try:
            code = watch(self.proc, CPU_BUDGET_S, STALL_S)
        except WorkLimit as exc:
            self.stop()
            raise AssertionError(f"the compile {exc} (wall {time.monotonic() - self.started:.0f} s):\n"
                                 f"{self.log_tail()}") from None
        assert code == 0, f"pip install (KVROUTE_COMPILE=1) exited {code}:\n{self.log_tail()}"
        return self.site

    def log_tail(self, chars: int = 3000) -> str:
        """The end of pip's (and the compilers') output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self) -> None:
        """Stop the compile if it still runs (SIGTERM to its process group, then SIGKILL after
        10 s), and remove its folder."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _group_alive(proc) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(proc):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the compile's group (pip, its build backend, gcc) is left; the group
    id stays ours until the leader, our child, is reaped, which only ``proc.wait`` does."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


class WorkLimit(Exception):
    """A watched process group went over its CPU budget or used no CPU for too long."""


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of group ``pgid`` and the
    children they have reaped (/proc/PID/stat fields 14-17): a compiler that has exited is counted
    in its parent's children's time, so each CPU-second is counted once while the parents live."""
    ticks = sum(sum(int(f) for f in fields[11:15])
                for fields in process_stats().values() if int(fields[2]) == pgid)
    return ticks / os.sysconf("SC_CLK_TCK")


def watch(proc: subprocess.Popen, cpu_budget_s: float, stall_s: float, poll_s: float = POLL_S) -> int:
    """Wait for ``proc`` (the leader of its own process group) and return its exit code; raise
    :class:`WorkLimit` when the group has used more than ``cpu_budget_s`` of CPU, or when ``stall_s``
    of wall pass (while waiting here) without it using any CPU. Neither limit depends on how busy
    the machine is: a slow compile goes on, a spinning or blocked one is stopped."""
    used = 0.0
    progressed = time.monotonic()
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        now_used = group_cpu_s(proc.pid)
        if now_used > cpu_budget_s:
            raise WorkLimit(f"used {now_used:.0f} CPU-s, over its budget of {cpu_budget_s:g}")
        if now_used > used:
            used, progressed = now_used, time.monotonic()
        elif time.monotonic() - progressed > stall_s:
            raise WorkLimit(f"used no CPU in {stall_s:g} s (stuck at {used:.1f} CPU-s)")


TIMED = "test_calibrate"  # files (by name prefix) that run before the compile starts

_current: BackgroundCompile | None = None
_start_after: str | None = None  # the node id of the last timed test: the compile starts when it ends


def schedule(items: list) -> None:
    """Called with the collected test items: when any is in test_compiled_build.py, move those to
    the end of the run (keeping their order), and start the compile after the last timed test
    (``TIMED``), or now where none is selected."""
    global _start_after
    ours = [it for it in items if it.path.name == TEST_FILE]
    if not ours or _current is not None:
        return
    items[:] = [it for it in items if it.path.name != TEST_FILE] + ours
    if any("compiled" in getattr(it, "fixturenames", ()) for it in ours):
        timed = [it.nodeid for it in items if it.path.name.startswith(TIMED)]
        if timed:
            _start_after = timed[-1]
        else:
            _start()


def finished(nodeid: str) -> None:
    """Called as each test ends (setup, call and teardown done): start the compile after the last timed one."""
    global _start_after
    if _start_after is not None and nodeid == _start_after:
        _start_after = None
        _start()


def _start() -> None:
    global _current
    if _current is None:
        _current = BackgroundCompile()
        _current.start()


def compiled_site() -> Path:
    """The installed compiled build: the background one, or (a test file run in a way that skipped
    collection hooks) one compiled now."""
    global _start_after
    _start_after = None
    _start()
    assert _current is not None
    return _current.wait()


def finish() -> None:
    """At the end of the session: stop a compile still running and remove its folder."""
    global _current, _start_after
    _start_after = None
    if _current is not None:
        _current.stop()
        _current = None
