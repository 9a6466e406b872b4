"""nats-server and HAProxy on loopback, started and stopped by PID (tests and ``kvroute bench fleet``).

Both come from Debian's packages (``apt-get install nats-server haproxy``; ``make test`` installs
them when missing and running as root). Each runs in the foreground as a child of this process,
dies with it (``PR_SET_PDEATHSIG``), logs to a file, and is stopped by its own PID only.

The HAProxy front of a fleet (:func:`haproxy_config`): ``leastconn`` over the instances (LLM
requests last seconds, so open connections are the load), a health check of ``GET /readyz``
every 200 ms (two failures mark an instance down, two passes bring it back), and retries with
redispatch only on connection failures — a request that never reached an instance is safe to
send to another one; one an instance had taken may already be running on an engine, so when
that instance dies the client gets a fast, explicit error (an OpenAI-style JSON 502 naming the
cause, or the end of its stream) rather than a silent second execution.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvroute.errors import ServiceError
from kvroute.ports import HOST, hold_port, wait_for_port
from kvroute.processes import die_with_parent


def find_binary(name: str) -> str:
    """The path of ``name`` (PATH, then /usr/sbin where Debian puts both); ServiceError naming the package."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if path is None:
        raise ServiceError(f"{name} not found: apt-get install {name} (make test installs it when run as root)")
    return path


@dataclass
class Service:
    """One external program, run in the foreground and known by its PID."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    pids: list[int] = field(default_factory=list)
    # the port kept bound until the program listens on it (kvroute.ports.hold_port), when this picked it
    held: socket.socket | None = None

    @property
    def pid(self) -> int | None:
        """The running process's id (None before start)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 15.0) -> None:
        """Spawn it and wait until its port accepts connections."""
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=die_with_parent)
        finally:
            log.close()
        self.pids.append(self.proc.pid)
        try:
            wait_for_port(self.port, timeout_s)
            self.release()
        except TimeoutError:
            code = self.proc.poll()
            self.kill()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise ServiceError(f"{self.name} did not listen on {HOST}:{self.port} within {timeout_s:g} s"
                               f"{f' (exited {code})' if code is not None else ''}; its log ends: "
                               f"{' | '.join(tail) or '(empty)'}") from None

    def release(self) -> None:
        """Stop holding the port (it listens, or it is not needed any more)."""
        if self.held is not None:
            self.held.close()
            self.held = None

    def kill(self) -> None:
        """SIGKILL by PID, and reap."""
        self.release()
        if self.alive and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM by PID, SIGKILL after ``grace_s``."""
        self.release()
        if not self.alive or self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill()


def nats_server(folder: Path, port: int | None = None) -> Service:
    """A nats-server on 127.0.0.1 (core NATS only: the fleet needs no JetStream). Not started yet; without
    ``port``, one is held for it until it listens."""
    held = None
    if port is None:
        held = hold_port()
        port = int(held.getsockname()[1])
    argv = [find_binary("nats-server"), "-a", HOST, "-p", str(port)]
    return Service("nats-server", argv, port, folder / "nats-server.log", held=held)


ERRORS = {
    502: ("Bad Gateway", "the kvroute instance serving this request stopped before answering (it may have run "
          "on an engine); send it again", "gateway_instance_lost"),
    503: ("Service Unavailable", "no kvroute instance is up behind the front load balancer", "no_gateway_instance"),
    504: ("Gateway Timeout", "the kvroute instance serving this request did not answer in time",
          "gateway_instance_timeout"),
}


def _error_file(folder: Path, status: int) -> Path:
    reason, message, code = ERRORS[status]
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}) + "\n"
    path = folder / f"haproxy-{status}.http"
    path.write_bytes((f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nCache-Control: no-cache\r\n"
                      f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    return path


def haproxy_config(folder: Path, port: int, instances: list[tuple[str, int]], check_interval_ms: int = 200,
                   timeout_s: float = 300.0) -> Path:
    """Write the front load balancer's configuration for ``instances`` (name, port) and return its path."""
    lines = [
        "global", "    maxconn 4096", "    log stderr format raw local0 notice",
        "defaults", "    mode http", "    log global", "    option dontlognull",
        "    timeout connect 500ms", f"    timeout client {int(timeout_s)}s", f"    timeout server {int(timeout_s)}s",
        "    timeout http-request 10s", "    timeout http-keep-alive 30s",
        "    retries 3", "    option redispatch 1", "    retry-on conn-failure",
        *(f"    errorfile {s} {_error_file(folder, s)}" for s in ERRORS),
        "frontend kvroute_front", f"    bind {HOST}:{port}", "    default_backend kvroute_instances",
        "backend kvroute_instances", "    balance leastconn",
        "    option httpchk GET /readyz", "    http-check expect status 200",
        f"    default-server inter {check_interval_ms}ms fastinter {check_interval_ms}ms "
        f"downinter {check_interval_ms}ms fall 2 rise 2",
        *(f"    server {name} {HOST}:{p} check" for name, p in instances),
    ]
    path = folder / "haproxy.cfg"
    path.write_text("\n".join(lines) + "\n")
    return path


def haproxy(folder: Path, instances: list[tuple[str, int]], port: int | None = None, **kw: float) -> Service:
    """HAProxy in front of ``instances`` (name, port) on 127.0.0.1. Not started yet; check the
    configuration first with ``haproxy -c`` so a bad one fails with HAProxy's own words. Without ``port``,
    one is held for it until it listens."""
    held = None
    if port is None:
        held = hold_port()
        port = int(held.getsockname()[1])
    cfg = haproxy_config(folder, port, instances, **kw)  # type: ignore[arg-type]
    binary = find_binary("haproxy")
    check = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        if held is not None:
            held.close()
        raise ServiceError(f"haproxy rejected {cfg}: {(check.stderr or check.stdout).strip()[-500:]}")
    return Service("haproxy", [binary, "-db", "-f", str(cfg)], port, folder / "haproxy.log", held=held)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
