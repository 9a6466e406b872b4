"""What else uses the cores the engines share, from ``/proc`` (Linux; issue 21): for a live
fidelity run (bench/fidelity_cpu.py) and for the calibration sweep itself (calibrate/measure.py).

Engines on one machine (scenario ``host_cores``) are slowed not only by each other but by every
other runnable thread there: the gateway, the clients, the kernel's network stack, the engines'
own HTTP threads. Matching llama-server's logs to a quiet fourth-round run put the engines' busy
time at 1.61x the profile's work where sharing two cores among three engines allows 1.40x at the
run's occupancy (80 % of engine time with all three stepping): ~15 % of the machine went
elsewhere. This ledger measures it over a span: the machine's busy CPU (``/proc/stat``) less
each engine's compute thread — the busiest thread of the process listening on the engine's port
and its children (llama-server ``-t 1``: its one compute thread; vLLM: its worker's) — is the
background load (sim/host.py ``background``). Engines not found on this machine (another host,
no ``/proc``) leave only what the caller knows: the gateway's and the client's own CPU.
(Moved from bench/fidelity_cpu.py, issue 21f, so that calibrate can use it.)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from urllib.parse import urlsplit

LOCAL = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _clock() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (all but idle and iowait), None without /proc."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / _clock()


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f[9])
    return inodes


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this machine (its socket's inode among the
    processes' open files), None when none is found or readable."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return int(pid)
    return None


def process_stats() -> dict[int, list[str]]:
    """Every live process's ``/proc/PID/stat`` fields after its name, by PID: index 0 is the state,
    1 the parent, 2 the process group, 11-14 utime/stime/cutime/cstime (ticks), 19 the start time
    (proc(5)'s fields 3 onwards). Processes that end while being read are left out."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                out[int(name)] = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
    return out


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for p, fields in process_stats().items():
        children.setdefault(int(fields[1]), []).append(p)
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of ``pid`` and its descendants, by ``pid/tid``."""
    out = {}
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    f = Path(f"/proc/{p}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                    out[f"{p}/{tid}"] = (int(f[11]) + int(f[12])) / _clock()
    return out


class CpuLedger:
    """The machine's and each local engine's compute-thread CPU over one live run."""

    def __init__(self, urls: list[str]):
        pids = []
        for u in urls:
            parts = urlsplit(u)
            pid = listening_pid(parts.port) if parts.hostname in LOCAL and parts.port else None
            pids.append(pid)
        self.pids = pids
        self.machine0 = machine_busy_s()
        self.threads0 = [thread_cpu_s(p) if p else {} for p in pids]

    def stop(self, wall_s: float, gateway_cpu_s: float, client_cpu_s: float) -> dict:
        """Cores' worth over ``wall_s``: ``machine``, ``engines`` (each engine's busiest thread),
        ``frontend`` (each engine's listening process less that thread: vLLM's API server,
        llama-server's HTTP threads), ``engine_other`` (the rest of its process tree: vLLM's engine
        core and the worker's other threads), ``gateway``, ``client``, and ``background`` (machine
        less the engines' compute threads; where an engine was not found, the gateway's and the
        client's only) with ``how``."""
        machine = machine_busy_s()
        compute: list[float | None] = []
        frontend: list[float | None] = []
        other: list[float | None] = []
        for pid, before in zip(self.pids, self.threads0, strict=True):
            if not pid:
                compute.append(None)
                frontend.append(None)
                other.append(None)
                continue
            after = thread_cpu_s(pid)
            used = {t: after[t] - before.get(t, 0.0) for t in after}
            top = max(used, key=used.__getitem__, default="")
            compute.append(used.get(top, 0.0) / wall_s)
            front = sum(v for t, v in used.items() if t != top and t.split("/")[0] == str(pid))
            frontend.append(front / wall_s)
            other.append((sum(used.values()) - used.get(top, 0.0) - front) / wall_s)
        out: dict = {"gateway": gateway_cpu_s / wall_s, "client": client_cpu_s / wall_s,
                     "engines": [None if c is None else round(c, 4) for c in compute],
                     "frontend": [None if c is None else round(c, 4) for c in frontend],
                     "engine_other": [None if c is None else round(c, 4) for c in other]}
        if machine is not None and self.machine0 is not None and None not in compute:
            out["machine"] = (machine - self.machine0) / wall_s
            out["background"] = max(0.0, out["machine"] - sum(c for c in compute if c is not None))
            out["how"] = "machine busy less the engines' compute threads (/proc)"
        else:
            out["background"] = out["gateway"] + out["client"]
            out["how"] = "gateway and client only (engines not found on this machine)"
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}

    def background(self, wall_s: float, client_cpu_s: float) -> float | None:
        """:meth:`stop`'s ``background`` for a span with no gateway (a calibration sweep: the
        client is the caller), None where not every engine was found on this machine."""
        got = self.stop(wall_s, 0.0, client_cpu_s)
        return got["background"] if "machine" in got else None


def pin_tree(pid: int, cpus: set[int]) -> int:
    """Bind every thread of ``pid`` and its descendants to ``cpus`` (``sched_setaffinity`` per thread:
    a process's mask is its threads' own, and threads started later inherit their creator's); the number
    of threads bound. Threads that exit meanwhile are skipped; a thread that cannot be bound raises
    OSError. Why (issue 21x, quiet): on the 2-core test machine two vLLM CPU engines run an API server and
    an engine-core process each beside their pinned worker; wherever the kernel put those it left them for
    tens of seconds, so for whole stretches of a calibration one engine's points ran ×1.3–1.6 slower than
    the other's, the side flipping between stretches (the per-sample log ratio of the two engines had an sd
    of 0.3–0.6; bound 0.13–0.26). Unbound, three calibrations of the same two engines back to back
    predicted a cold 1,024-token prefill at 141, 168 and 137 ms, their swept points ×0.77–1.60 apart; bound,
    166 and 166 ms, points ×0.91–1.18 apart. Binding does not fix an engine instance's level: bound engines
    started afresh gave 139 (every point ×0.83–0.92 of the pair before) and 169 ms. tests/vllm/fidelity.py
    binds each engine's tree to its worker's core."""
    bound = 0
    for p in _tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:  # the process exited meanwhile
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:  # the thread exited meanwhile
                continue
            bound += 1
    return bound
