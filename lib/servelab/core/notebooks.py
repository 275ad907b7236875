"""The phases of an investigation and their notebooks: ``phase1`` ↔ ``notebooks/phase1_perf_map.ipynb``.

Each phase has one notebook and one library module of the same name (``servelab.phases.phase1_perf_map``).
"""
from __future__ import annotations

from pathlib import Path

from servelab.core.params import ParamError, did_you_mean
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
