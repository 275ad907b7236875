"""Evidence for the hypotheses ledger from every phase that holds some (H1–H7): each rule over the phase's own
tables, and a run whose index lists that evidence with links to the tables and page sections it rests on."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from contexts import phase_ctx  # noqa: E402
from servelab.core import run as runlib
from servelab.phases.context import PhaseContext


def ctx_for(rdir: Path, phase: str) -> PhaseContext:
    return phase_ctx(rdir, phase)


def test_phase1_h4_from_m1_windows_and_h6_from_the_search_stop():
    from servelab.phases.phase1_perf_map import h4_evidence, h6_evidence

    def m1(during: float, n: int = 40) -> SimpleNamespace:
        w = pd.DataFrame([("control", "during", 40, 10.0), ("treatment", "before", 40, 11.0),
                          ("treatment", "during", n, during)], columns=["run", "window", "n", "p95_itl_ms"])
        return SimpleNamespace(m1={"windows": w}, matrix=SimpleNamespace(results=[]), search=None)
    v, text, nums = h4_evidence(m1(30.0))
    assert v == "supported" and nums["ratio"] == pytest.approx(30 / 11, abs=1e-3) and "threshold 1.2×" in text
    assert h4_evidence(m1(12.0))[0] == "refuted"
    assert h4_evidence(m1(30.0, n=2))[0] == "inconclusive"
    assert h4_evidence(m1(30.0, n=19))[0] == "inconclusive"          # a P95 needs 20 gaps
    assert "P95 (n=40)" in h4_evidence(m1(30.0))[1]
    assert h4_evidence(SimpleNamespace(m1=None))[0] == "inconclusive"

    def search(stop: str, statuses: tuple[str, ...] = ("success", "success")) -> SimpleNamespace:
        pts = [SimpleNamespace(concurrency=c, status=s) for c, s in zip((1, 4, 8), statuses)]
        return SimpleNamespace(search=SimpleNamespace(stop_reason=stop, stop_detail="d", points=pts,
                                                      max_successful_concurrency=4, max_tps_concurrency=4))
    assert h6_evidence(search("OOM"))[0] == "supported"
    assert h6_evidence(search("MAX_CONCURRENCY_REACHED"))[0] == "refuted"
    assert h6_evidence(search("MAX_CONCURRENCY_REACHED", ("success", "failed")))[0] == "inconclusive"
    assert h6_evidence(search("TPS_SATURATED"))[0] == "inconclusive"
    assert h6_evidence(SimpleNamespace(search=None))[0] == "inconclusive"


def test_phase2_h5_needs_a_gpu_and_a_hot_core_answer():
    from servelab.phases.phase2_hardware import HOT_CORE_QUESTION, h5_evidence
    gpu = SimpleNamespace(cases=[SimpleNamespace(samples=pd.DataFrame({"metric": ["util_gpu_pct"]}))])
    cpu_only = SimpleNamespace(cases=[SimpleNamespace(samples=pd.DataFrame({"metric": ["cpu_busy_pct"]}))])

    def q(*answers: str) -> pd.DataFrame:
        return pd.DataFrame([{"case": f"c{i}", "question": HOT_CORE_QUESTION, "answer": a, "evidence": "e"}
                             for i, a in enumerate(answers)])
    assert h5_evidence(gpu, q("no", "yes"))[0] == "supported"
    assert h5_evidence(gpu, q("no", "no"))[0] == "refuted"
    assert h5_evidence(gpu, q("-"))[0] == "inconclusive"
    v, text, _ = h5_evidence(cpu_only, q("yes"))
    assert v == "inconclusive" and "no GPU" in text


def test_phase4_h7_from_the_measured_verdicts():
    from servelab.phases.phase4_topology import h7_evidence
    feas = pd.DataFrame({"layout": ["TP16", "TP8+PP2"], "verdict": ["fits", "fits"]})

    def res(*verdicts: str) -> SimpleNamespace:
        v = pd.DataFrame([{"layout": "TP16", "verdict": "baseline", "evidence": "ref"}] +
                         [{"layout": f"L{i}", "verdict": x, "evidence": "ev"} for i, x in enumerate(verdicts)])
        return SimpleNamespace(feasibility=feas, verdicts=v if verdicts else pd.DataFrame())
    assert h7_evidence(res("not recommended", "recommended"))[0] == "supported"
    assert h7_evidence(res("not recommended", "not recommended"))[0] == "refuted"
    assert h7_evidence(res("no evidence"))[0] == "inconclusive"
    v, text, _ = h7_evidence(res())
    assert v == "inconclusive" and text.startswith("model only")


def test_phase5_h1_needs_cross_node_curves_and_a_decode_step(outputs):
    from servelab.phases.phase5_comm import Phase5Data, record_h1
    rdir = runlib.init_run("h1", "local-tiny")
    ctx = ctx_for(rdir, "phase5")
    msgs = pd.DataFrame({"scenario": ["decode C=32", "prefill 4096 tok"], "collective": ["all_reduce"] * 2,
                         "step_time_us": [300.0, 5000.0]})
    one = Phase5Data([], pd.DataFrame(), pd.DataFrame(), SimpleNamespace(nnodes=1),
                     pd.DataFrame({"net_connections": [0]}), pd.DataFrame())
    two = Phase5Data([], pd.DataFrame(), pd.DataFrame(), SimpleNamespace(nnodes=2),
                     pd.DataFrame({"net_connections": [8]}), pd.DataFrame())
    assert "one node" in record_h1(ctx, one, msgs).loc[0, "summary"]
    assert "no decode step time" in record_h1(ctx, two, msgs).loc[0, "summary"]
    (rdir / "phase3").mkdir()
    pd.DataFrame({"rank": [0, 1], "kind": ["decode"] * 2, "median_step_ms": [1.5, 1.5]}).to_csv(
        rdir / "phase3" / "trace_summary.csv", index=False)
    runlib.update_manifest(rdir, phases={"phase3": {"status": "success", "from_samples": False}})
    row = record_h1(ctx, two, msgs).iloc[0]          # 300 µs of a 1.5 ms step: 20 %
    assert row["verdict"] == "supported" and "20.0% of the 1.50 ms" in row["summary"]
    assert "phase3/trace_summary.csv" in row["tables"]
    runlib.update_manifest(rdir, phases={"phase3": {"status": "success", "from_samples": True}})
    row = record_h1(ctx, two, msgs).iloc[0]          # the step came from a recorded sample
    assert row["verdict"] == "inconclusive" and row["from_samples"]


def test_phase6_h2_h3_from_suspect_share_and_roofline():
    from servelab.phases.phase6_kernels import Phase6Result, kernel_evidence
    ranked = pd.DataFrame({"window": ["decode"] * 3, "function": ["fused_moe_kernel", "nvjet_x", "indexer_k"],
                           "suspect": ["MoE grouped GEMM", "dense GEMM", "NSA indexer / top-k"],
                           "share_pct": [40.0, 55.0, 5.0]})

    def res(pct: float | None) -> Phase6Result:
        roof = pd.DataFrame({"function": ["fused_moe_kernel"], "pct_of_roof": [pct]}) if pct is not None \
            else pd.DataFrame()
        return Phase6Result(source="t.csv", ranked=ranked, top=ranked, commands=pd.DataFrame(), roof=roof)
    assert kernel_evidence(res(20.0), "H3")[0] == "supported"
    assert kernel_evidence(res(80.0), "H3")[0] == "refuted"
    assert kernel_evidence(res(None), "H3")[0] == "inconclusive"
    v, text, _ = kernel_evidence(res(20.0), "H2")           # indexer at 5 % of the window: too small to matter
    assert v == "refuted" and "5.0%" in text
    none = Phase6Result(source="t.csv", ranked=ranked[ranked["suspect"] == "dense GEMM"], top=ranked,
                        commands=pd.DataFrame())
    assert kernel_evidence(none, "H2")[0] == "inconclusive"


def _broken_links(rdir: Path, page: str) -> list[str]:
    """Every href of a run index that does not name an existing file (and, with #anchor, an existing id)."""
    broken = []
    for h in re.findall(r'href="([^"]+)"', page):
        path, _, anchor = html.unescape(h).partition("#")
        if path.startswith("data:"):
            continue
        f = (rdir / path).resolve()
        if path and not f.is_file():
            broken.append(h)
            continue
        text = f.read_text(errors="replace") if path else page       # "#x": an anchor of the index itself
        if anchor and f'id="{anchor}"' not in text and f"id='{anchor}'" not in text:
            broken.append(h)
    return broken


@pytest.mark.slow
def test_phases_record_evidence_the_index_links(tiny_run):
    """Phases 3–6 on local-tiny (no engine: they read data/samples or model the cluster; the session's whole run
    ``tiny_run``): the index lists evidence for H1, H2, H3, H4, H5 and H7 from them — before this only Phases 7 and
    8 recorded any — each linked to its page section and its tables, every link resolving; sample evidence is
    badged and never supported."""
    from servelab.report.ledger import read_evidence
    rdir = tiny_run
    every = read_evidence(rdir)
    evs = [e for e in every if e.phase in ("phase3", "phase4", "phase5", "phase6")]
    assert {e.hypothesis for e in evs} == {"H1", "H2", "H3", "H4", "H5", "H7"}
    assert {e.phase for e in evs} == {"phase3", "phase4", "phase5", "phase6"}
    for e in every:
        assert e.tables and all((rdir / t).is_file() for t in e.tables), (e.hypothesis, e.tables)
    for e in evs:
        assert e.from_samples == (e.phase != "phase4") and (e.verdict == "inconclusive" or not e.from_samples)
    rules = [e for e in evs if e.from_samples and e.numbers.get("rule_verdict") == "supported"]
    assert rules and all("the rule says supported" in e.summary for e in rules)      # H4/H5 of the H200 sample
    page = (rdir / "index.html").read_text()
    assert not _broken_links(rdir, page)
    ledger = page[page.index("Investigation ledger"):page.index("<h2>Milestones")]
    assert ledger.count("rests on:") == len(every)
    assert ledger.count("recorded sample data</span>") == sum(e.from_samples for e in every)
    p3 = (rdir / "phase3" / "report.html").read_text()      # no nsys_dir: the page says how to make the CSVs
    assert "No Nsight Systems reports imported" in p3 and "nsys stats --report cuda_gpu_kern_sum" in p3
    m = json.loads((rdir / "manifest.json").read_text())
    assert all(m["phases"][p]["status"] == "success" for p in ("phase3", "phase4", "phase5", "phase6"))
