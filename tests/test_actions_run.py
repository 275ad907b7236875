"""The three evidence → next A/B rows a trace cannot decide, read from the same run's Phase 1, 8 and 2 tables
(``servelab.analyse.trace.actions``): the real tables those phases wrote (``tests/data/run_tables``), each row's
number recomputed here by hand, and the phase to run named where a table is missing."""
from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import polars as pl
import pytest

from servelab.analyse.trace.actions import (DEFAULT_THRESHOLDS, concurrency_row, evidence_actions, kv_row,
                                            rails_row)
from servelab.analyse.trace.analysis import analyse
from servelab.core import run as runlib

TABLES = Path(__file__).parent / "data" / "run_tables"
TH = dict(DEFAULT_THRESHOLDS)


def _run(outputs: Path, name: str, *phases: str) -> Path:
    rdir = runlib.init_run(name, "local-tiny")
    where = {"phase1": ("matrix.csv", "phase1/matrix.csv"), "phase8": ("kv_usage.csv", "phase8/kv_usage.csv"),
             "phase2": ("phase2_questions.csv", "phase2/phase2_questions.csv")}
    for ph in phases:
        src, dst = where[ph]
        (rdir / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TABLES / src, rdir / dst)
        runlib.update_manifest(rdir, phases={ph: {"status": "success", "from_samples": False}})
    return rdir


def test_concurrency_row_from_phase1_decode_points(outputs):
    rdir = _run(outputs, "act-p1", "phase1")
    m = pd.read_csv(TABLES / "matrix.csv")
    d = m[(m["kind"] == "decode") & (m["validity"] == "VALID") & (m["definition"] == m["definition"].iloc[0])]
    tps = d.groupby("concurrency")["output_throughput"].mean()
    best = tps[tps.index > 1].idxmax()
    share = tps[best] / tps[1] / best
    row = concurrency_row(rdir, TH)
    assert row.status == ("triggered" if share >= 0.5 else "not triggered")
    assert row.measured.startswith(f"{share:.2f} of linear") and f"at C={best}" in row.measured
    assert "phase1/matrix.csv" in row.metric
    # the threshold is a parameter: above the measured share nothing triggers
    assert concurrency_row(rdir, {**TH, "concurrency_scaling": share + 0.01}).status == "not triggered"


def test_kv_row_from_phase8_samples(outputs):
    rdir = _run(outputs, "act-p8", "phase8")
    kv = pd.read_csv(TABLES / "kv_usage.csv")
    k = kv[kv["metric"] == "kv_active"]                  # llama.cpp: no KV gauge, the slots being processed
    peak = 100 * k["value"].max()
    row = kv_row(rdir, TH)
    assert row.status == "not triggered" and f"peak {peak:.1f}%" in row.measured and "kv_active" in row.measured
    # the same samples against a threshold below their peak: the fullest point spends its samples there
    low = kv_row(rdir, {**TH, "kv_full_pct": peak / 2, "kv_full_time_pct": 1.0})
    assert low.status == "triggered"


def test_rails_row_from_phase2_answers(outputs):
    rdir = _run(outputs, "act-p2", "phase2")
    row = rails_row(rdir)                                 # this VM has no RDMA or NIC byte counters
    assert row.status.startswith("not evaluable: Phase 2 had no rail counters in any of its 5 case window(s)")
    # a Phase 2 table whose rails question was answered: one case unbalanced triggers the row with its evidence
    q = pd.read_csv(TABLES / "phase2_questions.csv")
    rails = q["question"].str.contains("rails")
    q.loc[rails, "answer"] = "yes"
    first = q[rails].index[0]
    q.loc[first, ["answer", "evidence"]] = ["no", "rdma_tx_gbps mean per rail: n0/mlx5_0 70.00, n0/mlx5_3 0.00 (spread 100%)"]
    q.to_csv(rdir / "phase2" / "phase2_questions.csv", index=False)
    row = rails_row(rdir)
    assert row.status == "triggered" and row.measured.startswith("1 of 5 case(s) unbalanced — hw-P3: rdma_tx_gbps")


def test_missing_phases_say_which_phase_to_run(outputs, h200x2, tmp_path):
    rdir = runlib.init_run("act-none", "local-tiny")
    a = analyse(h200x2 / "traces", cache_dir=tmp_path / "c")
    act = evidence_actions(a, run_dir=rdir)
    assert act.height == 11
    rows = {r["evidence"][:6]: r for r in act.iter_rows(named=True)}
    for start, phase in (("C=1 很慢", "phase1"), ("KV Cac", "phase8"), ("两条 Rai", "phase2")):
        st = rows[start]["status"]
        assert st.startswith("not evaluable") and f"servelab run {phase} --target local-tiny --run-id act-none" in st
    # a phase that read recorded sample data decides nothing about this target
    rdir = _run(outputs, "act-samples", "phase2")
    runlib.update_manifest(rdir, phases={"phase2": {"status": "success", "from_samples": True}})
    assert "read recorded sample data" in rails_row(rdir).status
    # with the tables there, the same analysis fills the rows
    full = _run(outputs, "act-all", "phase1", "phase8", "phase2")
    act = evidence_actions(a, run_dir=full)
    filled = act.filter(pl.col("evidence").str.contains("C=1|KV Cache"))
    assert filled["status"].to_list()[0] in ("triggered", "not triggered") and filled["status"][1] == "not triggered"


@pytest.mark.parametrize("content", ["", "kind,concurrency\n"])
def test_an_empty_or_partial_table_is_not_evaluable_not_an_error(outputs, content):
    rdir = runlib.init_run("act-bad", "local-tiny")
    (rdir / "phase1").mkdir()
    (rdir / "phase1" / "matrix.csv").write_text(content)
    assert concurrency_row(rdir, TH).status.startswith("not evaluable")
