"""Start, freeze and kill llama-server processes for the real-engine test tier.

Each engine listens on 127.0.0.1 at an ephemeral port with one thread for prefill and decode
(`-t 1 -tb 1`: several engines share few cores, and default threading collapses ~40x), four
slots (`-np 4`), `/metrics` and the model name `tiny`. Its output goes to a log file whose tail is shown when it fails
to start. Every process is stopped by its own PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from kvroute.ports import free_port

MODEL_ALIAS = "tiny"  # the model name the engines serve (/v1/models), as a deployment would set it
DEFAULT_ARGS = ("-t", "1", "-tb", "1", "-np", "4", "--metrics", "-c", "16384", "--alias", MODEL_ALIAS)


class EngineError(RuntimeError):
    pass


class LlamaServer:
    """One llama-server process; `start()` returns once `/health` answers 200."""

    def __init__(self, binary: Path, model: Path, log_dir: Path, name: str, extra: tuple[str, ...] = ()):
        self.binary, self.model, self.name = binary, model, name
        self.args = (*DEFAULT_ARGS, *extra)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._throttle: tuple[threading.Thread, threading.Event] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> LlamaServer:
        for _ in range(3):  # the port found free may be taken before the server binds it
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                     *self.args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._wait_healthy(timeout):
                return self
            self.stop()
        raise EngineError(f"{self.name} did not become healthy; log tail:\n{self.log_tail()}")

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def throttle(self, run_s: float = 0.002, period_s: float = 0.02) -> None:
        """Slow the engine down from outside, as ``cpulimit`` does: it runs ``run_s`` of every
        ``period_s`` (SIGCONT, then SIGSTOP) until ``kill`` or ``stop``. The tiny model decodes
        a token in ~0.3 ms, so a test that must act while it still decodes (a kill mid-stream)
        would otherwise race a client that shares its process with the gateway."""
        done = threading.Event()
        pid = self.pid

        def run() -> None:
            while True:
                os.kill(pid, signal.SIGCONT)
                time.sleep(run_s)
                os.kill(pid, signal.SIGSTOP)
                if done.wait(period_s - run_s):
                    return  # left stopped: whoever ended the throttle acts on it next

        thread = threading.Thread(target=run, daemon=True)
        self._throttle = (thread, done)
        thread.start()

    def _end_throttle(self) -> None:
        """Stop throttling (before any other signal: the PID is signalled only while it lives)."""
        if self._throttle is not None:
            thread, done = self._throttle
            done.set()
            thread.join(5)
            self._throttle = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self._end_throttle()
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate (after a thaw, in case it is frozen); SIGKILL if it does not exit in 5 s."""
        self._end_throttle()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
