"""No data loss: run-level tables merge by case, a case's records survive Ctrl-C, a failed re-run keeps the good
page. (Manifest locking is in test_run.py.)"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from servelab.measure import case as cs
from servelab.measure import request_metrics as mx


def _result(tmp: Path, case_id: str, tput: float, valid: bool = True) -> cs.CaseResult:
    spec = cs.CaseSpec(case_id, case_id[:2], "decode", 64, 64, 1, 1, True)
    s = {"completed": 1, "failed": 0, "output_throughput": tput}
    return cs.CaseResult(spec, "success", tmp / "cases" / case_id, {"vllm": s, "sglang": dict(s)}, [],
                         verdict=mx.Verdict("VALID" if valid else "INVALID", [] if valid else ["x"]))


def test_summary_csv_merges_by_case(tmp_path):
    """A second invocation that runs only D1 replaces D1's rows and keeps P1's (before: P1 was dropped)."""
    first = cs.MatrixResult([_result(tmp_path, "P1", 10.0), _result(tmp_path, "D1", 20.0)], [], [])
    cs.write_summary_csv(tmp_path, first)
    second = cs.MatrixResult([_result(tmp_path, "D1", 25.0, valid=False), _result(tmp_path, "P2", 5.0)], [], [])
    cs.write_summary_csv(tmp_path, second)
    csv = pd.read_csv(tmp_path / "summary.csv")
    assert sorted(zip(csv["case_id"], csv["definition"])) == sorted(
        (c, d) for c in ("P1", "D1", "P2") for d in ("vllm", "sglang"))
    tput = {(r.case_id, r.definition): r.output_throughput for r in csv.itertuples()}
    assert tput[("P1", "vllm")] == 10.0 and tput[("D1", "vllm")] == 25.0 and tput[("P2", "sglang")] == 5.0
    assert set(csv.loc[csv["case_id"] == "D1", "validity"]) == {"INVALID"}
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_merge_table_keeps_columns_of_both_and_string_keys(tmp_path):
    from servelab.core.run import merge_table
    p = tmp_path / "t.csv"
    merge_table(p, pd.DataFrame([{"case_id": "1", "definition": "vllm", "a": 1}]), ["case_id", "definition"])
    merge_table(p, pd.DataFrame([{"case_id": "2", "definition": "vllm", "b": 2}]), ["case_id", "definition"])
    got = pd.read_csv(p, dtype={"case_id": str})
    assert list(got.columns) == ["case_id", "definition", "a", "b"] and list(got["case_id"]) == ["1", "2"]
    merge_table(p, pd.DataFrame([{"case_id": "1", "definition": "vllm", "a": 3}]), ["case_id", "definition"])
    got = pd.read_csv(p, dtype={"case_id": str})
    assert len(got) == 2 and got.set_index("case_id").loc["1", "a"] == 3
