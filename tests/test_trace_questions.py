"""The ten questions, the evidence → action table, the figures and the files the phase writes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from contexts import phase_ctx  # noqa: E402
from servelab.analyse.trace import figures as F
from servelab.phases import phase3_timeline as phase3
from servelab.analyse.trace.actions import evidence_actions
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.questions import ten_questions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def h200(h200x2: Path, tmp_path_factory: pytest.TempPathFactory):
    return analyse(h200x2 / "traces", cache_dir=tmp_path_factory.mktemp("c"))


def _q(df: pl.DataFrame, qid: str) -> dict:
    return df.filter(pl.col("id") == qid).row(0, named=True)


def test_ten_questions_on_h200(h200):
    q = ten_questions(h200)
    assert q["id"].to_list() == [f"Q{i}" for i in range(1, 11)]
    assert all(q["source"].str.contains("20261129203606-TP-0.trace.json.gz"))
    q1 = _q(q, "Q1")
    assert q1["answerable"] and "prefill: ncclDevKernel_AllReduce" in q1["answer"] and "decode:" in q1["answer"]
    q2 = _q(q, "Q2")
    prefill_exposed = h200.summary.filter(pl.col("kind") == "prefill")["exposed_comm_ms"].sum()
    assert f"{prefill_exposed:,.2f} ms exposed" in q2["answer"]
    assert "one stream" in _q(q, "Q3")["evidence"] or "single stream" in _q(q, "Q3")["evidence"]
    assert _q(q, "Q5")["answer"].startswith("partly")              # eager decode steps are not graphed
    assert _q(q, "Q6")["answerable"] and _q(q, "Q7")["answer"] == "no fixed slow rank"
    for qid, why in (("Q8", "no MoE kernels"), ("Q9", "no NSA/DSA indexer kernels")):
        row = _q(q, qid)
        assert not row["answerable"] and row["answer"] == "not answerable from this capture"
        assert why in row["evidence"]
    q10 = _q(q, "Q10")
    assert q10["answerable"] and "mixed_prefill_chunk_8192" in q10["answer"] and "one stream" in q10["answer"]


def test_single_rank_capture_cannot_answer_cross_rank_questions(thirdparty: Path, tmp_path: Path):
    a = analyse(thirdparty / "tracelens/sglang_decode", cache_dir=tmp_path)
    q = ten_questions(a)
    for qid in ("Q6", "Q7"):
        row = _q(q, qid)
        assert not row["answerable"] and "only one rank" in row["evidence"]
    assert _q(q, "Q5")["answer"].startswith("yes")                  # the one decode step is a graph replay
    assert not _q(q, "Q10")["answerable"]                            # no prefill in this cut


def test_evidence_actions_on_h200(h200):
    act = evidence_actions(h200)
    assert act.height == 11                                          # the method table's rows, one per evidence
    st = dict(zip(act["evidence"].str.slice(0, 12).to_list(), act["status"].to_list()))
    by_start = {k[:6]: v for k, v in st.items()}
    assert by_start["Decode"] == "not triggered"                    # 9 % exposed comm < 15 %
    assert by_start["注入长 Pr"] == "triggered"                      # decode interval ×34 after the prefill chunk
    assert by_start["GPU 利用"] in ("triggered", "not triggered")
    assert act.filter(pl.col("status").str.starts_with("not evaluable")).height >= 4
    # thresholds are parameters: lowering the decode comm threshold triggers the TP row
    act2 = evidence_actions(h200, thresholds={"decode_exposed_comm_pct": 5})
    assert act2.filter(pl.col("evidence").str.starts_with("Decode"))["status"][0] == "triggered"


def test_figures(h200):
    fig = F.timeline(h200)
    names = {t.name for t in fig.data}
    assert {"gemm", "communication", "attention"} <= names
    assert len(fig.layout.yaxis.ticktext) == 2
    n_points = sum(len(t.x) for t in fig.data)
    assert n_points <= 3 * 600 * 2                                  # binned: ≤ bins × rows segments
    zoom = F.timeline(h200, t0_ms=128, t1_ms=130)
    assert "every op drawn" in zoom.layout.title.text
    assert len(F.breakdown_bar(h200.breakdown).data) >= 5
    assert len(F.exposed_comm_bar(h200.window_metrics).data) == 3
    assert {t.name for t in F.gaps_bar(h200.gap_summary).data} <= {"host_bound", "other", "unknown"}


def test_phase3_writes_tables(h200x2: Path, tmp_path: Path):
    ctx = phase_ctx(tmp_path / "run", "phase3")
    p = phase3.run_analysis(ctx, str(h200x2 / "traces"))
    q = json.loads((ctx.phase_dir / "trace_questions.json").read_text())
    assert [r["id"] for r in q] == [f"Q{i}" for i in range(1, 11)]
    summary = pl.read_csv(ctx.phase_dir / "trace_summary.csv")
    assert set(summary["kind"].to_list()) == {"prefill", "decode", "mixed"}
    for name in ("trace_top_kernels.csv", "trace_gap_summary.csv", "trace_nccl_forensics.csv", "trace_actions.csv",
                 "trace_alignment.csv", "trace_step_skew.csv", "trace_overlap.csv", "trace_graph_coverage.csv"):
        assert (ctx.phase_dir / name).stat().st_size > 0, name
    meta = json.loads((ctx.phase_dir / "trace_analysis.json").read_text())
    assert meta["ranks"] == 2 and meta["alignment"]["ok"] is True
    h = phase3.headline(p)
    assert h["questions_answered"] == 8 and 0 < h["decode_exposed_comm_pct"] < 15


def test_phase3_sample_mode_uses_data_samples(samples: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if not (samples / "h200x2" / "traces").is_dir():
        pytest.skip("data/samples/h200x2/traces is absent")
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "cache"))
    ctx = phase_ctx(tmp_path / "run", "phase3")
    p = phase3.run_analysis(ctx, "")
    assert ctx.from_samples and len(p.analysis.rops) == 2
    assert not (samples / "h200x2" / "traces" / ".servelab_cache").exists()   # no cache inside the repo


@pytest.mark.slow
def test_phase3_notebook_runs(outputs: Path, tmp_path: Path):
    """Execute the notebook on the bundled sample with papermill and read the files it wrote."""
    if not (ROOT / "params" / "targets" / "local.yaml").exists():
        pytest.skip("params/targets/local.yaml is absent")
    papermill = Path(sys.executable).parent / "papermill"
    out_nb = tmp_path / "p3.ipynb"
    env = {**os.environ, "SERVELAB_OUTPUTS": str(outputs), "SERVELAB_CACHE": str(tmp_path / "cache")}
    subprocess.run([str(papermill), str(ROOT / "notebooks" / "phase3_timeline.ipynb"), str(out_nb), "-p", "run_id",
                    "nbtest", "--cwd", str(ROOT)], check=True, env=env, capture_output=True, timeout=600)
    pdir = outputs / "nbtest" / "phase3"
    phase = json.loads((pdir / "phase.json").read_text())
    assert phase["status"] == "success" and phase["from_samples"] is True
    assert phase["headline"]["ranks"] == 2
    q = pl.read_csv(pdir / "trace_questions.csv")
    assert q.height == 10
    nb = json.loads(out_nb.read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    assert any("application/vnd.plotly.v1+json" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_cpu_only_capture_is_read_from_its_cpu_work(h200x2: Path, tmp_path: Path):
    """A trace without any GPU op (the GPU events of a real rank removed) is read as an engine on CPU: its step
    threads' torch ops are the device work (``ops.cpu_device_ops``), the GPU-only question (CUDA graphs) says it does
    not apply, the others answer from the CPU ops, and the figures still build."""
    import gzip
    doc = json.loads(gzip.decompress((h200x2 / "traces/20261129203606-TP-0.trace.json.gz")
                                     .read_bytes()))
    doc["traceEvents"] = [e for e in doc["traceEvents"]
                          if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")]
    d = tmp_path / "cpu"
    d.mkdir()
    (d / "rank0.1790000000000000000.pt.trace.json").write_text(json.dumps(doc))
    a = analyse(d, cache=False)
    assert a.rops[0].device == "cpu" and a.rops[0].ops.height > 0
    assert set(a.rops[0].ops["cat"].cast(pl.String)) <= {"cpu_op", "user_annotation"}
    q = {r["id"]: r for r in ten_questions(a).iter_rows(named=True)}
    assert q["Q1"]["answerable"] and not q["Q5"]["answerable"] and "no CUDA graphs" in q["Q5"]["evidence"]
    assert F.timeline(a).layout.title.text


def test_phase3_question_and_action_tables_render_names_as_text(h200x2: Path, tmp_path: Path):
    """A trace file name and a kernel name are data: through the questions / actions tables and the page's table
    display (the one ``open_phase`` registers) markup in them reaches the page escaped, never as a tag."""
    import gzip

    from servelab.report.tables import table_html
    payload = "<img src=x onerror=alert(1)>"
    traces = tmp_path / "traces"
    traces.mkdir()
    for src in sorted((h200x2 / "traces").glob("*.trace.json.gz")):
        raw = gzip.decompress(src.read_bytes()).replace(b'"ncclDevKernel_AllReduce_Sum_bf16_RING_LL',
                                                        b'"' + payload.encode() + b"ncclDevKernel_AllReduce_Sum_bf16_RING_LL")
        name = src.name.replace("-TP-", f"{payload}-TP-")
        (traces / name).write_bytes(gzip.compress(raw, compresslevel=1))
    ctx = phase_ctx(tmp_path / "run", "phase3")
    p = phase3.run_analysis(ctx, str(traces))
    q = phase3.questions_table(p)
    assert q.map(lambda v: payload in str(v)).to_numpy().sum() >= 2        # the file name and the kernel name
    p.actions = pl.concat([p.actions, p.actions.head(1).with_columns(pl.lit(payload).alias("evidence"),
                                                                     pl.lit(f"rank0{payload}").alias("measured"))])
    for table in (q, phase3.actions_table(p)):
        page = table_html(table)
        assert "&lt;img src=x onerror=alert(1)&gt;" in page
        assert "<img" not in page
    from servelab.report.findings import findings_html
    box = findings_html({"findings": phase3.findings(p, from_samples=False)})   # Q1 names the kernel
    assert "&lt;img src=x" in box and "<img" not in box
