"""Slow engine processes down to a fixed share of a CPU, for tests that must catch a stream mid-way.

Two ways, both leaving the processes stopped (SIGSTOP) when they end:

- :class:`CpuQuota`, the kernel's: each process in a cgroup of its own whose CFS bandwidth quota
  (cgroup v1 ``cpu.cfs_quota_us`` of ``cpu.cfs_period_us``: the kernel's sched-bwc.rst) lets it
  run ``run_s`` of CPU time in every ``period_s``, whatever the test process is doing. Needs the
  cgroup v1 cpu controller mounted writable (root on the CI machine); :meth:`CpuQuota.available`
  says whether it is.
- :class:`Throttle`, from user space, as ``cpulimit`` does (and tests/llamacpp's
  ``LlamaServer.throttle``): SIGCONT, ``run_s`` later SIGSTOP, every ``period_s``. The stop is only
  as punctual as the thread that sends it: on this shared 2-core machine (busy, load 3-10) single run
  windows meant to last 2 ms lasted up to 0.4-5.3 s: in two runs every one of 10 streams had such a
  window, whether the throttle was a thread of the test process or a process of its own, and the
  engine ran unthrottled meanwhile (the worst made all 900 tokens while the client read 226).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller


class CpuQuota:
    """``pids`` each in a new cgroup of the v1 cpu controller with ``run_s`` of CPU per ``period_s``."""

    def __init__(self, pids: list[int], run_s: float, period_s: float):
        self.pids = list(pids)
        self.groups: list[Path] = []
        self.home = [_cpu_cgroup(pid) for pid in self.pids]  # where each goes back to
        try:
            for pid in self.pids:
                group = CPU_CGROUP / f"kvroute-tests-{os.getpid()}-{pid}"
                group.mkdir()
                self.groups.append(group)
                (group / "cpu.cfs_period_us").write_text(str(round(period_s * 1e6)))
                (group / "cpu.cfs_quota_us").write_text(str(round(run_s * 1e6)))
                (group / "cgroup.procs").write_text(str(pid))  # the process with all its threads
        except OSError:
            self._undo()
            raise

    @staticmethod
    def available() -> bool:
        """Whether this process may make cgroups with a CPU quota (v1 cpu controller, writable)."""
        return (CPU_CGROUP / "cpu.cfs_quota_us").is_file() and os.access(CPU_CGROUP, os.W_OK)

    def end(self) -> None:
        """Stop every process (SIGSTOP), then lift the quota: each back in its own cgroup, ours removed.
        SIGCONT what should run on."""
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        self._undo()

    def _undo(self) -> None:
        for pid, home in zip(self.pids, self.home, strict=True):
            try:
                (home / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:  # it has exited: nothing to move
                continue
        for group in self.groups:
            group.rmdir()  # empty now; an error here is a leak worth seeing
        self.groups = []


def _cpu_cgroup(pid: int) -> Path:
    """The v1 cpu cgroup ``pid`` is in (from /proc/PID/cgroup: ``N:cpu[,cpuacct]:/path``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return CPU_CGROUP / path.lstrip("/")
    raise OSError(f"process {pid} is in no v1 cpu cgroup")


class Throttle:
    """``pids`` each run ``run_s`` of every ``period_s`` (SIGCONT, then SIGSTOP) from a thread of
    this process until :meth:`end`; only as punctual as that thread (module docstring)."""

    def __init__(self, pids: list[int], run_s: float, period_s: float):
        self.pids, self.run_s, self.period_s = pids, run_s, period_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            for pid in self.pids:
                os.kill(pid, signal.SIGCONT)
            time.sleep(self.run_s)
            for pid in self.pids:
                os.kill(pid, signal.SIGSTOP)
            if self.done.wait(self.period_s - self.run_s):
                return  # left stopped: whoever ended the throttle acts on them next

    def end(self) -> None:
        """Stop throttling; every process is left stopped (SIGCONT what should run on)."""
        self.done.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


def pace(pids: list[int], run_s: float, period_s: float) -> CpuQuota | Throttle:
    """A :class:`CpuQuota` where this process may make one, else a :class:`Throttle`."""
    return CpuQuota(pids, run_s, period_s) if CpuQuota.available() else Throttle(pids, run_s, period_s)
