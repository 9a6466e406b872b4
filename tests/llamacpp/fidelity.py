"""Issue 12's fidelity comparison on this machine, self-contained: build (or reuse) llama-server,
start three engines as the real-engine tier does (`-t 1 -tb 1 -np 4`, the tiny model), run
`kvroute bench fidelity` against them (it calibrates them first, with this machine's core count
as the cores they share), and stop every engine by its PID.

    python -m tests.llamacpp.fidelity [--engines N] [--json FILE] [-- extra bench fidelity args]

Afterwards the engines' logs say where each live request's time went inside llama-server
(kvroute.bench.fidelity_llama_log: ``engine_log`` in the JSON, one line per policy and kind).
(`make fidelity` runs it with `-- --repeats 3`: every policy three times, interleaved.) Engines,
gateway and clients share this machine: compare runs only at similar load averages, which the
JSON records per policy and repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.llamacpp import build
from tests.llamacpp.engine import LlamaServer
from tests.llamacpp.tiny_model import write_tiny_gguf


def main(argv: list[str] | None = None) -> int:
    """Start the engines, run the comparison, stop them; the bench's exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("rest", nargs="*", help="more `kvroute bench fidelity` arguments (after --)")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="kvroute-fidelity-engines-"))
    binary = build.ensure_llama_server()
    model = write_tiny_gguf(folder / "tiny.gguf")
    engines = [LlamaServer(binary, model, folder, f"llama-{i}") for i in range(args.engines)]
    try:
        for e in engines:
            e.start()
        urls = [x for e in engines for x in ("--url", e.url)]
        cmd = [sys.executable, "-m", "kvroute.cli", "bench", "fidelity", *urls,
               *(["--json", args.json] if args.json else []), *args.rest]
        print(f"load average {os.getloadavg()[0]:.2f}; {' '.join(cmd[2:])}", file=sys.stderr)
        rc = subprocess.call(cmd)
        if args.json and Path(args.json).is_file():  # the engines' own times, from their logs
            _engine_log(Path(args.json), [e.log_path for e in engines])
        return rc
    finally:
        for e in engines:
            e.stop()


def _engine_log(path: Path, logs: list[Path]) -> None:
    """Add where each live request's time went inside llama-server (its log; the bench's
    fidelity_llama_log) to the JSON as ``engine_log``, and print it."""
    from kvroute.bench.fidelity_llama_log import describe, summarize

    stored = json.loads(path.read_text())
    stored["engine_log"] = summarize(stored, [p.read_text(errors="replace") for p in logs])
    path.write_text(json.dumps(stored, indent=2))
    for line in describe(stored["engine_log"]):
        print(f"llama-server log: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
