"""A phase's context for a test that calls a phase's steps (or its ``run``) directly: a real run folder, the
phase's typed parameters (its ``Params`` definition, without ``params/<phase>.yaml``) and a real target."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.core import run as runlib
from servelab.deploy.targets import load_target
from servelab.phases import definition
from servelab.phases.context import PhaseContext


def phase_ctx(rdir: Path, phase: str, target: str = "local-tiny", from_samples: bool = False,
              **params: Any) -> PhaseContext:
    """The context of ``phase`` writing into run folder ``rdir`` (its phase folder made), with ``params`` over the
    definition's defaults."""
    (rdir / phase).mkdir(parents=True, exist_ok=True)
    values = definition(phase).resolve(given={"target": target, "run_id": rdir.name, **params},
                                       phase_file_values=False)
    return PhaseContext(phase=phase, run_id=rdir.name, run_dir=rdir, phase_dir=rdir / phase, params=values,
                        target=load_target(target), from_samples=from_samples, started=runlib.now_iso())
