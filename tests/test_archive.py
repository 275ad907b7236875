"""The archive: run index with the hypotheses ledger and milestones, the root index, the zip bundle."""
from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from contexts import phase_ctx  # noqa: E402
from servelab.core import run as runlib
from servelab.cli import main
from servelab.report.archive import write_root_index, write_run_index, zip_run
from servelab.report.ledger import ledger, record_evidence
from servelab.report.milestones import milestones

sys.path.insert(0, str(Path(__file__).parent))
from casefiles import write_cases  # noqa: E402


def ctx_for(rdir, phase="phase3"):
    return phase_ctx(rdir, phase)


def test_ledger_statuses(outputs):
    rdir = runlib.init_run("ledger-1", "local-tiny")
    ctx = ctx_for(rdir)
    record_evidence(ctx, "H5", "refuted", "decode replayed from CUDA graphs: 99% of kernels", anchor="graphs")
    record_evidence(ctx, "H1", "supported", "exposed NCCL 31% of decode step")
    record_evidence(ctx_for(rdir, "phase4"), "H1", "refuted", "TP8+PP2 no faster")
    record_evidence(ctx, "H4", "inconclusive", "one injection only")
    with pytest.raises(ValueError):
        record_evidence(ctx, "H1", "maybe", "x")
    with pytest.raises(Exception, match="did you mean 'H7'"):
        record_evidence(ctx, "H77", "supported", "x")
    df = ledger(rdir).set_index("id")
    assert df.loc["H5", "status"] == "refuted" and df.loc["H1", "status"] == "contested"
    assert df.loc["H4", "status"] == "inconclusive" and df.loc["H2", "status"] == "open"
    assert len(df) >= 7
    page = write_run_index(rdir).read_text()
    assert "Investigation ledger" in page and 'href="phase3/report.html#graphs"' not in page   # no page yet: no link
    (rdir / "phase3" / "report.html").write_text('<h2 id="graphs">graphs</h2>')
    page = write_run_index(rdir).read_text()
    assert 'href="phase3/report.html#graphs"' in page


def test_evidence_links_the_tables_it_rests_on(outputs):
    """Each piece of evidence names its tables relative to the run folder; the index links those that exist,
    marks the others missing, escapes everything and never links outside the run."""
    rdir = runlib.init_run("ledger-links", "local-tiny")
    ctx = ctx_for(rdir)
    (rdir / "phase3" / "trace_actions.csv").write_text("metric,status\n")
    (rdir / "phase3" / "report.html").write_text("<h2 id='Q4'>q4</h2>")
    ev = record_evidence(ctx, "H5", "supported", "host-bound <idle> 25%", anchor="Q4",
                         table=["trace_actions.csv", "phase1/matrix.csv", 'we"ird.csv'])
    assert ev.tables == ["phase3/trace_actions.csv", "phase1/matrix.csv", 'phase3/we"ird.csv']
    assert ev.from_samples is False and ev.verdict == "supported"
    page = write_run_index(rdir).read_text()
    assert '<a href="phase3/trace_actions.csv">phase3/trace_actions.csv</a>' in page
    assert 'phase1/matrix.csv (missing)' in page and 'href="phase1/matrix.csv"' not in page
    assert "we&quot;ird.csv (missing)" in page and "&lt;idle&gt;" in page and "<idle>" not in page
    from servelab.report.archive import _href
    assert _href(rdir, "javascript:alert(1)") is None and _href(rdir, "../ledger-links/index.html") is None
    assert _href(rdir, "/etc/passwd") is None
    # the M2 bottleneck check links the tables of the supported evidence
    m2 = {c.check: c for c in milestones(rdir)[1].checks}["1–3 bottlenecks with trace/counter/log evidence"]
    assert m2.status == "pass" and m2.tables[0] == "phase3/trace_actions.csv"
    assert 'Milestones' in page and page.count('href="phase3/trace_actions.csv"') == 2


def test_sample_evidence_never_supports_the_live_target(outputs):
    """Evidence computed from data/samples is recorded inconclusive with what the rule said, is badged in the
    index and is not a bottleneck for M2."""
    rdir = runlib.init_run("ledger-samples", "local-tiny")
    ctx = ctx_for(rdir)
    ctx.from_samples = True
    ev = record_evidence(ctx, "H4", "supported", "decode interval 34.5x steady", table="trace_interference.csv")
    assert ev.verdict == "inconclusive" and ev.from_samples and ev.numbers["rule_verdict"] == "supported"
    assert ev.summary.startswith("recorded sample data, not this target — the rule says supported: ")
    df = ledger(rdir).set_index("id")
    assert df.loc["H4", "status"] == "inconclusive"
    m2 = {c.check: c for c in milestones(rdir)[1].checks}["1–3 bottlenecks with trace/counter/log evidence"]
    assert m2.status == "not measured"
    live = ctx_for(rdir, "phase7")
    record_evidence(live, "H4", "supported", "every long prefill raised the P95 token gap")
    assert ledger(rdir).set_index("id").loc["H4", "status"] == "supported"
    record_evidence(live, "H4", "refuted", "phase 7 run again: no prefill raised the P95 token gap")
    h4 = ledger(rdir).set_index("id").loc["H4"]          # the re-run supersedes phase 7's earlier word
    assert h4["status"] == "refuted" and [e["phase"] for e in h4["evidence"]] == ["phase3", "phase7"]
    assert len((rdir / "evidence.jsonl").read_text().splitlines()) == 3
    page = write_run_index(rdir).read_text()
    assert page.count('class="samples">recorded sample data') == 1


