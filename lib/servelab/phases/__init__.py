"""The phases of an investigation: one module per phase, named as its notebook (``phase1_perf_map``), each with
its parameters' definition (``Params``) and its one entry ``run(ctx) -> result``; and the phase context."""
from __future__ import annotations

import importlib

from servelab.core.notebooks import NOTEBOOKS, notebook_path
from servelab.core.params import PhaseParams


def definition(phase: str) -> type[PhaseParams]:
    """The ``Params`` of a phase (``phase4`` or ``phase4_topology``): its parameters, defined once. An unknown phase
    is a one-line :class:`~servelab.core.params.ParamError`."""
    notebook_path(phase)                      # the error for an unknown phase or a missing notebook
    module = importlib.import_module(f"{__name__}.{NOTEBOOKS[phase.split('_')[0]]}")
    return module.Params
