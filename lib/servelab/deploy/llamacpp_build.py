"""Build upstream llama.cpp's ``llama-server`` from the source vendored in the PyPI sdist ``llama-cpp-python``.

Server target only, portable AVX2 flags, no web UI download (``-DLLAMA_USE_PREBUILT_UI=OFF``). The binary
is cached under ``<cache>/llama-server/llama-cpp-python-<version>/`` so the second run is instant.
About 6 minutes on 2 cores the first time.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

from servelab.core.paths import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"   # vendors llama.cpp commit 0c1e570
BUILD_REVISION = 3                    # bump when the flags or targets change (2: + RPC; 3: + TCP_NODELAY)
TARGETS = ("llama-server", "ggml-rpc-server")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_RPC=ON",   # ggml-rpc-server: llama.cpp's own multi-node backend (head llama-server --rpc workers)
    # cpp-httplib defaults to Nagle on: with a client that delays its ACKs, SSE chunks stall ~40-200 ms
    # (measured: P1 TTFT on the tiny model 132-280 ms instead of 3-6 ms). Real engines' servers set NODELAY.
    "-DCMAKE_CXX_FLAGS=-DCPPHTTPLIB_TCP_NODELAY=true",
]


class BuildError(RuntimeError):
    pass


def binary_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / "llama-server" / f"llama-cpp-python-{version}-r{BUILD_REVISION}"


def cached_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path | None:
    """The cached binary if it exists and runs; else None."""
    d = binary_dir(version)
    if all((d / t).exists() and os.access(d / t, os.X_OK) for t in TARGETS):
        return d / "llama-server"
    return None


def rpc_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``rpc-server`` (built with llama-server): a worker node's process in a multi-node llama.cpp target."""
    return ensure_llama_server(version).parent / "ggml-rpc-server"


def missing_tools() -> list[str]:
    return [t for t in ("cmake", "ninja", "c++", "cc") if shutil.which(t) is None]


NINJA_STEP = re.compile(rb"^\[(\d+)/(\d+)\]")


def _run(argv: list[str], log: Path, cwd: Path | None = None,
         on_step: Callable[[int, int], None] | None = None) -> None:
    """Run one build step, its output appended to ``log``; ``on_step(done, total)`` follows ninja's ``[k/N]``."""
    with open(log, "ab") as f:
        f.write(("\n$ " + " ".join(argv) + "\n").encode())
        f.flush()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd)
        assert p.stdout is not None
        for line in p.stdout:
            f.write(line)
            m = NINJA_STEP.match(line)
            if m and on_step:
                on_step(int(m.group(1)), int(m.group(2)))
        p.wait()
    if p.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise BuildError(f"building llama-server failed at: {' '.join(argv)}\n(log {log})\n{tail}")


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None,
                        progress: Callable[[str], None] | None = None) -> Path:
    """Return the cached ``llama-server`` binary (``rpc-server`` beside it), building both first if needed
    (locked against concurrent builds). ``progress`` receives one line per build step and about every 10 %
    of the compilation (step, elapsed time)."""
    say = progress or (lambda _line: None)
    exe = cached_server(version)
    if exe:
        return exe
    missing = missing_tools()
    if missing:
        raise BuildError(f"cannot build llama-server: missing {', '.join(missing)} "
                         f"(install with: apt-get install -y cmake ninja-build g++)")
    out = binary_dir(version)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building the same version
        exe = cached_server(version)
        if exe:
            return exe
        log = out / "build.log"
        log.write_text("")
        t0 = time.monotonic()
        say(f"building llama-server {version} (about 6 minutes on 2 cores the first time; log {log})")
        with tempfile.TemporaryDirectory(prefix="servelab-llamacpp-") as tmp:
            work = Path(tmp)
            say("  1/3 downloading the llama-cpp-python sdist (vendors llama.cpp)")
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(work),
                  f"llama-cpp-python=={version}"], log)
            sdists = list(work.glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise BuildError(f"pip download gave no llama-cpp-python sdist (log {log})")
            with tarfile.open(sdists[0]) as tf:
                tf.extractall(work, filter="data")
            src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
            if not (src / "CMakeLists.txt").exists():
                raise BuildError(f"{sdists[0].name} has no vendored llama.cpp at {src}")
            build = work / "build"
            say(f"  2/3 configuring with cmake ({time.monotonic() - t0:.0f} s)")
            _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], log)
            shown = [-1]

            def step(done: int, total: int) -> None:
                tenth = done * 10 // max(total, 1)
                if tenth > shown[0]:
                    shown[0] = tenth
                    say(f"  3/3 compiling: {done}/{total} ({time.monotonic() - t0:.0f} s elapsed)")
            _run(["ninja", "-C", str(build), f"-j{jobs or os.cpu_count() or 2}", *TARGETS], log, on_step=step)
            for t in TARGETS:
                tmp_exe = out / f"{t}.tmp"
                shutil.copy2(build / "bin" / t, tmp_exe)
                os.replace(tmp_exe, out / t)
        say(f"llama-server built in {time.monotonic() - t0:.0f} s, cached at {out}")
        return out / "llama-server"
