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


@pytest.mark.slow
def test_explore_run_notebook_over_a_run_made_here(outputs, llama_server_binary, tmp_path):
    """notebooks/explore_run.ipynb executed with papermill on a run made here (Phase 1's D1 on the tiny engine,
    Phase 3 on the recorded sample): the explorer cell and the static tables — phases, cases, captures, ledger —
    all produced, in the HTML export too; the run itself is left untouched; it is not a phase."""
    import papermill as pm
    from nbconvert import HTMLExporter

    from servelab.cli import kernel_manager_class
    from servelab.core.notebooks import available_phases
    from servelab.core.params import ParamError
    from servelab.core.notebooks import notebook_path
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "exnb", "-p", 'cases=["D1"]',
                 "-p", "search=false", "--no-render"]) == 0
    assert main(["run", "phase3", "--target", "local-tiny", "--run-id", "exnb", "--no-render"]) == 0
    rdir = outputs / "exnb"
    before = {p: p.stat().st_mtime_ns for p in rdir.rglob("*") if p.is_file()}
    out = tmp_path / "explore.ipynb"
    pm.execute_notebook(str(ROOT / "notebooks" / "explore_run.ipynb"), str(out), parameters={"run_id": "exnb"},
                        kernel_name="python3", cwd=str(ROOT), progress_bar=False,
                        kernel_manager_class=kernel_manager_class())
    assert {p: p.stat().st_mtime_ns for p in rdir.rglob("*") if p.is_file()} == before
    import nbformat
    nb = nbformat.read(out, as_version=4)
    html_of = {c.id: "".join(o.get("data", {}).get("text/html", "") for o in c.outputs) for c in nb.cells
               if c.cell_type == "code"}
    widget = next(c for c in nb.cells if c.id == "x04").outputs[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" in widget                                # the explorer
    assert "<td>phase1</td><td>success</td>" in html_of["x06"] and "<td>phase3</td>" in html_of["x06"]
    assert "<td>D1</td><td>phase1</td><td>decode</td>" in html_of["x08"] and "VALID" in html_of["x08"]
    assert "analysed by Phase 3" in html_of["x10"] and "h200x2/traces" in html_of["x10"]
    assert "phase3/trace_actions.csv" in html_of["x12"] and "recorded sample data" in html_of["x12"]
    page, _ = HTMLExporter().from_notebook_node(nb)
    for text in ("Phases of this run", "<td>D1</td>", "analysed by Phase 3", "phase3/trace_actions.csv"):
        assert text in page
    assert "explore_run" not in available_phases()
    with pytest.raises(ParamError):
        notebook_path("explore_run")
