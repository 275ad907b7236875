"""Parameters that name a folder, file, case or run are checked before anything happens: ``servelab run`` says
what is wrong in one line and exits 2 with no run folder made (the phase checks of ``phases/param_checks.py``,
through the generic hook ``core.params.phase_check``); the notebook's ``open_phase`` refuses the same inputs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.core.params import PHASE_CHECKS, ParamError, phase_check, run_phase_checks
from servelab.phases import phase3_timeline
from servelab.phases.context import open_phase
from cli_here import run_cli

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    ("phase3", ["-p", "trace_dir=/nonexistent/traces"], "trace_dir: /nonexistent/traces does not exist"),
    ("phase3", ["-p", "nsys_dir=/nonexistent/nsys"], "nsys_dir: /nonexistent/nsys does not exist"),
    ("phase3", ["-p", "trace_dir=README.md"], "trace_dir: README.md is not a folder"),
    ("phase1", ["-p", "cases=[D9]"], "unknown case 'D9'"),
    ("phase1", ["-p", "cases=[1]"], "cases: 1 is not a case id"),
    ("phase3", ["-p", "capture_at=no-such-run:D2_c4"], "capture_at=no-such-run:D2_c4"),
    ("phase4", ["-p", "runs=[no-such-run]"], "runs: no-such-run is neither a run id"),
    ("phase5", ["-p", "nccl_tests_logs=[/nonexistent.log]"], "nccl_tests_logs: /nonexistent.log does not exist"),
    ("phase6", ["-p", "ncu_csv=[/nonexistent.csv]"], "ncu_csv: /nonexistent.csv does not exist"),
]


@pytest.mark.parametrize("phase,args,message", BAD, ids=[f"{p}-{a[1].split('=')[0]}" for p, a, _ in BAD])
def test_a_missing_path_case_or_run_fails_before_any_run_folder(phase, args, message, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli("run", phase, "--target", "local-tiny", "--run-id", "bad", *args, tmp_path=tmp_path,
                             monkeypatch=monkeypatch, capsys=capsys)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "outputs" / "bad").exists()


def test_the_real_command_exits_2_within_seconds_without_a_kernel(tmp_path):
    """The process itself: exit 2, one line, no run folder, and no kernel started (it returns long before the
    ~8 s a kernel takes; the run folder would hold kernel.log)."""
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs")}
    p = subprocess.run([sys.executable, "-m", "servelab.cli", "run", "phase3", "--run-id", "t",
                        "-p", "trace_dir=/nonexistent/traces"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == \
        "servelab: error: trace_dir: /nonexistent/traces does not exist (give the folder that holds the traces " \
        "(*.trace.json.gz))", p.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_trace_dir_read_by_the_nodes_is_not_checked_here(tmp_path, monkeypatch, capsys):
    """With a cluster of other nodes (``cluster=nodes``) ``trace_dir`` is the folder as each node sees it: not
    refused for being absent here. The valid local sample is accepted too (checked, nothing run)."""
    from servelab.cli import validate
    validate("phase3", "local-tiny", {"trace_dir": "/only/on/the/nodes", "cluster": "nodes:1"})
    validate("phase3", "local-tiny", {"trace_dir": "data/samples/h200x2/traces"})
    with pytest.raises(ParamError, match="trace_dir: /only/on/the/nodes does not exist"):
        validate("phase3", "local-tiny", {"trace_dir": "/only/on/the/nodes", "cluster": "local:1"})


def test_the_notebook_path_refuses_the_same_before_its_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path / "outputs"))
    with pytest.raises(ParamError, match="trace_dir: /nonexistent does not exist"):
        open_phase(phase3_timeline.Params, {"trace_dir": "/nonexistent", "run_id": "nb", "target": "local-tiny"})
    assert not (tmp_path / "outputs" / "nb").exists()


def test_a_registered_check_runs_for_its_phase_only(monkeypatch):
    """The hook other phases plug into: a check registered for a phase runs on its parameters, not on others'."""
    monkeypatch.setattr("servelab.core.params.PHASE_CHECKS", {k: list(v) for k, v in PHASE_CHECKS.items()})
    seen = []

    @phase_check("phase7")
    def capture_at(params):
        seen.append(params.get("x"))
        if params.get("x") == "bad":
            raise ParamError("x: bad is not a capture point")
    run_phase_checks("phase7", {"x": "ok"})
    run_phase_checks("phase8_cache", {"x": "bad"})
    with pytest.raises(ParamError, match="not a capture point"):
        run_phase_checks("phase7_interference", {"x": "bad"})
    assert seen == ["ok", "bad"]
