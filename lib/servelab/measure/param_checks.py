"""Phase checks (``core.params.phase_check``): every parameter that names a folder, file, case or run is checked
before a run folder is made or a kernel starts — ``servelab run`` runs them in ``validate``, the notebook in
``open_phase`` — one line saying what to do.

A phase adds its own check here with ``@phase_check("phaseN")``; ``check(params)`` gets the typed parameters and
``target`` (the target's name) and raises :class:`ParamError`. Relative paths are read from the project root, where
the phase's kernel runs.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from servelab.core.params import ParamError, existing_path, phase_check
from servelab.core.paths import project_root
from servelab.core.run import read_manifest, run_dir
from servelab.deploy.cluster import ClusterError, parse_cluster
from servelab.deploy.targets import load_target
from servelab.measure.capture_point import resolve_capture_point
from servelab.measure.matrix import quick_matrix


def _dir(params: dict[str, Any], name: str, what: str) -> None:
    if params.get(name):
        existing_path(params[name], name, "dir", what, base=project_root())


def _files(params: dict[str, Any], name: str, what: str) -> None:
    for f in params.get(name) or []:
        existing_path(str(f), name, "file", what, base=project_root())


@phase_check("phase1")
def phase1_cases(params: dict[str, Any]) -> None:
    """``cases``: ids or scenarios of the target's quick matrix."""
    cases = params.get("cases") or []
    if bad := [c for c in cases if not isinstance(c, str)]:
        raise ParamError(f"cases: {bad[0]!r} is not a case id; give ids or scenarios of the quick matrix as strings "
                         f"(-p 'cases=[\"P1\", \"D2\"]')")
    if cases and params.get("target"):
        quick_matrix(load_target(params["target"]), list(cases))


@phase_check("phase3")
def phase3_paths(params: dict[str, Any]) -> None:
    """``trace_dir`` (here, unless a cluster of other nodes reads it where they are) and ``nsys_dir``."""
    try:
        spec = parse_cluster(params.get("cluster", ""))
    except ClusterError as exc:
        raise ParamError(str(exc)) from None
    if spec is None or spec.kind == "local":
        _dir(params, "trace_dir", "that holds the traces (*.trace.json.gz)")
    _dir(params, "nsys_dir", "that holds the `nsys stats --format csv` reports")


@phase_check("phase3")
def phase3_capture_at(params: dict[str, Any]) -> None:
    """``capture_at``: a Phase 1 case or search point of this run (``run_id``) or of a named one (``RUN:POINT``)."""
    if params.get("capture_at"):
        resolve_capture_point(str(params["capture_at"]), str(params.get("run_id") or os.environ.get("SERVELAB_RUN_ID", "")))


@phase_check("phase4")
def phase4_runs(params: dict[str, Any]) -> None:
    """``runs``: run ids (under the outputs folder) or run folders, each with its manifest."""
    for r in params.get("runs") or []:
        p = Path(str(r)).expanduser()
        p = p if p.is_absolute() else project_root() / p
        d = p if p.is_dir() else run_dir(str(r))
        if not read_manifest(d):
            raise ParamError(f"runs: {r} is neither a run id with a manifest under {d.parent} nor a run folder "
                             f"(give the id of a measured run or its folder)")


@phase_check("phase5")
def phase5_logs(params: dict[str, Any]) -> None:
    _files(params, "nccl_tests_logs", "an nccl-tests output")
    _files(params, "nccl_info_logs", "an NCCL_DEBUG=INFO log")


@phase_check("phase6")
def phase6_csv(params: dict[str, Any]) -> None:
    _files(params, "ncu_csv", "an `ncu --csv` output")
