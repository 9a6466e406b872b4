"""Real vLLM CPU engines for tests: started from the project's .venv-vllm, stopped by PID with
every process they spawned (the API server's engine core and its workers keep the KV-event ports
when only the server is killed: shared/design/real-vllm-cpu.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvroute.calibrate.host_cpu import process_stats
from kvroute.ports import hold_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 32  # CPU attention needs a multiple of 32
MODEL_DIR = ROOT / ".venv-vllm" / "tiny-model"  # written once per vLLM venv (random weights, seed 0)
# the pair tests/test_vllm.py and tests/test_vllm_streams.py share (SharedPair): 1,504 tokens of
# context, room for the streams' 900-token answers; test_vllm's conversations are sized to evict
SHARED_BLOCKS = 48
# vLLM 0.32's API server always spawns its engine core; with V1 multiprocessing on (the default) the
# CPU platform also makes the core spawn a worker (platforms/cpu.py forces the "mp" executor), each
# process importing torch and vLLM. Off, the "uni" executor runs the model inside the core. One
# engine's cold start, busy, load 6-7.5, ABAB (ci17, session 17): 124.3 / 117.6 s with the worker
# process, 81.0 / 79.2 s without. Not for the shared pair (SharedPair): tests/test_vllm_streams.py
# holds an engine core to a tenth of a CPU to pace a stream, and with the model inside the core that
# throttles the model too (its frozen test took 122.8 s instead of about 14, busy, load ~10)
WORKER_IN_CORE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def available() -> bool:
    """Whether `make vllm-env` has installed the engine."""
    return VLLM_PYTHON.is_file()


def write_model(out: Path) -> Path:
    """The tiny random-weight model (tests/vllm/tiny_model.py), written by the vLLM venv's Python."""
    done = out / ".complete"
    if not done.is_file():
        subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("tiny_model.py")), str(out)], check=True,
                       capture_output=True, timeout=300)
        done.touch()
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for p, fields in process_stats().items():
        children.setdefault(int(fields[1]), []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class VLLMEngine:
    """One `vllm.entrypoints.openai.api_server` with prefix caching and KV events (ZMQ PUB bound on
    ``events_port``, replay ROUTER on ``replay_port``, topic ``kv``), pinned to one core."""

    def __init__(self, model: Path, port: int, events_port: int, replay_port: int, core: int, blocks: int,
                 workdir: Path, extra_args: tuple[str, ...] = (), max_model_len: int | None = None,
                 new_session: bool = True, worker_in_core: bool = False):
        """``extra_args``: more server flags (e.g. a ``--kv-transfer-config`` for a P/D pair);
        ``max_model_len``: the context limit (default: what ``blocks`` hold, less one block; the
        tiny model's positions stop at 2,048); ``new_session``: start it in a session of its own
        (on Linux with autogroup scheduling, sched_autogroup_enabled, each session then gets an equal
        share of the CPU; False: it shares the caller's, as tests/llamacpp's engines do);
        ``worker_in_core``: run the model in the engine core process (WORKER_IN_CORE_ENV) instead of
        a worker process of its own: two processes start instead of three. For tests of what the
        engine answers, not of how fast: vLLM's CPU platform asks for the worker process so that it
        can set OpenMP up before torch loads (platforms/cpu.py), so timings are left to the default."""
        self.new_session, self.worker_in_core = new_session, worker_in_core
        self.model, self.port, self.events_port, self.replay_port = model, port, events_port, replay_port
        self.core, self.blocks, self.workdir = core, blocks, workdir
        self.extra_args = extra_args
        self.max_model_len = max_model_len or (blocks - 1) * BLOCK
        self.proc: subprocess.Popen | None = None
        self.pids: set[int] = set()
        self.started: dict[int, int] = {}  # pid -> its start time: a PID names our process only while they match

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CACHE_ROOT": str(self.workdir / "cache"), "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(self.core), "TMPDIR": str(self.workdir),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(WORKER_IN_CORE_ENV if self.worker_in_core else {})}
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}", "topic": "kv"}
        cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "bfloat16", "--max-model-len", str(self.max_model_len), "--enable-prefix-caching",
               "--block-size", str(BLOCK), "--enforce-eager", "--num-gpu-blocks-override", str(self.blocks),
               "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events), *self.extra_args]
        self.log = open(self.workdir / f"vllm-{self.port}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                     start_new_session=self.new_session)
        self.pids, self.started = set(), {}
        self._track()

    def wait_ready(self, timeout: float = 400.0) -> None:
        """Until /health answers 200 (a cold start takes 20 s on an idle machine, minutes on a busy one)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited {self.proc.returncode}:\n{self.log_tail()}")
            self._track()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        self._track()
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM on port {self.port} not ready within {timeout:g} s:\n{self.log_tail()}")

    def _track(self) -> None:
        """Remember the server and every process below it now, each with its start time: children
        outlive a killed server (re-parented, so no longer found below it), and this machine's PIDs
        wrap at 32,768, so by the time a short-lived child's PID is signalled it may be another's."""
        assert self.proc is not None
        for pid in (self.proc.pid, *descendants(self.proc.pid)):
            start = _start_time(pid)
            if start is not None:
                self.started[pid] = start
                self.pids.add(pid)

    def log_tail(self, lines: int = 25) -> str:
        """The end of the engine's log (its folder is removed after the tests)."""
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM the server and every process it spawned (by PID), SIGKILL what is left after 15 s."""
        if self.proc is None:
            return
        self._track()
        ours = {pid: start for pid, start in self.started.items() if _start_time(pid) == start}
        for pid in sorted(ours):
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in ours.items()):
            if self.proc.poll() is None:
                time.sleep(0.2)
            else:
                time.sleep(0.2)
                self._reap()
        for pid, start in ours.items():
            if _alive(pid, start):
                _signal(pid, signal.SIGKILL)
        self.proc.wait(timeout=15)
        self.proc = None
        self.pids, self.started = set(), {}
        self.log.close()

    def revive(self) -> None:
        """Make sure the engine runs for the next test file: SIGCONT every process of it (a test may
        have left its core stopped), and start it again if its server has exited (a test killed it)
        or /health does not answer 200."""
        if self.proc is not None:
            self._track()
            for pid, start in self.started.items():
                if _alive(pid, start):
                    _signal(pid, signal.SIGCONT)
            if self.proc.poll() is None and self._healthy():
                return
        self.stop()
        self.start()
        self.wait_ready()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    def _reap(self) -> None:
        for pid in self.pids:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())


@contextlib.contextmanager
def running_engines(n: int, blocks: int, prefix: str) -> Iterator[tuple[Path, list[VLLMEngine]]]:
    """``n`` engines of the test model (``blocks`` KV blocks each, one core each), started and ready;
    stopped, and their folder removed, when the block ends. The folder is one of their own:
    pytest's shared basetemp is pruned by other pytest runs on the machine."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    model = write_model(MODEL_DIR)
    held = held_ports(3 * n)
    ports = [s.getsockname()[1] for s in held]
    engines = [VLLMEngine(model, ports[3 * i], ports[3 * i + 1], ports[3 * i + 2], core=i % (os.cpu_count() or 1),
                          blocks=blocks, workdir=root / f"e{i}") for i in range(n)]
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        release(held)
        yield model, engines
    finally:
        release(held)
        for e in engines:
            e.stop()
        shutil.rmtree(root, ignore_errors=True)


class SharedPair:
    """Two engines of SHARED_BLOCKS blocks each, started once per test session for every file whose
    tests need the same flags (tests/conftest.py's ``vllm_shared``): a pair start is 60-80 s of a CI
    run. :meth:`engines` starts them on first use, and afterwards revives any engine an earlier
    file killed or froze; :meth:`close` stops them (by PID) and removes their folder."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._pair: tuple[Path, list[VLLMEngine]] | None = None

    def engines(self) -> tuple[Path, list[VLLMEngine]]:
        """(the model's folder, the two engines), both running."""
        if self._pair is None:
            self._pair = self._stack.enter_context(running_engines(2, SHARED_BLOCKS, "kvroute-vllm-"))
        else:
            for e in self._pair[1]:
                e.revive()
        return self._pair

    def close(self) -> None:
        """Stop both engines (again is harmless; a later :meth:`engines` starts a new pair)."""
        self._pair = None
        self._stack.close()


def held_ports(k: int) -> list[socket.socket]:
    """``k`` ports kept (kvroute.ports.hold_port) for engines that bind them only after a cold start of
    tens of seconds: the API server's (vLLM binds it with SO_REUSEADDR) and the ZeroMQ KV-event ports
    (libzmq's listeners set it too), so each engine takes its own while no other process can. A port
    merely named free (free_ports) may meanwhile be taken as another connection's source port, as
    happened to the fleet tests' ports under concurrent suites. Release them once the engines are ready."""
    held: list[socket.socket] = []
    try:
        for _ in range(k):
            held.append(hold_port())
    except OSError:
        release(held)
        raise
    return held


def release(held: list[socket.socket]) -> None:
    """Close held ports (again is harmless)."""
    for s in held:
        s.close()


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, /proc/PID/stat field 22); None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _alive(pid: int, start: int) -> bool:
    """Whether the process that started at ``start`` still runs as ``pid`` (not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] != "Z" and int(fields[19]) == start


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
