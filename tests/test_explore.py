"""The JupyterLab explorer: run/case/rank/window selectors over the same compute and figure functions."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import SAMPLES
from servelab.cli import main
from servelab.explore import (capture_analysis, case_choices, case_view, explorer, first_valid_case, list_cases,
                              list_runs, one_line, span_ms, timeline_view, trace_folders, trace_view)

ROOT = Path(__file__).resolve().parents[1]


def part(ui, name: str):
    """The explorer's control or note with class ``servelab-<name>`` (as the browser test finds it)."""
    todo = [ui]
    while todo:
        w = todo.pop()
        if f"servelab-{name}" in getattr(w, "_dom_classes", ()):
            return w
        todo.extend(getattr(w, "children", ()))
    raise AssertionError(f"no servelab-{name} in the explorer")


def plotly_of(output) -> dict:
    """The plotly figure an Output widget shows (its display_data)."""
    figs = [o["data"]["application/vnd.plotly.v1+json"] for o in output.outputs
            if "application/vnd.plotly.v1+json" in o["data"]]
    assert len(figs) == 1, output.outputs
    return figs[0]


def note_text(html_widget) -> str:
    import html
    import re
    return html.unescape(re.sub(r"<[^>]+>", "", html_widget.value))


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
    choices = case_choices(rdir)
    assert list(choices["case_id"]) == ["P1", "D1"]                     # the order they ran in
    ui = explorer()
    assert part(ui, "run").value == "ex"
    assert [v for _, v in part(ui, "case").options] == ["P1", "D1"]
    # opened drawn on the first VALID case (or the first, saying it is not a result) and on the first capture
    first, why = first_valid_case(choices)
    assert part(ui, "case").value == first
    note = note_text(part(ui, "case-note"))
    assert note.startswith(why.split(":")[0] if why else f"{first} · phase1 · VALID · "), note
    assert [list(o["data"]) for o in part(ui, "case-out").outputs] == [["text/html", "text/plain"],
                                                                       ["application/vnd.plotly.v1+json", "text/plain"]]
    assert len(plotly_of(part(ui, "case-out"))["data"]) == 2
    trace_dd = part(ui, "capture")
    assert trace_dd.label == "sample: h200x2/traces" and trace_dd.value.endswith("data/samples/h200x2/traces")
    assert [label for label, _ in part(ui, "rank").options] == ["all ranks", "rank 0", "rank 1"]
    assert plotly_of(part(ui, "trace-out"))["data"] and note_text(part(ui, "readout")).startswith("0.0 – 100.0 % of ")
    # every control acts: the other case, the other definition, a rank, a window
    part(ui, "case").value = "D1"
    assert note_text(part(ui, "case-note")).startswith("D1 · phase1 · ") and part(ui, "case-out").outputs
    part(ui, "definition").value = "sglang"
    assert "sglang definition" in note_text(part(ui, "case-note"))
    assert "sglang definition" in plotly_of(part(ui, "case-out"))["layout"]["title"]["text"]
    part(ui, "rank").value = 1
    assert "rank 1 of 2" in note_text(part(ui, "trace-note"))
    part(ui, "window").value = (24.5, 52.0)
    readout = note_text(part(ui, "readout"))
    assert readout.startswith("24.5 – 52.0 % of ") and readout.endswith(" ms"), readout
    assert plotly_of(part(ui, "trace-out"))["layout"]["xaxis"]["range"][0] > 0
    # what cannot be drawn says why, in one line, and clears the figure
    part(ui, "window").value = (30.0, 30.0)
    note = note_text(part(ui, "trace-note"))
    assert note == "could not draw the timeline: ValueError: the window 30.0 – 30.0 % is empty: widen it", note
    assert part(ui, "trace-out").outputs == ()
    assert not (ROOT / "data" / "samples" / "h200x2" / "traces" / ".servelab_cache").exists()


def test_explorer_without_a_run_says_so(tmp_path):
    """No run under the outputs folder: every control is disabled and the note says what to run."""
    ui = explorer(root=tmp_path)
    note = note_text(part(ui, "run-note"))
    assert note == f"no run under {tmp_path}: run a phase first (servelab run phase1 --target local)", note
    for name in ("run", "case", "definition", "capture", "rank", "window"):
        assert part(ui, name).disabled, name
    assert part(ui, "case-out").outputs == () and part(ui, "trace-out").outputs == ()


