"""The engine's collectives against the ceiling, on our real 2 × H200 capture (torch-profiler traces of the TP=2 toy) and
the nccl-tests log of the same machine (data/samples/h200x2): per collective × size bucket, busbw from the trace's
own message sizes and kernel times by the nccl-tests definitions, the nccl-tests busbw at that size, and the
exposed time per step."""
from __future__ import annotations

from pathlib import Path

import pytest

from servelab.analyse.ceiling import ceiling_finding, collectives_vs_ceiling, size_label
from servelab.analyse.nccl.perf_log import parse_file, runs_frame
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.metrics import comm_by_collective
from servelab.analyse.trace.nccl import comm_ops

H200 = Path(__file__).resolve().parents[1] / "data" / "samples" / "h200x2"


def test_h200_all_reduce_against_its_nccl_tests_ceiling(tmp_path):
    a = analyse(H200 / "traces", cache_dir=tmp_path / "c")
    comm = comm_ops(a.rops)
    curves = runs_frame(parse_file(H200 / "nccl_tests.log"))
    t = collectives_vs_ceiling(comm, curves, comm_by_collective(a.rops)).set_index("size bucket")
    assert set(t["collective"]) == {"all_reduce"} and set(t.index) == {"32 MiB", "64 MiB", "256 KiB"}
    r = t.loc["32 MiB"]
    # nccl-tests' out-of-place busbw at 33554432 B in that log: 241.11 GB/s
    assert r["ceiling busbw (GB/s)"] == pytest.approx(241.11)
    calls = comm.filter((comm["msg_bytes"] == 33554432))
    med_ns = float(calls["dur_ns"].median())
    # algbw = S / t; busbw = algbw × 2(n−1)/n = algbw for n = 2 (the median of the per-call values)
    assert r["busbw (GB/s)"] == pytest.approx(float((33554432 / calls["dur_ns"]).median()), rel=1e-9)
    assert r["median time (µs)"] == pytest.approx(med_ns / 1e3)
    assert r["share of ceiling (%)"] == pytest.approx(100 * r["busbw (GB/s)"] / 241.11)
    assert r["calls"] == calls.height and r["ranks"] == 2
    # the exposed time of all all-reduces, shared by call time: the sized calls' share of the trace's total per
    # rank-step (41 steps per rank here)
    every = comm.to_pandas()
    steps = int(every.groupby("rank")["window"].nunique().max())
    sized = every[every["msg_bytes"].notna() & (every["msg_bytes"] > 0)]["dur_ns"].sum() / every["dur_ns"].sum()
    total = float(comm_by_collective(a.rops)["exposed_ms"].sum()) / (steps * 2)
    assert steps == 41 and t["exposed per step (ms)"].sum() == pytest.approx(total * sized)
    assert r["calls per step"] == pytest.approx(calls.height / (41 * 2))
    text = ceiling_finding(t.reset_index())
    assert text.startswith("all_reduce at 32 MiB (") and "of the nccl-tests busbw at that size" in text
    assert size_label(1048576) == "1 MiB" and size_label(262144) == "256 KiB" and size_label(100) == "100 B"


def test_phase3_and_phase5_sections_on_the_h200_sample(tmp_path):
    from servelab.analyse.ceiling import with_ceiling
    from servelab.report.evidence_section import ceiling_table
    from servelab.phases.phase3_timeline import Phase3, ceiling_view, findings
    a = analyse(H200 / "traces", cache_dir=tmp_path / "c")
    t, source = ceiling_table(a, None, tmp_path)            # no run: the nccl-tests log beside the sample traces
    assert source == "the nccl-tests log beside the traces (nccl_tests.log)"
    assert (tmp_path / "collectives_vs_ceiling.csv").is_file()
    from servelab.analyse.trace.actions import evidence_actions
    from servelab.analyse.trace.scenarios import answer_capture
    questions, _, _ = answer_capture(a, H200 / "traces", "the H200 sample")     # as Phase 3 answers a capture
    p = Phase3(a, questions, evidence_actions(a), {}, ceiling=t, ceiling_source=source)
    assert ceiling_view(p).attrs["caption"].startswith("ceiling: the nccl-tests log")
    assert any(f.startswith("all_reduce at 32 MiB") and "ceiling (the nccl-tests log" in f for f in findings(p))
    # Phase 5 puts its own curves beside Phase 3's table: with the same log, the same ceiling
    import pandas as pd
    again = with_ceiling(pd.read_csv(tmp_path / "collectives_vs_ceiling.csv"),
                         runs_frame(parse_file(H200 / "nccl_tests.log")))
    assert again["ceiling busbw (GB/s)"].tolist() == pytest.approx(t["ceiling busbw (GB/s)"].tolist())
