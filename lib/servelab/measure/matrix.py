"""Which wave a case of the Phase 1 matrix runs: the M1 injection wave or the plain closed-loop wave.

Phase 1 runs its matrix with it; Phase 2 replays the same cases under the hardware collectors.
"""
from __future__ import annotations

from servelab.measure.case import CaseEnv, CaseResult, CaseSpec, run_case
from servelab.measure.mixed import run_m1_case


def dispatch_case(env: CaseEnv, case: CaseSpec) -> CaseResult:
    """M1 cases need the injection wave; every other case is a plain closed-loop wave."""
    return run_m1_case(env, case) if case.scenario == "M1" else run_case(env, case)
