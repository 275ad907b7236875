"""The JupyterLab explorer: run/case/rank/window selectors over the same compute and figure functions."""
from __future__ import annotations

from pathlib import Path

import pytest

from servelab.cli import main
from servelab.explore import case_view, explorer, list_cases, list_runs, trace_folders, trace_view

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_explorer_over_a_real_phase1_run(outputs, llama_server_binary):
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "ex", "-p", 'cases=["P1","D1"]',
                 "-p", "search=false", "--no-render"]) == 0
    runs = list_runs()
    assert list(runs["run_id"]) == ["ex"] and "phase1:success" in runs.loc[0, "phases"]
    rdir = outputs / "ex"
    assert list_cases(rdir) == ["D1", "P1"]
    table, fig = case_view(rdir, "D1")
    assert set(table["definition"]) == {"vllm", "sglang"} and table["p95"].notna().all()
    assert len(fig.data) == 2 and len(fig.data[0].x) >= 1
    ui = explorer()
    run_dd, case_dd = ui.children[1], ui.children[2].children[0]
    assert run_dd.value == "ex" and list(case_dd.options) == ["D1", "P1"]


def test_trace_view_one_rank_of_the_sample(outputs):
    folders = trace_folders(outputs / "none")
    assert folders and folders[-1].name == "traces"
    fig_all = trace_view(folders[-1])
    fig_one = trace_view(folders[-1], rank=1)
    names_all = {t.name for t in fig_all.data}
    assert fig_one.data and len(fig_one.data) <= len(fig_all.data)
    assert fig_all.layout.title.text != "GPU timeline: no GPU ops in this capture" and names_all
