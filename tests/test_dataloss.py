"""No data loss: run-level tables merge by case, a case's records survive Ctrl-C, a failed re-run keeps the good
page. (Manifest locking is in test_run.py.)"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from servelab.measure import case as cs
from servelab.measure import matrix as mt
from servelab.measure import request_metrics as mx


def _result(tmp: Path, case_id: str, tput: float, valid: bool = True) -> cs.CaseResult:
    spec = cs.CaseSpec(case_id, case_id[:2], "decode", 64, 64, 1, 1, True)
    s = {"completed": 1, "failed": 0, "output_throughput": tput}
    return cs.CaseResult(spec, "success", tmp / "cases" / case_id, {"vllm": s, "sglang": dict(s)}, [],
                         verdict=mx.Verdict("VALID" if valid else "INVALID", [] if valid else ["x"]))


def test_summary_csv_merges_by_case(tmp_path):
    """A second invocation that runs only D1 replaces D1's rows and keeps P1's (before: P1 was dropped)."""
    first = mt.MatrixResult([_result(tmp_path, "P1", 10.0), _result(tmp_path, "D1", 20.0)], [], [])
    mt.write_summary_csv(tmp_path, first)
    second = mt.MatrixResult([_result(tmp_path, "D1", 25.0, valid=False), _result(tmp_path, "P2", 5.0)], [], [])
    mt.write_summary_csv(tmp_path, second)
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


# ---------------------------------------------------------------- a case's records survive Ctrl-C

def _record(i: int, role: str = "measure"):
    from servelab.measure.records import RequestRecord
    return RequestRecord(request_id=f"r-{i}", index=i, role=role, expected_input_tokens=8, requested_output_tokens=4,
                         http_status=200, send_ns=i, end_ns=i + 10, chunk_ns=[i + 5], chunk_text=["x"],
                         chunk_choices=[True], chunk_tokens=[None])


def test_streamed_records_are_on_disk_at_once_and_an_interrupt_keeps_them(tmp_path):
    """Each streamed record is readable from another process's view (the file) before the case ends; an
    interrupt writes an INTERRUPTED summary counting them; a record arriving after it is dropped; resume does
    not take the case as done."""
    from servelab.measure.case import case_is_done
    from servelab.measure.case_record import CaseFolder, read_summary, repeat_frame
    from servelab.measure.records import read_records
    f = CaseFolder(tmp_path, "D1", "phase1", "decode", {"expected_measured": 3})
    f.stream_record(_record(0, "warmup"))
    f.stream_record(_record(1))
    assert [r.request_id for r in read_records(f.requests_path)] == ["r-0", "r-1"]     # no close, no flush call
    summ = f.interrupt()
    f.stream_record(_record(2))                                                          # late: after the stop
    assert [r.request_id for r in read_records(f.requests_path)] == ["r-0", "r-1"]
    s = read_summary(f.dir / "summary.json")
    assert s["status"] == "INTERRUPTED" and s["verdict"]["status"] == "INTERRUPTED" and s == {**summ}
    assert "1 measured request(s) received" in s["verdict"]["reasons"][0]
    assert s["counts"] == {"requests": 2, "warmup": 1, "measure": 1, "measured": 1, "completed": 1, "failed": 0}
    meta = __import__("json").loads((f.dir / "meta.json").read_text())
    assert meta["status"] == "INTERRUPTED" and meta["ended"] and "received before the stop" in meta["error"]
    assert not case_is_done(f.dir, 1)
    frame, _ = repeat_frame(tmp_path)
    assert frame.empty or not frame["valid"].any()


def test_the_whole_case_replaces_the_stream_in_order(tmp_path):
    from servelab.measure.case_record import CaseFolder
    from servelab.measure.records import read_records
    f = CaseFolder(tmp_path, "P1", "phase1", "prefill")
    for i in (2, 0, 1):                                     # completion order
        f.stream_record(_record(i))
    f.write_requests([_record(0), _record(1), _record(2)])
    assert [r.index for r in read_records(f.requests_path)] == [0, 1, 2]
    assert [p.name for p in f.dir.iterdir() if p.name.endswith(".tmp")] == []


def test_an_interrupted_verdict_goes_with_an_interrupted_status():
    from servelab.measure.case_record import summary_problems, verdict
    base = {"schema_version": 1, "case_id": "P1", "repeat_of": "P1", "phase": "phase1", "kind": "prefill",
            "started": "", "ended": "", "counts": {}, "definition": "vllm", "metrics": {}, "repeats": [],
            "details": {}, "percentile_method": "x"}
    assert summary_problems({**base, "status": "INTERRUPTED", "verdict": verdict("INTERRUPTED", ["ctrl-c"])}) == []
    assert summary_problems({**base, "status": "success", "verdict": verdict("INTERRUPTED", ["ctrl-c"])})
    assert summary_problems({**base, "status": "INTERRUPTED", "verdict": verdict("INVALID", ["x"])})
    assert summary_problems({**base, "status": "INTERRUPTED", "verdict": verdict("INTERRUPTED", [])})


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process, as at a terminal — also where the suite was started with
    SIGINT ignored (a background job of a non-interactive shell inherits SIG_IGN, and Python then installs no
    handler, so a self-sent SIGINT would do nothing)."""
    import signal
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.slow
@pytest.mark.flaky(reruns=2, reruns_delay=5)   # timing under CPU contention (2 shared cores): see pyproject
def test_ctrl_c_mid_case_keeps_the_received_records(tiny_server, tmp_path, sigint_raises):
    """A real SIGINT while a case measures on the real llama-server (once its first records are on disk): the case
    folder keeps them, says INTERRUPTED, the matrix stops with STOPPED_BY_USER, summary.csv has the row, and a
    resumed matrix runs the case again."""
    from servelab.measure.case_record import read_summary
    from servelab.measure.records import read_records
    from servelab.measure.matrix import dispatch_case
    env = cs.make_env(tiny_server, tmp_path / "run", repeats=3)
    cases = [cs.CaseSpec("D1", "D1", "decode", 32, 200, 1, 4, False)]
    path = env.run_dir / "cases" / "D1" / "requests.jsonl"
    fired = _sigint_when_records_land(path, 1)
    mr = mt.run_matrix(env, cases, case_runner=dispatch_case)
    assert fired.is_set(), "no record reached the disk while the case ran"
    assert mr.aborted == "STOPPED_BY_USER during D1" and mr.not_executed == ["D1"]
    recs = read_records(path)
    assert 1 <= len(recs) < 12 and all(r.ok for r in recs)
    s = read_summary(path.parent / "summary.json")
    assert s["verdict"]["status"] == "INTERRUPTED" and s["counts"]["measured"] == len(recs)
    csv = pd.read_csv(env.run_dir / "summary.csv")
    assert set(csv["status"]) == {"INTERRUPTED"} and set(csv["validity"]) == {"INTERRUPTED"}
    again = mt.run_matrix(env, cases, resume=True, case_runner=dispatch_case)
    assert again.skipped == [] and [r.status for r in again.results] == ["success"]
    assert len([r for r in read_records(path) if r.role == "measure"]) == 12


