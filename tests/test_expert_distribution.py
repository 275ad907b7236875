"""Q8 from expert counts: SGLang's expert-distribution dump read without torch (``analyse.trace.experts``), the
per-layer imbalance, and Q8's answer from counts — or from the kernel-time proxy, saying which.

The fixture ``data/samples/sglang-cpu-moe/expert_distribution_recorder_1796208136.0925686.pt`` is a real dump: SGLang
0.5.23 on this CPU (sglang-cpu venv, torch 2.13.0+cpu) serving the tiny random Qwen2-MoE of
``make_tiny_moe_hf.py`` with ``--expert-distribution-recorder-mode stat``; ``/start_expert_distribution_record``, two
greedy requests of 16 tokens, ``/stop_…``, ``/dump_…``. torch.load of that file gave ``logical_count`` of shape
(1000, 2, 8), int32, 17 passes with tokens, and these sums over the passes (the reference the reader must match).
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from servelab.analyse.trace.experts import (ExpertDumpError, capture_expert_counts, expert_imbalance,
                                            find_expert_dumps, read_expert_dump, read_torch_dump)
from servelab.analyse.trace.questions import q8_from_counts

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "samples" / "sglang-cpu-moe"
DUMP = SAMPLE / "expert_distribution_recorder_1796208136.0925686.pt"
TORCH_SUMS = [[0, 0, 40, 65, 0, 1, 0, 24], [0, 65, 0, 0, 0, 65, 0, 0]]     # torch.load(DUMP)["logical_count"].sum(0)


def test_reads_the_real_stat_dump_like_torch():
    raw = read_torch_dump(DUMP)
    assert set(raw) == {"rank", "logical_count", "average_utilization_rate_over_window"}
    lc = raw["logical_count"]
    assert lc.shape == (1000, 2, 8) and lc.dtype == np.int32
    ec = read_expert_dump(DUMP)
    assert ec.counts.tolist() == TORCH_SUMS
    assert (ec.mode, ec.passes, ec.ranks, ec.layers, ec.experts) == ("stat", 17, [0], 2, 8)
    # top-2 routing: every token counts twice in every MoE layer, so the layers' totals are equal and even
    totals = ec.counts.sum(axis=1)
    assert totals[0] == totals[1] and totals[0] % 2 == 0


def test_imbalance_table_per_layer():
    t = expert_imbalance(read_expert_dump(DUMP))
    rows = {r["layer"]: r for r in t.iter_rows(named=True)}
    assert rows[0]["tokens"] == 130 and rows[0]["max_tokens"] == 65 and rows[0]["mean_tokens"] == pytest.approx(16.25)
    assert rows[0]["imbalance"] == pytest.approx(4.0) and rows[0]["idle_experts"] == 4
    assert rows[0]["hot_experts"] == "3 (65), 2 (40)"            # ≥ 1.5 × 16.25; expert 7 (24) is below
    assert rows[1]["hot_experts"] == "1 (65), 5 (65)" and rows[1]["idle_experts"] == 6


def test_q8_answers_from_counts():
    ec = read_expert_dump(DUMP)
    a = q8_from_counts(ec, str(DUMP))
    assert a.answerable and a.answer.startswith("yes: 2 of 2 MoE layers")
    assert "from expert counts" in a.evidence and "mode stat" in a.evidence and "17 forward passes" in a.evidence
    assert "layer 0: max 65 / mean 16.2 = 4.00, hot 3 (65), 2 (40), idle 4" in a.evidence


def test_q8_says_no_when_balanced():
    ec = read_expert_dump(DUMP)
    ec.counts = np.full_like(ec.counts, 10)
    a = q8_from_counts(ec, "x")
    assert a.answerable and a.answer.startswith("no: every MoE layer's max/mean is below 1.3")


def test_find_and_capture_folder(tmp_path: Path):
    case = tmp_path / "case"
    (case / "profiles").mkdir(parents=True)
    assert capture_expert_counts(case / "profiles") is None
    node = case / "expert-distribution" / "local"
    node.mkdir(parents=True)
    (node / "expert_distribution_recorder_1.5.pt").write_bytes(DUMP.read_bytes())
    (node / DUMP.name).write_bytes(DUMP.read_bytes())
    (node / "unrelated.pt").write_bytes(b"x")
    assert [p.name for p in find_expert_dumps(case / "expert-distribution")] == [DUMP.name]    # the newest
    assert capture_expert_counts(case / "profiles").counts.tolist() == TORCH_SUMS


def _zip_with(pkl: bytes, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pkl)
        z.writestr("evil/byteorder", "little")
    return path


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("echo pwned",))


def test_refuses_code_in_the_pickle(tmp_path: Path):
    p = _zip_with(pickle.dumps(_Evil(), protocol=2), tmp_path / "expert_distribution_recorder_1.pt")
    with pytest.raises(ExpertDumpError, match=r"refers to (posix|os)\.system.*refused"):
        read_torch_dump(p)


def test_bad_files_name_themselves(tmp_path: Path):
    junk = tmp_path / "expert_distribution_recorder_2.pt"
    junk.write_text("not a zip")
    with pytest.raises(ExpertDumpError, match="expert_distribution_recorder_2.pt: not a torch.save zip archive"):
        read_expert_dump(junk)
    other = _zip_with(pickle.dumps({"something": 1}, protocol=2), tmp_path / "expert_distribution_recorder_3.pt")
    with pytest.raises(ExpertDumpError, match="neither 'logical_count'.*nor 'records'"):
        read_expert_dump(other)
    with pytest.raises(ExpertDumpError, match="no expert-distribution dump files"):
        read_expert_dump([])


PER_PASS = SAMPLE / "expert_distribution_recorder_1796210558.815732_0.pt"
TORCH_PER_PASS_SUMS = [[0, 0, 29, 49, 0, 1, 0, 19], [0, 49, 0, 0, 0, 49, 0, 0]]   # torch.load, records summed


def test_reads_the_real_per_pass_dump_like_torch(tmp_path: Path):
    raw = read_torch_dump(PER_PASS)
    assert set(raw) == {"records", "last_physical_to_logical_map"} and len(raw["records"]) == 8
    assert [r["forward_pass_id"] for r in raw["records"]] == list(range(10, 18))
    assert raw["last_physical_to_logical_map"].dtype == np.int64
    ec = read_expert_dump(PER_PASS)
    assert (ec.mode, ec.passes, ec.ranks) == ("per_pass", 8, [0]) and ec.counts.tolist() == TORCH_PER_PASS_SUMS
    # a per-pass recording is one file per rank: find_expert_dumps takes every rank's file of the last dump
    (tmp_path / PER_PASS.name).write_bytes(PER_PASS.read_bytes())
    (tmp_path / PER_PASS.name.replace("_0.pt", "_1.pt")).write_bytes(PER_PASS.read_bytes())
    both = read_expert_dump(find_expert_dumps(tmp_path))
    assert both.counts.tolist() == (2 * np.array(TORCH_PER_PASS_SUMS)).tolist()
    with pytest.raises(ExpertDumpError, match="different recorder modes"):
        read_expert_dump([DUMP, PER_PASS])
