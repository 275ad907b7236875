"""The run scope: which run and phase a piece of work belongs to, where it writes, what it runs against, and the
run's records it adds to (where its numbers come from, notes, the command log).

It sits at the bottom so that every layer can type against it: ``measure`` (a live capture, a launch variant),
``report`` (the ledger, the commands section) and the phases all take a :class:`RunScope`; the phase context
(:class:`servelab.phases.context.PhaseContext`) is a run scope with the phase's typed parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from servelab.core import run as runlib

SOURCE_KINDS = ("live", "samples", "model")


class TargetInfo(Protocol):
    """What the run scope needs to know of its target (``servelab.deploy.spec.Target`` is one)."""
    name: str
    engine: str

    def secret_values(self) -> tuple[str, ...]: ...


@dataclass(kw_only=True)
class RunScope:
    """One phase of one run: ``run_dir`` (``outputs/<run_id>``), ``phase_dir`` (``outputs/<run_id>/<phase>``), the
    target it runs against, and what it records about itself."""
    phase: str
    run_id: str
    run_dir: Path
    phase_dir: Path
    target: Any                      # a TargetInfo (servelab.deploy.spec.Target)
    from_samples: bool = False       # the numbers come from recorded sample data, not the target
    notes: list[str] = field(default_factory=list)
    # where the page's numbers come from (SOURCE_KINDS), each with what
    sources: list[dict[str, str]] = field(default_factory=list)

    def add_source(self, kind: str, what: str) -> None:
        """Say where (part of) this phase's numbers come from: ``live`` (measured on the target), ``samples``
        (recorded sample data: which) or ``model`` (a model: which). The run summary and the top of the page show
        it; a phase that says nothing is ``live`` (or ``samples`` when ``from_samples`` is set)."""
        if kind not in SOURCE_KINDS:
            raise ValueError(f"source kind must be live, samples or model, got {kind!r}")
        entry = {"kind": kind, "what": what}
        if entry not in self.sources:
            self.sources.append(entry)

    def log_command(self, label: str, argv: list[str], title: str = "", unique: bool = False,
                    **kw: Any) -> runlib.CommandRecord:
        """Record a command of this phase (``executed`` / ``reproduce`` / ``planned``) in the run's command log;
        ``unique``: not again when the same label and argv are already recorded for the phase."""
        return runlib.record_command(self.run_dir, runlib.CommandRecord(label=label, argv=list(argv), phase=self.phase,
                                                                        title=title, **kw), unique=unique)

    def case_dir(self, case_id: str) -> Path:
        d = self.run_dir / "cases" / case_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def run_relative(self, path: str | Path) -> str:
        """A file as the run index links it: relative to the run folder, ``/``-separated (a bare name or a path
        under this phase is this phase's file)."""
        p = Path(path)
        if p.is_absolute():
            return p.resolve().relative_to(Path(self.run_dir).resolve()).as_posix()
        if len(p.parts) > 1 and (p.parts[0].startswith("phase") or p.parts[0] == "cases"):
            return p.as_posix()                       # already relative to the run folder
        return (Path(self.phase) / p).as_posix()       # a file of this phase's folder
