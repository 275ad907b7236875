"""`servelab run phase3 --target local-sglang-moe`: a real SGLang 0.5.23 on this CPU serving the tiny random Qwen2-MoE
(8 experts, top-2) with its expert-distribution recorder on; the decode scenario is captured live, the recorder runs
around the capture (start before /start_profile, stop and dump once the trace is written), its dump is collected
into the case folder, and Q8 answers from the counts — not from the kernel-time proxy.

Why the counts can be checked without knowing them: with top-2 routing every token is routed to exactly two experts
in every MoE layer, so each layer's total is the same even number (2 × the tokens of the recorded passes).
"""
from __future__ import annotations

import csv
import json

import pytest

from servelab.cli import main
from servelab.core.run import read_commands, read_manifest

pytestmark = pytest.mark.slow


def test_q8_from_the_engines_expert_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_OUTPUTS", str(tmp_path))
    code = main(["run", "phase3", "--target", "local-sglang-moe", "--run-id", "moe", "-p", "scenarios=[decode_control]"])
    assert code == 0
    rdir = tmp_path / "moe"
    phase = read_manifest(rdir)["phases"]["phase3"]
    assert phase["status"] == "success" and not phase["from_samples"]
    starts = [r for r in read_commands(rdir, "phase3") if r.title.startswith("start sglang")]
    assert "--expert-distribution-recorder-mode stat" in " ".join(starts[0].argv)
    assert starts[0].env["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"].endswith("engine-profiles/expert-distribution")
    posts = [r.argv[-1].rsplit("/", 1)[1] for r in read_commands(rdir, "phase3") if "expert_distribution" in " ".join(r.argv)]
    assert posts == ["start_expert_distribution_record", "stop_expert_distribution_record",
                     "dump_expert_distribution_record"]
    case = rdir / "cases" / "D2-profile--profile-decode_control"
    rec = json.loads((case / "expert-distribution" / "expert_record.json").read_text())
    assert rec["status"] == {"start": 200, "stop": 200, "dump": 200} and not rec["error"], rec
    assert len(rec["files"]) == 1 and (case / rec["files"][0]["file"]).exists()
    layers = list(csv.DictReader(open(rdir / "phase3" / "trace_expert_imbalance.csv")))
    assert [r["layer"] for r in layers] == ["0", "1"] and all(r["experts"] == "8" for r in layers)
    totals = {int(r["tokens"]) for r in layers}
    assert len(totals) == 1 and totals.pop() % 2 == 0 and int(layers[0]["tokens"]) > 0
    q8 = next(r for r in csv.DictReader(open(rdir / "phase3" / "trace_questions.csv")) if r["id"] == "Q8")
    assert q8["answerable"] == "true" and q8["evidence"].startswith("from expert counts"), q8
    assert "expert_distribution_recorder_" in q8["source"]
    page = (rdir / "phase3" / "report.html").read_text()
    assert "from expert counts" in page
