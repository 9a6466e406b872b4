"""A real Ray head on loopback for the tests: `ray start --head --block` in its own session, stopped by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvroute.ports import free_port

# Ray maps 127.0.0.1 to the machine's outward address unless told that this node is not part of a
# multi-machine cluster; with this its GCS and raylet listen on loopback only.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def ray_binary() -> str | None:
    """The `ray` command of this interpreter's environment, if Ray is installed there."""
    path = Path(sys.executable).parent / "ray"
    return str(path) if path.exists() else shutil.which("ray")


@contextlib.contextmanager
def ray_head(cpus: int = 2, timeout: float = 180.0) -> Iterator[str]:
    """Start a one-node Ray cluster on 127.0.0.1 with ``cpus`` CPUs; yields its address ``127.0.0.1:PORT``."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="kvr-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    log = open(Path(tmp) / "head.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([ray_binary() or "ray", "start", "--head", "--block", f"--port={port}",
                             f"--num-cpus={cpus}", "--include-dashboard=false", "--disable-usage-stats",
                             f"--temp-dir={tmp}", "--object-store-memory=100000000"],
                            env={**os.environ, **LOOPBACK_ENV}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while b"Ray runtime started" not in (Path(tmp) / "head.log").read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ray head did not start: " + (Path(tmp) / "head.log").read_text()[-2000:])
            time.sleep(0.5)
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        yield f"127.0.0.1:{port}"
    finally:
        # SIGINT is what stops `ray start --block` and the processes it started; the whole session
        # (its process group) is killed if that has not happened within 20 s
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
