"""Make llama.cpp's `llama-server` available to the real-engine test tier.

Nothing but the package registries is reachable from CI, so the server is built from the
llama.cpp sources vendored in the PyPI sdist of llama-cpp-python (no wheel ships a Linux
binary): `pip download` the sdist, configure `vendor/llama.cpp` with cmake + ninja and build
only the `llama-server` target (a static binary, ~15 MB). That takes about 5-7 minutes on two
cores, so the binary is cached outside the work tree, keyed by version:

    $KVROUTE_CACHE (default ~/.cache/kvroute)/llama.cpp/<version>/llama-server

It is rebuilt when absent. An exclusive file lock next to it makes concurrent callers (two
pytest processes, or pytest-xdist workers) wait for one build instead of building twice.
A failed build raises `BuildError` with the tail of the tool's output; it never skips.

Prebuild from the command line with `python -m tests.llamacpp.build` (prints the path).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp we build
JOBS = 2
CMAKE_FLAGS = [
    "-G", "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_NATIVE=ON",
]


class BuildError(RuntimeError):
    """llama-server could not be built; the message says which step failed and why."""


def cache_dir(version: str = VERSION) -> Path:
    root = Path(os.environ.get("KVROUTE_CACHE") or Path.home() / ".cache" / "kvroute")
    return root / "llama.cpp" / version


def binary_path(version: str = VERSION) -> Path:
    return cache_dir(version) / "llama-server"


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _run(step: str, cmd: list[str], cwd: Path | None = None, log=None) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log(f"[llama-server build] {step}: {time.monotonic() - t0:.0f} s (exit {proc.returncode})")
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise BuildError(f"{step} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")


def _build(version: str, dest: Path, log) -> None:
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            raise BuildError(f"`{tool}` is not on PATH; the real-engine tier needs cmake, ninja and a C++ compiler")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=dest.parent) as tmp:
        work = Path(tmp)
        _run("pip download", [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                              "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", str(work)], log=log)
        sdists = list(work.glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise BuildError(f"expected one llama-cpp-python sdist in {work}, found {[p.name for p in work.iterdir()]}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(work, filter="tar")
        src = work / sdists[0].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
        if not (src / "CMakeLists.txt").is_file():
            raise BuildError(f"no vendored llama.cpp in the sdist (looked for {src})")
        build = work / "build"
        _run("cmake configure", ["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], log=log)
        _run("cmake build", ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(JOBS)], log=log)
        built = build / "bin" / "llama-server"
        if not _usable(built):
            raise BuildError(f"the build finished but {built} is missing")
        staged = dest.with_suffix(".part")
        shutil.copy2(built, staged)
        os.replace(staged, dest)  # atomic: a reader never sees half a binary


def ensure_llama_server(version: str = VERSION, log=None) -> Path:
    """Path of a runnable llama-server for `version`, building it first if it is not cached.

    `$KVROUTE_LLAMA_SERVER` pointing at an existing binary overrides the cache (a local build)."""
    override = os.environ.get("KVROUTE_LLAMA_SERVER")
    if override:
        if not _usable(Path(override)):
            raise BuildError(f"KVROUTE_LLAMA_SERVER={override} is not an executable file")
        return Path(override)
    dest = binary_path(version)
    if _usable(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        if not _usable(dest):  # another process may have built it while we waited
            for leftover in dest.parent.glob("build-*"):  # from a build that was killed
                shutil.rmtree(leftover, ignore_errors=True)
            if log is not None:
                log(f"[llama-server build] {dest} is absent: building llama.cpp from "
                    f"llama-cpp-python=={version}'s sdist (about 7 minutes on 2 cores, once)")
            _build(version, dest, log)
    return dest


if __name__ == "__main__":
    t0 = time.monotonic()
    path = ensure_llama_server(log=lambda m: print(m, file=sys.stderr))
    print(path)
    print(f"[llama-server] ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
