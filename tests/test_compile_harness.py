"""tests/compile_harness.py's limits on the background compile: they count work, not wall time, so
a compile slowed by a loaded machine finishes, while one that spins or blocks is stopped with a clear
message. Each case runs a real process group (a shell and the Python it starts) in place of pip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.compile_harness import WorkLimit, group_cpu_s, watch

SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {cpu}: pass\n"


def _group(script: str) -> subprocess.Popen:
    """``script`` run by a Python started from a shell, both in a new process group led by the shell:
    the CPU is spent by a grandchild of ours, as gcc's is below pip."""
    return subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$0"; exit 3', script], process_group=0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_spinning_group_is_stopped_at_its_cpu_budget():
    proc = _group(SPIN.format(cpu=60))
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkLimit, match=r"over its budget of 0\.5"):
            watch(proc, cpu_budget_s=0.5, stall_s=60, poll_s=0.05)
        assert time.monotonic() - t0 < 50  # long before its 60 CPU-s
        assert group_cpu_s(proc.pid) > 0.5  # the grandchild's time is the group's
    finally:
        _stop(proc)


def test_a_blocked_group_is_stopped_after_its_stall_time():
    proc = _group("import time\ntime.sleep(60)\n")
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkLimit, match="used no CPU in 1 s"):
            watch(proc, cpu_budget_s=100, stall_s=1, poll_s=0.05)
        assert time.monotonic() - t0 < 30
    finally:
        _stop(proc)


def test_a_slowed_group_finishes_however_long_its_wall_time():
    """The group is kept stopped (SIGSTOP) three quarters of the time, as a starved process is kept
    off the CPU: its wall time is several times its CPU time, yet it uses some CPU within every stall
    time, so it finishes and its exit code comes back."""
    proc = _group(SPIN.format(cpu=0.3))
    done = threading.Event()

    def throttle():
        try:
            while not done.is_set():
                os.killpg(proc.pid, signal.SIGSTOP)
                time.sleep(0.3)
                os.killpg(proc.pid, signal.SIGCONT)
                time.sleep(0.1)
        except ProcessLookupError:  # the group has ended and been reaped
            return

    t = threading.Thread(target=throttle, daemon=True)
    try:
        t0 = time.monotonic()
        t.start()
        assert watch(proc, cpu_budget_s=30, stall_s=2, poll_s=0.05) == 3
        assert time.monotonic() - t0 > 1.0  # >= 0.3 CPU-s, at most a quarter of the time
    finally:
        done.set()
        t.join(5)
        _stop(proc)