def test_m1_needs_three_repeats_and_low_cv(outputs):
    """M1 from case summaries: repeats counted per case, CV across the repeats (not across definitions)."""
    rdir = runlib.init_run("m1", "local-tiny")
    rows = [("P1", r, 100.0 + r) for r in range(3)] + [("D1", r, v) for r, v in enumerate((100, 120, 80))] + \
        [("D2", 0, 50.0)]
    write_cases(rdir, [{"case_id": c, "repeat": r, "output_throughput": v} for c, r, v in rows])
    m = milestones(rdir)[0]
    checks = {c.check.split(" (")[0]: c for c in m.checks}
    assert checks["3 repeats per matrix point"].status == "fail" and "D2 (1)" in checks["3 repeats per matrix point"].detail
    cv = next(c for c in m.checks if c.check.startswith("key TPS CV"))
    # std(100,120,80) = 20 over mean 100; P1: std 1 over mean 101
    assert cv.status == "fail" and "D1 20.00% (output_throughput, n=3)" in cv.detail
    assert "P1 0.99% (output_throughput, n=3)" in cv.detail and "D2" not in cv.detail
    assert checks["every quick-matrix point measured"].status == "not measured"     # P2, P3 ... never ran
    assert m.status == "not met"
    page = write_run_index(rdir).read_text()
    assert "Measured cases" in page and "D1 20.00%" in page


def test_m2_and_m4_read_what_the_phases_write(outputs):
    rdir = runlib.init_run("m24", "local-tiny")
    (rdir / "phase3").mkdir()
    pd.DataFrame({"rank": [0, 0, 1], "window": [0, 1, 0], "kind": ["prefill", "decode", "prefill"]}).to_csv(
        rdir / "phase3" / "trace_windows.csv", index=False)
    runlib.update_manifest(rdir, phases={"phase3": {"status": "success", "from_samples": False}})
    m2 = {c.check: c for c in milestones(rdir)[1].checks}
    assert m2["prefill profile analysed"].status == "pass" and "2 prefill windows" in m2["prefill profile analysed"].detail
    assert m2["mixed profile analysed"].status == "not measured"
    runlib.update_manifest(rdir, phases={"phase3": {"status": "success", "from_samples": True}})
    assert "recorded sample" in {c.check: c for c in milestones(rdir)[1].checks}["decode profile analysed"].detail
    m4 = milestones(rdir)[3]
    assert m4.status == "not started" and "no A/B recorded" in m4.checks[0].detail


def test_zip_and_root_index(outputs):
    rdir = runlib.init_run("zipme", "local-tiny")
    (rdir / "phase0").mkdir()
    (rdir / "phase0" / "report.html").write_text("<html>ok</html>")
    prepared = rdir / "phase3" / "traces" / ".servelab_cache" / "r0.trace.json.gz.v1.parquet.prepared" / "k"
    prepared.mkdir(parents=True)
    (prepared / "meta.json").write_text("{}")         # the trace analysis's caches stay out of the bundle
    out = zip_run(rdir)
    names = zipfile.ZipFile(out).namelist()
    assert not [n for n in names if ".servelab_cache" in n]
    assert "zipme/index.html" in names and "zipme/manifest.json" in names and "zipme/phase0/report.html" in names
    root = write_root_index(outputs).read_text()
    assert 'href="zipme/index.html"' in root
    assert main(["archive", "zipme", "--zip"]) == 0
    assert main(["archive", "nope"]) == 2


def test_failed_attempts_become_lessons_at_the_end(outputs):
    rdir = runlib.init_run("lessons", "local-tiny")
    runlib.update_manifest(rdir, phases={"phase1": {"status": "success", "started": "t2"}},
                           attempts=[{"phase": "phase1", "status": "failed", "started": "t1",
                                      "error": "ENGINE_CRASH in D2_c16 <oom>", "params": {"repeats": 3}},
                                     {"phase": "phase1", "status": "success", "started": "t2", "params": {}}])
    page = write_run_index(rdir).read_text()
    lessons = page.index("Lessons — failed attempts")
    assert lessons > page.index("Milestones") and "ENGINE_CRASH in D2_c16 &lt;oom&gt;" in page[lessons:]
    assert page[lessons:].count("<tr>") == 2             # header + the one failed attempt


@pytest.mark.slow
def test_m1_on_a_real_phase1_run_reports_the_cv_across_three_repeats(outputs, llama_server_binary):
    """Phase 1 for real (tiny llama-server, two points, repeats=3): the archive's M1 counts 3 repeats per point
    and reports each point's CV across those repeats, recomputed here from the summaries' repeat entries."""
    from servelab.measure.case_record import read_summaries
    assert main(["run", "phase1", "--target", "local-tiny", "--run-id", "m1-real", "-p", 'cases=["P1","D1"]',
                 "-p", "repeats=3", "-p", "search=false", "--no-render"]) == 0
    rdir = outputs / "m1-real"
    sums = {s["case_id"]: s for s in read_summaries(rdir, "phase1")}
    assert set(sums) == {"P1", "D1"} and all(len(s["repeats"]) == 3 for s in sums.values())
    m = milestones(rdir)[0]
    checks = {c.check: c for c in m.checks}
    assert checks["3 repeats per matrix point"].status == "pass"
    cv = checks["key TPS CV across repeats ≤ 3.0%"]
    assert cv.status in ("pass", "fail")                      # measured either way; the shared CPU decides which
    for cid, key in (("P1", "input_throughput"), ("D1", "output_throughput")):
        vals = pd.Series([r["metrics"]["vllm"][key] for r in sums[cid]["repeats"]])
        expect = 100 * vals.std(ddof=1) / vals.mean()
        assert f"{cid} {expect:.2f}% ({key}, n=3)" in cv.detail
    page = write_run_index(rdir).read_text()
    assert "key TPS CV across repeats" in page and "n=3" in page