ROOT = Path(__file__).resolve().parents[1]


def _running_case_with_records(cases: Path) -> Path | None:
    import json
    if not cases.is_dir():
        return None
    for d in cases.iterdir():
        try:
            meta = json.loads((d / "meta.json").read_text())
            n = (d / "requests.jsonl").read_text().count("\n")
        except (OSError, ValueError):
            continue
        if meta.get("status") == "running" and n >= 1:
            return d
    return None


@pytest.mark.slow
@pytest.mark.flaky(reruns=2, reruns_delay=5)   # timing under CPU contention (2 shared cores): see pyproject
def test_ctrl_c_through_the_cli_mid_case_keeps_its_records(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the process group: CLI, papermill and the kernel) while a Phase 1
    case is half measured: that case's folder keeps ≥ 1 record and says INTERRUPTED; resume runs it again."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from servelab.measure.records import read_records
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs"), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "servelab.cli", "run", "phase1", "--target", "local-tiny", "--run-id", "cc",
            "-p", "repeats=3", "-p", "cases=D1"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    cases = tmp_path / "outputs" / "cc" / "cases"
    deadline, case = time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None and case is None:
        case = _running_case_with_records(cases)
        time.sleep(0.05)
    assert case is not None, "no case had records on disk while it ran"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    recs = read_records(case / "requests.jsonl")
    assert len(recs) >= 1 and all(r.ok for r in recs)
    meta = json.loads((case / "meta.json").read_text())
    summ = json.loads((case / "summary.json").read_text())
    assert meta["status"] == "INTERRUPTED" and summ["verdict"]["status"] == "INTERRUPTED", (meta, err)
    assert summ["counts"]["requests"] == len(recs)


# ---------------------------------------------------------------- a failed re-run keeps the good page

