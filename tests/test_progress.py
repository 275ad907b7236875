"""The progress a long phase prints while papermill runs it: events in <run>/<phase>/progress.jsonl, printed by the CLI."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from servelab.cli import ProgressTail
from servelab.core import run as runlib
from servelab.measure import case as cs
from servelab.measure import matrix as mt
from servelab.measure import request_metrics as mx
from servelab.measure.search import SearchConfig, concurrency_search


# ---------------------------------------------------------------- progress

def test_progress_tail_prints_each_event_as_one_line_and_stops(tmp_path: Path) -> None:
    rdir = tmp_path / "run"
    runlib.emit_progress(rdir, "phase1", "from an earlier execution")          # before the tail: not printed
    path = runlib.progress_path(rdir, "phase1")
    lines: list[str] = []
    with ProgressTail(path, say=lines.append, interval_s=0.02) as tail:
        assert tail.alive
        runlib.emit_progress(rdir, "phase1", "case 1 of 2: P1 … (0 s elapsed)", i=1, n=2)
        with open(path, "a") as f:                                            # half a line: wait for the rest
            f.write('{"phase": "phase1", "message": "case 2 of 2: D1')
            f.flush()
            deadline = time.monotonic() + 5
            while not lines and time.monotonic() < deadline:
                time.sleep(0.02)
            assert lines == ["phase1: case 1 of 2: P1 … (0 s elapsed)"]
            f.write(' … (3 s elapsed, about 3 s left)"}\nnot json\n')
        runlib.emit_progress(rdir, "phase1", "matrix done: 2 of 2 cases in 6 s, 2 VALID")
    assert not tail.alive                                                      # stopped, the rest printed first
    assert lines == ["phase1: case 1 of 2: P1 … (0 s elapsed)",
                     "phase1: case 2 of 2: D1 … (3 s elapsed, about 3 s left)",
                     "phase1: matrix done: 2 of 2 cases in 6 s, 2 VALID"]


def test_progress_tail_stops_when_the_phase_fails(tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with ProgressTail(tmp_path / "phase1" / "progress.jsonl", say=lines.append, interval_s=0.02) as tail:
            runlib.emit_progress(tmp_path, "phase1", "case 1 of 9: P1 …")
            raise KeyboardInterrupt
    assert not tail.alive and lines == ["phase1: case 1 of 9: P1 …"]


def _fake_result(env: cs.CaseEnv, case: cs.CaseSpec, tps: float = 100.0) -> cs.CaseResult:
    summ = {"output_throughput": tps, "total_token_throughput": tps, "failed": 0}
    return cs.CaseResult(case, "success", env.run_dir / "cases" / case.case_id, summaries={"vllm": summ},
                         verdict=mx.Verdict("VALID", []))


def test_the_matrix_and_the_search_emit_case_i_of_n(tmp_path: Path) -> None:
    env = cs.CaseEnv(srv=None, run_dir=tmp_path / "run", pool=[], phase="phase1")
    cases = [cs.CaseSpec(c, c, "decode", 8, 8, 1, 1, False) for c in ("P1", "D1", "D2_c4")]

    def runner(e: cs.CaseEnv, case: cs.CaseSpec) -> cs.CaseResult:
        time.sleep(0.05)
        return _fake_result(e, case)
    mt.run_matrix(env, cases, case_runner=runner)
    tps = {1: 100.0, 4: 300.0, 8: 301.0}
    concurrency_search(env, SearchConfig(8, 8, step=4, max_concurrency=8),
                       runner=lambda e, c: _fake_result(e, c, tps[c.concurrency]))
    events = [json.loads(x) for x in runlib.progress_path(env.run_dir, "phase1").read_text().splitlines()]
    msgs = [e["message"] for e in events]
    assert msgs[0] == "case 1 of 3: P1 … (0 s elapsed)"
    assert re.fullmatch(r"case 2 of 3: D1 … \(\d+ s elapsed, about \d+ s left\)", msgs[1])
    assert msgs[2].startswith("case 3 of 3: D2_c4 …")
    assert (events[1]["i"], events[1]["n"], events[1]["case_id"]) == (2, 3, "D1") and events[1]["eta_s"] > 0
    assert msgs[3].startswith("matrix done: 3 of 3 cases in ") and msgs[3].endswith("3 VALID")
    assert [m.split(" (")[0] for m in msgs[4:7]] == ["search step 1: concurrency 1", "search step 2: concurrency 4",
                                                    "search step 3: concurrency 8"]
    assert "(ladder 2 of at most 3)" in msgs[5]
    assert msgs[7].startswith("search done: 3 step(s) in ") and "TPS_SATURATED" in msgs[7]
