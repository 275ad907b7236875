"""The case contract: the writer's order, the schema's rules, and every summary of a real demo run in one shape."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from servelab.measure.case_record import (SCHEMA_VERSION, CaseFolder, CaseSummary, SummarySchemaError, read_summaries,
                                          summary_problems, validate_summary, verdict)


def _summary(**over) -> CaseSummary:
    base = dict(case_id="P1", phase="phase1", kind="prefill", status="success", verdict=verdict("VALID"),
                definition="vllm", metrics={"vllm": {"output_throughput": 1.0}},
                repeats=[{"repeat": 0, "metrics": {"vllm": {"output_throughput": 1.0}}}])
    return CaseSummary(**{**base, **over})


def test_summary_is_refused_before_the_raw_records(tmp_path):
    folder = CaseFolder(tmp_path, "P1", "phase1", "prefill", {"note": "x"})
    meta = json.loads((folder.dir / "meta.json").read_text())
    assert (meta["status"], meta["phase"], meta["kind"], meta["note"]) == ("running", "phase1", "prefill", "x")
    with pytest.raises(RuntimeError, match="requests.jsonl must be written before summary.json"):
        folder.write_summary(_summary())
    folder.write_requests([])
    written = folder.write_summary(_summary())
    folder.finish("success")
    assert written["schema_version"] == SCHEMA_VERSION and written["repeat_of"] == "P1"
    assert json.loads((folder.dir / "meta.json").read_text())["status"] == "success"
    # a new attempt never pairs new raw data with the old summary
    CaseFolder(tmp_path, "P1", "phase1", "prefill")
    assert not (folder.dir / "summary.json").exists() and not (folder.dir / "requests.jsonl").exists()


def test_an_invalid_case_has_no_valid_repeat_and_gives_its_reasons(tmp_path):
    folder = CaseFolder(tmp_path, "D1", "phase1", "decode")
    folder.write_requests([])
    s = folder.write_summary(_summary(kind="decode", verdict=verdict("INVALID", ["window too short"])))
    assert s["verdict"] == {"status": "INVALID", "reasons": ["window too short"]}
    assert [r["valid"] for r in s["repeats"]] == [False]
    with pytest.raises(SummarySchemaError, match="an INVALID verdict must give its reasons"):
        folder.write_summary(_summary(verdict={"status": "INVALID", "reasons": []}))
    with pytest.raises(SummarySchemaError, match="cannot be VALID"):
        folder.write_summary(_summary(status="failed"))


def test_validate_summary_names_every_problem():
    old_phase1 = {"case": {}, "status": "success", "pooled": {}, "repeats": [], "validity": {"verdict": "VALID"}}
    problems = summary_problems(old_phase1)
    assert "missing key 'schema_version'" in problems and "unknown key 'validity'" in problems
    good = _summary().to_json()
    good["started"] = good["ended"] = "2026-01-01T00:00:00"
    assert validate_summary(good) is good
    bad = {**good, "schema_version": 2, "kind": "other", "verdict": {"status": "ACCEPTED", "reasons": []}}
    with pytest.raises(SummarySchemaError, match=r"x.json: .*schema_version 2.*kind 'other'.*verdict must be"):
        validate_summary(bad, "x.json")


@pytest.mark.slow
def test_every_summary_of_a_whole_run_has_one_schema_and_one_verdict_key(tiny_run):
    """Every phase on the tiny model (the session's ``tiny_run``): every summary.json validates, carries the same
    schema_version, and has its verdict under verdict.status — Phase 1, 2, 7, 8 and 9 alike."""
    rdir = tiny_run
    files = sorted((rdir / "cases").glob("*/summary.json"))
    raw = [json.loads(f.read_text()) for f in files]
    for f, s in zip(files, raw):
        validate_summary(s, f)
    assert {s["schema_version"] for s in raw} == {SCHEMA_VERSION}
    assert {s["phase"] for s in raw} == {"phase1", "phase2", "phase7", "phase8", "phase9"}
    assert all(s["verdict"]["status"] in ("VALID", "INVALID") for s in raw)
    assert all("validity" not in s and "verdict" not in s["details"].get("row", {}) for s in raw)
    assert len(read_summaries(rdir)) == len(files)
    # Phase 7's and 9's launch-variant records point at those summaries
    for index in sorted(rdir.glob("phase*/ab/*/cases.json")):
        for e in json.loads(index.read_text())["cases"]:
            assert e["summary"] and validate_summary(json.loads((index.parent / e["summary"]).read_text()))
    page = (rdir / "index.html").read_text()
    assert "Measured cases" in page
    assert Path(rdir / "phase7" / "ab_comparison.csv").is_file()
