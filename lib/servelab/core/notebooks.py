"""The phases of an investigation and their notebooks: ``phase1`` ↔ ``notebooks/phase1_perf_map.ipynb``.

Each phase has one notebook and one library module of the same name (``servelab.phases.phase1_perf_map``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from traitlets import default

from servelab.core.params import ParamError, did_you_mean
from servelab.core import signals
from servelab.core.paths import project_root

NOTEBOOKS = {
    "phase0": "phase0_manifest",
    "phase1": "phase1_perf_map",
    "phase2": "phase2_hardware",
    "phase3": "phase3_timeline",
    "phase4": "phase4_topology",
    "phase5": "phase5_comm",
    "phase6": "phase6_kernels",
    "phase7": "phase7_interference",
    "phase8": "phase8_cache",
    "phase9": "phase9_speculative",
}


def notebook_path(phase: str) -> Path:
    """``phase1`` or ``phase1_perf_map`` → ``notebooks/phase1_perf_map.ipynb`` (clear error if unknown)."""
    key = phase.split("_")[0]
    if key not in NOTEBOOKS:
        raise ParamError(f"unknown phase '{phase}'{did_you_mean(key, set(NOTEBOOKS))}; "
                         f"phases: {', '.join(NOTEBOOKS)}")
    path = project_root() / "notebooks" / f"{NOTEBOOKS[key]}.ipynb"
    if not path.exists():
        raise ParamError(f"phase '{key}' has no notebook yet ({path.name} is missing)")
    return path


def available_phases() -> list[str]:
    return [k for k, v in NOTEBOOKS.items() if (project_root() / "notebooks" / f"{v}.ipynb").exists()]


def kernel_manager_class(log_path: Path | None = None, env: dict[str, str] | None = None) -> type:
    """Kernels talk to papermill over IPC sockets in the user's private runtime dir: no TCP port is opened (and
    ipykernel has nothing to warn about). The kernel process's own output — its logging, a traceback while it is
    being shut down after Ctrl-C — goes to ``log_path`` (the phase folder's ``kernel.log``), not the terminal.
    ``env`` is added to the kernel's environment (the secrets a derived target names; never on disk or argv)."""
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        @default("transport")
        def _default_transport(self) -> str:
            return "ipc"

        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            if env:           # the secrets a derived target names as ${NAME}: in the kernel's environment only
                kw["env"] = {**(kw.get("env") or os.environ), **env}
            if "JPY_SESSION_NAME" in (kw.get("env") or os.environ):    # run from a JupyterLab notebook: that
                kw["env"] = {k: v for k, v in (kw.get("env") or os.environ).items()    # notebook is not this phase's
                             if k != "JPY_SESSION_NAME"}
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(log_path, "ab")          # the child keeps its own copy of the descriptor
                try:
                    kw.update(stdout=log, stderr=log)
                    await super()._async_launch_kernel(kernel_cmd, **kw)
                finally:
                    log.close()
            else:
                await super()._async_launch_kernel(kernel_cmd, **kw)
            pid = getattr(getattr(self, "provisioner", None), "pid", None)
            if pid:                 # SIGTERM to `servelab run` reaches the kernel at once (core.signals)
                signals.forward_to(int(pid))
    return IPCKernelManager