def _servelab(*args: str, tmp_path: Path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "SERVELAB_OUTPUTS": str(tmp_path / "outputs")}
    return subprocess.run([sys.executable, "-m", "servelab.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_a_failed_rerun_keeps_the_good_page_and_says_so(tmp_path):
    """Phase 3 runs on a real trace (success), then again on the same trace with half its JSON (failure): report.html
    is still the good page, with a banner naming the failure and linking its page; the failed page is kept
    beside it; the run index links both; `servelab render` keeps it so; a good re-run clears the banner."""
    import json
    import re
    src = next((ROOT / "data" / "samples" / "h200x2" / "traces").glob("*-TP-0.trace.json.gz"))
    good, cut = tmp_path / "good", tmp_path / "cut"
    good.mkdir()
    cut.mkdir()
    (good / src.name).write_bytes(src.read_bytes())
    # a whole gzip stream of half the JSON: not readable (a gzip cut mid-write is read up to where it ends instead)
    import gzip
    text = gzip.decompress(src.read_bytes())
    (cut / src.name).write_bytes(gzip.compress(text[: len(text) // 2]))
    run = tmp_path / "outputs" / "rr"
    res = _servelab("run", "phase3", "--target", "local-tiny", "--run-id", "rr", "-p", f"trace_dir={good}",
                    tmp_path=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    good_page = (run / "phase3" / "report.html").read_text()
    good_nb = (run / "phase3" / "notebook.ipynb").read_text()
    res = _servelab("run", "phase3", "--target", "local-tiny", "--run-id", "rr", "-p", f"trace_dir={cut}",
                    tmp_path=tmp_path)
    assert res.returncode == 1 and res.stdout.startswith("phase3: failed — TraceFormatError"), res.stdout
    page = (run / "phase3" / "report.html").read_text()
    banner = re.search(r'<div class="servelab-later-failure".*?</div>', page, re.S)
    assert banner, "the kept page does not say a later attempt failed"
    m = json.loads((run / "manifest.json").read_text())
    e = m["phases"]["phase3"]
    assert e["status"] == "failed" and e["kept_page"]["status"] == "success" and e["failed_page"] == "report.failed-1.html"
    assert f"A later attempt at {e['ended']} failed:" in banner.group(0) and "truncated" in banner.group(0)
    assert 'href="report.failed-1.html"' in banner.group(0)
    assert page.replace(banner.group(0) + "<!-- /servelab:later-failure -->", "").replace(
        "<!-- servelab:later-failure -->", "") == good_page                 # the rest of the good page as it was
    assert (run / "phase3" / "notebook.ipynb").read_text() == good_nb    # the good notebook is back
    failed = (run / "phase3" / "report.failed-1.html").read_text()
    assert 'class="servelab-failed"' in failed and "truncated" in failed
    assert (run / "phase3" / "notebook.failed-1.ipynb").is_file()
    assert [a.get("page") for a in m["attempts"]] == [None, "phase3/report.failed-1.html"]
    index = (run / "index.html").read_text()
    assert 'href="phase3/report.html"' in index and 'href="phase3/report.failed-1.html"' in index
    # re-rendering keeps the good page good (no "This phase failed" box) and its banner
    res = _servelab("render", "rr", "phase3", tmp_path=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    page = (run / "phase3" / "report.html").read_text()
    assert 'class="servelab-later-failure"' in page and 'class="servelab-failed"' not in page
    # a second failure keeps the same good page and numbers its own
    _servelab("run", "phase3", "--target", "local-tiny", "--run-id", "rr", "-p", f"trace_dir={cut}",
              tmp_path=tmp_path)
    assert (run / "phase3" / "report.failed-2.html").is_file()
    assert 'href="report.failed-2.html"' in (run / "phase3" / "report.html").read_text()
    assert (run / "phase3" / "notebook.ipynb").read_text() == good_nb
    # a good attempt again: a fresh page, no banner
    res = _servelab("run", "phase3", "--target", "local-tiny", "--run-id", "rr", "-p", f"trace_dir={good}",
                    tmp_path=tmp_path)
    assert res.returncode == 0
    assert 'class="servelab-later-failure"' not in (run / "phase3" / "report.html").read_text()
    assert "kept_page" not in json.loads((run / "manifest.json").read_text())["phases"]["phase3"]


def _sigint_when_records_land(path: Path, min_lines: int = 1):
    """A thread that sends this process SIGINT once ``path`` holds ``min_lines`` records; returns its event."""
    import os
    import signal
    import threading
    import time
    fired = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.is_file() and path.read_text().count("\n") >= min_lines:
                fired.set()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    return fired


@pytest.mark.slow
@pytest.mark.flaky(reruns=2, reruns_delay=5)   # timing under CPU contention (2 shared cores): see pyproject
def test_ctrl_c_mid_phase8_point_keeps_its_records(tiny_server, tmp_path, sigint_raises):
    """The same for a Phase 8 hit-rate point (its own client loop: streams of requests)."""
    from servelab.measure.hit_points import HitPoint, measure_hit_point
    from servelab.measure.case_record import read_summary
    from servelab.measure.records import read_records
    from servelab.measure.workload import engine_tokenizer, token_pool
    from servelab.phases.phase8_cache import judge_hit_point
    pool = token_pool(engine_tokenizer(tiny_server.base_url, "llamacpp", "/tokenize"))
    point = HitPoint(0.5, 128, 64, 2, 16, label="H8_cc")
    path = tmp_path / "run" / "cases" / "H8_cc" / "requests.jsonl"
    fired = _sigint_when_records_land(path, 3)             # past the 2 pre-warm requests
    with pytest.raises(KeyboardInterrupt):
        judge_hit_point(measure_hit_point(tiny_server, tmp_path / "run", point, pool, seed=1))
    assert fired.is_set()
    recs = read_records(path)
    assert len(recs) >= 1 and sum(r.role == "measure" for r in recs) < 32
    s = read_summary(path.parent / "summary.json")
    assert s["status"] == "INTERRUPTED" and s["counts"]["requests"] == len(recs)