def test_explorer_skips_a_capture_that_is_gone(tmp_path):
    """A run whose Phase 3 capture folder no longer holds traces (moved or deleted since): the explorer opens on
    the next capture that analyses — the bundled sample — and says which it skipped and why; the run has no
    measured case, and the case half says so."""
    run = tmp_path / "outputs" / "gone"
    (run / "phase3").mkdir(parents=True)
    (tmp_path / "moved").mkdir()
    (run / "manifest.json").write_text(json.dumps({"run_id": "gone", "target": "local-tiny",
                                                    "created": "2026-12-01T00:00:00+00:00", "phases": {}}))
    (run / "phase3" / "trace_analysis.json").write_text(json.dumps({"trace_dir": str(tmp_path / "moved")}))
    ui = explorer(root=tmp_path / "outputs")
    assert note_text(part(ui, "run-note")) == "gone: 0 measured cases (0 VALID), 2 captures"
    assert note_text(part(ui, "case-note")).startswith("this run has no measured case")
    assert part(ui, "case").disabled and part(ui, "case-out").outputs == ()
    assert part(ui, "capture").label == "sample: h200x2/traces" and plotly_of(part(ui, "trace-out"))["data"]
    note = note_text(part(ui, "trace-note"))
    assert note == (f"sample: h200x2/traces: the first capture that analyses; skipped Phase 3's capture — "
                    f"{tmp_path / 'moved'} (TraceFormatError: {tmp_path / 'moved'}: no *.json / *.json.gz trace "
                    f"files in this folder)"), note


def test_first_valid_case_picks_in_run_order():
    """The explorer opens on the first VALID case in the order the cases ran, else on the first, saying why."""
    import pandas as pd
    rows = [("P1", "phase1", "INVALID", "client fell behind"), ("D1", "phase1", "VALID", ""),
            ("hw-D1", "phase2", "VALID", "")]
    choices = pd.DataFrame([dict(zip(["case_id", "phase", "verdict", "reason"], r)) for r in rows])
    assert first_valid_case(choices) == ("D1", "")
    none = choices.assign(verdict="INVALID", reason="too few requests")
    assert first_valid_case(none) == ("P1", "no VALID case in this run: showing P1 (INVALID: too few requests), "
                                            "not a result")
    assert first_valid_case(choices.iloc[0:0])[0] is None


def test_one_line_errors():
    assert one_line(ValueError("first line\nsecond line")) == "ValueError: first line"
    assert one_line(KeyError()) == "KeyError"
    assert len(one_line(RuntimeError("x" * 1000))) == 300


def test_timeline_window_and_rank_of_the_sample(tmp_path, monkeypatch):
    """The timeline over the recorded sample: a window other than 0–100 % draws that range (the x values are numpy
    arrays: the old code's ``tr.x or []`` raised there), one rank narrows the span, what cannot be drawn raises a
    one-line ValueError saying what to pick; parsed traces are cached in SERVELAB_CACHE, not beside the sample."""
    import pytest as _pytest
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "cache"))
    sample = ROOT / "data" / "samples" / "h200x2" / "traces"
    listing = sorted(p.name for p in sample.iterdir())
    a = capture_analysis(sample)
    assert sorted(p.name for p in sample.iterdir()) == listing                # nothing written beside the traces
    assert list((tmp_path / "cache" / "traces").glob("*.parquet"))
    span = span_ms(a)
    fig, readout = timeline_view(a, None, (24.5, 52.0))
    t0, t1 = span * 0.245, span * 0.52
    assert readout == f"24.5 – 52.0 % of {span:.2f} ms: {t0:.2f} – {t1:.2f} ms"
    assert list(fig.layout.xaxis.range) == _pytest.approx([t0, t1])
    assert fig.data and all(len(tr.x) for tr in fig.data)
    full, readout = timeline_view(a)
    assert readout == f"0.0 – 100.0 % of {span:.2f} ms: 0.00 – {span:.2f} ms" and len(full.data) >= len(fig.data)
    one, readout = timeline_view(a, 1, (0.0, 100.0))
    assert {t for t in one.layout.yaxis.ticktext} and all(t.startswith("rank 1 ·") for t in one.layout.yaxis.ticktext)
    assert float(readout.split(" of ")[1].split(" ms")[0]) <= span
    with _pytest.raises(ValueError, match="is empty: widen it"):
        timeline_view(a, None, (40.0, 40.0))
    with _pytest.raises(ValueError, match="rank 7 is not in this capture: pick one of 0, 1 or all"):
        timeline_view(a, 7)


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


def test_each_captured_scenario_is_a_capture_to_switch_to(tmp_path):
    """A run's profiled cases are the explorer's captures, each named by its scenario (here the real vLLM
    mixed-treatment case of ``data/samples/vllm-cpu-mixed``, placed in a run as Phase 3 writes it)."""
    from servelab.explore import capture_folders
    rdir = tmp_path / "r"
    shutil.copytree(SAMPLES / "vllm-cpu-mixed", rdir / "cases" / "M1-profile--profile-mixed_treatment",
                    ignore=shutil.ignore_patterns(".servelab_cache"))
    found = dict(capture_folders(rdir))
    case = (rdir / "cases" / "M1-profile--profile-mixed_treatment" / "profiles").resolve()
    assert found[case] == "profiled case of this run (scenario mixed_treatment)"
