"""calibrate/host_cpu.py ``pin_tree``: every thread of a real process tree bound to one core, threads
started afterwards too (tests/vllm/fidelity.py binds each vLLM engine's tree to its worker's core)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvroute.calibrate.host_cpu import _tree, pin_tree

# a child with a thread of its own and a grandchild with one, as a vLLM engine has an API server, an
# engine core and a worker, each with threads; on a line from stdin it starts one more thread and says
# its native id
CHILD = textwrap.dedent("""
    import subprocess, sys, threading, time
    gate = threading.Event()
    threading.Thread(target=gate.wait, daemon=True).start()
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
        "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    grandchild.stdout.readline()
    print(grandchild.pid, flush=True)
    sys.stdin.readline()
    later = threading.Thread(target=gate.wait, daemon=True)
    later.start()
    print(later.native_id, flush=True)
    sys.stdin.readline()
    grandchild.kill()
    grandchild.wait()
""")


def _allowed(pid: int, tid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                out.update(range(int(lo), int(hi or lo) + 1))
            return out
    raise AssertionError(f"no Cpus_allowed_list for {pid}/{tid}")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir(),
                    reason="needs Linux's sched_setaffinity and /proc")
def test_every_thread_of_the_tree_is_bound_and_later_threads_inherit_it():
    mine = os.sched_getaffinity(0)
    core = max(mine)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = 0
    try:
        assert child.stdout is not None and child.stdin is not None
        grandchild = int(child.stdout.readline())
        tree = _tree(child.pid)
        assert grandchild in tree
        threads = {(p, int(t)) for p in tree for t in os.listdir(f"/proc/{p}/task")}
        assert len(threads) >= 4  # two processes, each its main thread and one more

        bound = pin_tree(child.pid, {core})

        assert bound >= len(threads)
        assert all(_allowed(p, t) == {core} for p, t in threads)
        child.stdin.write("more\n")
        child.stdin.flush()
        later = int(child.stdout.readline())
        assert _allowed(child.pid, later) == {core}  # a thread started after binding keeps its creator's mask
        assert os.sched_getaffinity(0) == mine  # the caller's own mask is untouched
        child.stdin.write("stop\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
        if grandchild:  # the child stops it; if the child died first, stop it here
            try:
                os.kill(grandchild, signal.SIGKILL)
            except ProcessLookupError:
                grandchild = 0


def test_a_gone_process_binds_nothing():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(timeout=30)
    assert pin_tree(done.pid, {0}) == 0
