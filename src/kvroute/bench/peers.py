"""The routers users would pick instead of kvroute, started for `kvroute bench gateway --peers`.

Two Rust LLM routers from PyPI — sglang-router (SGLang's model gateway) and vllm-router (vLLM's
fork of it) — and two plain reverse proxies from Debian's packages — HAProxy and nginx. Each is
configured as the smallest fair counterpart of the gateway's ``round_robin`` preset: round robin
over the same two upstreams, keep-alive to them, streaming passed through unbuffered (nginx's
``proxy_buffering off``), access logs off, one process or thread where the router allows it so
that its CPU is one process's. A peer whose program is missing is skipped with a line saying how
to install it (``make peers`` installs all four).

The machine check: a measurement whose machine was busy with other jobs is not reported. Over a
load, the CPU the whole machine spent (``/proc/stat``) less what the router, the upstreams, the
load client and this process spent is other jobs' CPU; :func:`MachineLoad.others_share` is its
share of the machine's capacity over the load.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvroute.calibrate.host_cpu import process_stats

PEERS_VENV = ".venv-peers"  # `make peers` installs the Rust routers here (kept out of the project's venv)
BUSY_SHARE = 0.15  # other jobs' CPU above this share of the machine makes a measurement unreportable


def _find(program: str) -> str | None:
    """``program`` from ``$KVROUTE_PEERS_BIN``, the repository's peers venv, this venv, or PATH."""
    dirs = [os.environ.get("KVROUTE_PEERS_BIN"), str(Path(sys.prefix).parent / PEERS_VENV / "bin"),
            str(Path(sys.prefix) / "bin"), "/usr/sbin"]
    for d in filter(None, dirs):
        path = Path(d) / program
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(program)


def _haproxy(exe: str, port: int, upstreams: list[int], tmp: Path) -> list[str]:
    servers = "\n".join(f"  server s{i} 127.0.0.1:{p}" for i, p in enumerate(upstreams))
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(f"""global
  nbthread 1
  maxconn 4096
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
  option http-keep-alive
  http-reuse always
frontend f
  bind 127.0.0.1:{port}
  default_backend b
backend b
  balance roundrobin
{servers}
""")
    return [exe, "-db", "-f", str(cfg)]


def _nginx(exe: str, port: int, upstreams: list[int], tmp: Path) -> list[str]:
    servers = " ".join(f"server 127.0.0.1:{p};" for p in upstreams)
    temps = " ".join(f"{k}_temp_path {tmp}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    cfg = tmp / "nginx.conf"
    cfg.write_text(f"""daemon off; master_process off; worker_processes 1; pid {tmp}/nginx.pid; error_log stderr error;
events {{ worker_connections 4096; }}
http {{
  access_log off; {temps}
  upstream up {{ {servers} keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://up; proxy_http_version 1.1; proxy_set_header Connection "";
                 proxy_buffering off; }}
  }}
}}
""")
    return [exe, "-e", "stderr", "-p", str(tmp), "-c", str(cfg)]


def _rust_router(exe: str, port: int, upstreams: list[int], tmp: Path, sub: tuple[str, ...],
                 metrics_port: int) -> list[str]:
    return [exe, *sub, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--worker-urls", *(f"http://127.0.0.1:{p}" for p in upstreams),
            "--prometheus-port", str(metrics_port), "--log-level", "error"]


@dataclass(frozen=True)
class Peer:
    """A router to measure beside kvroute: its program, how to install it, how to start it."""

    name: str
    program: str
    install: str
    build: Callable[..., list[str]]
    sub: tuple[str, ...] = ()

    def find(self) -> str | None:
        """The program's path, or None when it is not installed."""
        return _find(self.program)

    def command(self, exe: str, port: int, upstreams: list[int], tmp: Path, metrics_port: int) -> list[str]:
        """The command line that serves on ``port`` over ``upstreams``."""
        if self.build is _rust_router:
            return _rust_router(exe, port, upstreams, tmp, self.sub, metrics_port)
        return self.build(exe, port, upstreams, tmp)


PEERS = {
    "sglang-router": Peer("sglang-router", "sglang-router", "make peers (pip install sglang-router==0.3.2 into "
                          f"{PEERS_VENV})", _rust_router, ("launch",)),
    "vllm-router": Peer("vllm-router", "vllm-router", f"make peers (pip install vllm-router==0.1.17 into {PEERS_VENV})",
                        _rust_router),
    "haproxy": Peer("haproxy", "haproxy", "apt-get install haproxy (make system-deps)", _haproxy),
    "nginx": Peer("nginx", "nginx", "apt-get install nginx (make peers)", _nginx),
}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its living descendants, from /proc."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p, fields in process_stats().items():
        parents[p] = int(fields[1])
        times[p] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo.extend(c for c, parent in parents.items() if parent == p)
    return total


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent on anything but idling, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user, nice, system only: idle and iowait are not work; irq and softirq time is left out
    # because the loopback traffic of the load itself is processed there (counting it would call
    # the load's own packets other jobs); steal is another guest's time
    return (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")


class MachineLoad:
    """Measures, over one load, how much of the machine other jobs took."""

    def __init__(self, own_pids: list[int]):
        self.own_pids = own_pids  # router (with descendants) and upstreams
        self.t0 = time.monotonic()
        self.busy0 = _machine_busy_s()
        self.own0 = self._own()

    def _own(self) -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load client, once reaped
        return (me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
                + sum(tree_cpu_s(p) for p in self.own_pids))

    def others_share(self) -> float:
        """Other jobs' CPU since construction as a share of the machine (0 = it was ours alone)."""
        wall = max(1e-6, time.monotonic() - self.t0)
        others = (_machine_busy_s() - self.busy0) - (self._own() - self.own0)
        return max(0.0, others / (wall * (os.cpu_count() or 1)))


def start(peer: Peer, exe: str, port: int, upstreams: list[int], tmp: Path, metrics_port: int) -> subprocess.Popen:
    """Start ``peer`` (its output discarded but for errors, which the caller sees as a dead process)."""
    (tmp / peer.name).mkdir(exist_ok=True)
    cmd = peer.command(exe, port, upstreams, tmp / peer.name, metrics_port)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
