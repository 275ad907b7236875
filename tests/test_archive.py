"""The archive: run index with the hypotheses ledger and milestones, the root index, the zip bundle."""
from __future__ import annotations

import zipfile

import pandas as pd
import pytest

from servelab.core import run as runlib
from servelab.cli import main
from servelab.phases.context import PhaseContext
from servelab.target.targets import load_target
from servelab.report.archive import write_root_index, write_run_index, zip_run
from servelab.report.ledger import ledger, record_evidence
from servelab.report.milestones import milestones


def ctx_for(rdir, phase="phase3"):
    (rdir / phase).mkdir(parents=True, exist_ok=True)
    return PhaseContext(phase=phase, run_id=rdir.name, run_dir=rdir, phase_dir=rdir / phase, params={},
                        target=load_target("local-tiny"), started=runlib.now_iso())


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
    assert "Investigation ledger" in page and 'href="phase3/report.html#graphs"' in page


def test_m1_needs_three_repeats_and_low_cv(outputs):
    rdir = runlib.init_run("m1", "local-tiny")
    rows = [("P1", r, 100.0 + r) for r in range(3)] + [("D1", r, v) for r, v in enumerate((100, 120, 80))] + \
        [("D2", 0, 50.0)]
    pd.DataFrame(rows, columns=["case_id", "repeat", "output_throughput"]).to_csv(rdir / "summary.csv", index=False)
    m = milestones(rdir)[0]
    checks = {c.check.split(" (")[0]: c for c in m.checks}
    assert checks["3 repeats per matrix point"].status == "fail" and "D2 (1)" in checks["3 repeats per matrix point"].detail
    cv = next(c for c in m.checks if c.check.startswith("key TPS CV"))
    assert cv.status == "fail" and "D1 20.0%" in cv.detail        # std(100,120,80)=20 over mean 100
    assert m.status == "not met"


def test_zip_and_root_index(outputs):
    rdir = runlib.init_run("zipme", "local-tiny")
    (rdir / "phase0").mkdir()
    (rdir / "phase0" / "report.html").write_text("<html>ok</html>")
    out = zip_run(rdir)
    names = zipfile.ZipFile(out).namelist()
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
