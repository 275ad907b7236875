"""Phases 4 and 6 end to end for the local target through the CLI (papermill + rendering); assertions on the files
the library wrote: feasibility and comm tables, commands recorded as planned (never executed), the measured
comparison and its confound-free A/B, the ncu import from the shipped H200 captures with the sample flag."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from servelab.cli import main
from servelab.core.run import init_run, read_commands, read_manifest, update_manifest

sys.path.insert(0, str(Path(__file__).parent))
from casefiles import write_cases  # noqa: E402

pytestmark = pytest.mark.slow


def _measured(run_id: str, settings: dict, tps: list[float]) -> None:
    rdir = init_run(run_id, "example-2node")
    update_manifest(rdir, launch={"settings": settings, "env": {}, "plans": []})
    write_cases(rdir, [{"case_id": "D1", "repeat": i, "output_tps": v, "p95_ttft_ms": 100.0, "p95_tpot_ms": 20.0,
                        "p95_e2e_ms": 3000.0, "valid": True} for i, v in enumerate(tps)])


def test_phase4_local_with_measured_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    _measured("meas-tp16", {"tp_size": 16}, [100, 102, 98])
    _measured("meas-pp2", {"tp_size": 8, "pp_size": 2}, [120, 121, 119])
    rc = main(["run", "phase4", "--target", "local", "--run-id", "p4", "-p", "concurrency=8",
               "-p", 'runs=["meas-tp16", "meas-pp2"]'])
    assert rc == 0
    rdir = tmp_path / "p4"
    feas = pd.read_csv(rdir / "phase4" / "feasibility.csv").set_index("layout")
    assert list(feas.index) == ["TP16", "TP8+PP2", "TP16+DP2+EP16"]
    assert feas.loc["TP8+PP2", "verdict"] == "fits"
    every = read_commands(rdir, "phase4")
    # the phase's own execution (papermill, executed) and the line that repeats it (reproduce), then its plans
    assert [c.label for c in every if c.label != "planned"] == ["executed", "reproduce"]
    cmds = [c for c in every if c.label == "planned"]
    assert len(cmds) == 6
    assert any("--pp-size" in c.argv for c in cmds)
    verdicts = pd.read_csv(rdir / "phase4" / "verdicts.csv").set_index("layout")
    assert verdicts.loc["TP8+PP2", "verdict"] == "recommended"
    phase = json.loads((rdir / "phase4" / "phase.json").read_text())
    assert phase["status"] == "success" and phase["headline"]["measured runs"] == 2
    html = (rdir / "phase4" / "report.html").read_text()
    assert "planned" in html and "Memory per GPU by layout" in html
    # the cluster is planned; the run's own target and the model it serves are named as they are
    assert "this run&#x27;s target local serves" in html or "this run's target local serves" in html


def test_phase6_local_from_samples(tmp_path, monkeypatch, samples):
    if not (samples / "ncu" / "h200_toy_layer_raw.csv").is_file():
        pytest.skip("shipped ncu capture absent")
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    assert main(["run", "phase6", "--target", "local", "--run-id", "p6", "-p", "top_n=2"]) == 0
    rdir = tmp_path / "p6"
    phase = json.loads((rdir / "phase6" / "phase.json").read_text())
    assert phase["from_samples"] is True
    # the page says first what it is not about: recorded samples, not this target's kernels
    assert phase["findings"][0].startswith("Not") and "recorded sample data" in phase["findings"][0]
    top = pd.read_csv(rdir / "phase6" / "top_kernels.csv")
    assert set(top["window"]) == {"decode", "prefill"} and top.groupby("window").size().max() == 2
    every = read_commands(rdir, "phase6")
    assert [c.label for c in every if c.label != "planned"] == ["executed", "reproduce"]
    cmds = [c for c in every if c.label == "planned"]
    assert len(cmds) == 4 and all(c.argv[0] == "ncu" for c in cmds)
    # the sample's H200 kernels never wrap this target's engine: the reproduction is a fill-in value on its own line
    assert all(c.argv[-1] == "REPRO_COMMAND" and "llama-bench" not in c.argv for c in cmds)
    assert "fill in: <code>REPRO_COMMAND</code>" in (rdir / "phase6" / "report.html").read_text()
    roof = pd.read_csv(rdir / "phase6" / "roofline.csv")
    assert (roof["bound"] == "compute").any() and (roof["bound"] == "memory").any()
    assert "Recorded sample data" in (rdir / "phase6" / "report.html").read_text()
    assert read_manifest(rdir)["phases"]["phase6"]["status"] == "success"
