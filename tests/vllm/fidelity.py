"""Issue 12's fidelity comparison against real vLLM CPU engines (issue 21, item 8): start two
engines from `.venv-vllm` (`make vllm-env`), one on each core (below),
run `kvroute bench fidelity` against them (it calibrates them first, with this machine's core
count as the cores they share), and stop every engine process by its PID.

    python -m tests.vllm.fidelity [--engines N] [--blocks B] [--json FILE] [-- extra bench fidelity args]

(`make fidelity-vllm`.) vLLM's scheduler (continuous batching, chunked prefill, a shared prefix
cache, preemption) is the one the simulator models; each engine is three processes (API server,
engine core, worker). vLLM pins only the worker (``VLLM_CPU_OMP_THREADS_BIND``); once the engines are
ready this harness binds every thread of each engine's tree to its worker's core
(calibrate/host_cpu.py ``pin_tree``; ``--no-pin``: as before, the API servers and engine cores float
over both cores). Measured (issue 21x, quiet, bench fidelity's sweep at 3 repeats): unbound, three
calibrations of the same two engines back to back predicted a cold 1,024-token prefill at 141, 168 and
137 ms, their swept points ×0.77–1.60 apart, and within a calibration one engine ran ×1.3–1.6 slower
than the other for whole stretches; bound, two calibrations back to back 166 and 166 ms, points
×0.91–1.18 apart, but bound engines started afresh 139 and 169 ms: an engine instance's level still
moves between starts. The gateway and the load generator still float over both cores.

The engines run in this process's session, as tests/llamacpp's do (`--own-sessions`: each in its
own). Where Linux groups CPU time by session (``/proc/sys/kernel/sched_autogroup_enabled``, on
here), every session gets an equal share of the cores, and two engines whose worker and engine
core spin between steps (vLLM's shared-memory queue yields in a loop for a second after each
read) then held the gateway's session off the cores: in one quiet run (issue 21f) the gateway
waited for a core 0.53 cores' worth while it ran 0.04, streams reached the client in bursts (68 of
480 requests got all 16 tokens within 5 ms of the first), and the live TTFT p99 was 0.4-1.0 s; with the engines in
the bench's session 0.19 and 0.08, no bursts, TTFT p99 94-163 ms.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvroute.calibrate.host_cpu import pin_tree
from kvroute.ports import free_ports
from tests.vllm import engine as vllm

# KV blocks per engine (32 tokens each): 16K tokens of cache, room for most of the workload's
# conversations; the context limit is the tiny model's 2,048 positions, so the workload's shared
# system prompt is cut from 1,500 to 1,200 tokens (prompts stay below ~1,800 tokens)
BLOCKS = 512
MAX_MODEL_LEN = 2048
SYSTEM_TOKENS = "1200"
# vLLM's per-step token budget on CPU: 2048 x world size for the API server (vllm/engine/arg_utils.py,
# get_batch_defaults, vLLM 0.32); /metrics does not publish it, so the calibration is told (issue 21n)
MAX_BATCHED_TOKENS = "2048"

def main(argv: list[str] | None = None) -> int:
    """Start the engines, run the comparison, stop them; the bench's exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=BLOCKS)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--own-sessions", action="store_true",
                    help="start each engine in a session of its own (with Linux's autogroup scheduling every session "
                         "then gets an equal share of the cores, and the gateway's session starves: see the docstring)")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave each engine's API server and engine core unbound (vLLM binds only the worker)")
    ap.add_argument("rest", nargs="*", help="more `kvroute bench fidelity` arguments (after --)")
    args = ap.parse_args(argv)
    if not vllm.available():
        print("no vLLM engine: run `make vllm-env` first", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="kvroute-fidelity-vllm-"))
    model = vllm.write_model(vllm.MODEL_DIR)
    ports = free_ports(3 * args.engines)
    cores = os.cpu_count() or 1
    engines = [vllm.VLLMEngine(model, ports[3 * i], ports[3 * i + 1], ports[3 * i + 2], core=i % cores,
                               blocks=args.blocks, workdir=root / f"e{i}", max_model_len=MAX_MODEL_LEN,
                               new_session=args.own_sessions)
               for i in range(args.engines)]
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        if not args.no_pin:
            for e in engines:
                assert e.proc is not None
                print(f"{e.url}: {pin_tree(e.proc.pid, {e.core})} threads bound to core {e.core}", file=sys.stderr)
        urls = [x for e in engines for x in ("--url", e.url)]
        cmd = [sys.executable, "-m", "kvroute.cli", "bench", "fidelity", *urls, "--system-tokens", SYSTEM_TOKENS,
               "--max-batched-tokens", MAX_BATCHED_TOKENS,
               *(["--json", args.json] if args.json else []), *args.rest]
        print(f"load average {os.getloadavg()[0]:.2f}; {' '.join(cmd[2:])}", file=sys.stderr)
        before, t0 = [_cpu(e) for e in engines], time.monotonic()
        code = subprocess.call(cmd)
        wall = time.monotonic() - t0
        # where the engines' CPU went: the API server (HTTP, tokenizing, streaming) against the
        # engine core and its workers (the steps); both share this machine's cores
        for e, (api0, core0) in zip(engines, before, strict=True):
            api, core = _cpu(e)
            print(f"{e.url}: API server {(api - api0) / wall:.0%} of a core, engine core + workers "
                  f"{(core - core0) / wall:.0%} over {wall:.0f} s (calibration included)", file=sys.stderr)
        return code
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(root, ignore_errors=True)


def _cpu(e: vllm.VLLMEngine) -> tuple[float, float]:
    """CPU seconds (user + system) of the engine's API server and of its other processes."""
    assert e.proc is not None
    e.pids |= set(vllm.descendants(e.proc.pid))
    api = core = 0.0
    for pid in e.pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if pid == e.proc.pid:
            api += s
        else:
            core += s
    return api, core


if __name__ == "__main__":
    sys.exit(main())
