"""The chunked streaming parse (big-file fast path) gives the same frame as a straightforward decode.

Forced on every real sample trace with tiny chunks so each file is cut at many event boundaries; compared
(1) column by column with a reference built here from plain ``json`` + ``gzip`` and (2) in full with the
whole-file typed decoder (``_parse_serial``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest
from plain import plain_trace
from polars.testing import assert_frame_equal

from servelab.analyse.trace import chunked as C, decode as D

ROOT = Path(__file__).resolve().parents[1]


def _real_traces(thirdparty: Path | None) -> list[Path]:
    """Our own captures (in the repository) and, where present, the third-party traces read in place."""
    files = sorted(ROOT.glob("data/samples/*/traces/*.trace.json.gz"))
    if thirdparty is not None:
        files += sorted(p for p in thirdparty.rglob("*.json.gz"))
    return files


def _ns(us) -> int | None:
    if isinstance(us, bool) or not isinstance(us, (int, float)):
        return None
    whole = math.floor(us)
    return int(whole) * 1000 + round((us - whole) * 1000.0)


def _reference(path: Path) -> pl.DataFrame:
    """Plain json: the core columns the analysis reads, with the loader's documented semantics."""
    doc = plain_trace(path)
    ev = doc["traceEvents"] if isinstance(doc, dict) else doc
    base = doc.get("baseTimeNanoseconds") or 0 if isinstance(doc, dict) else 0
    rows = {c: [] for c in ("ph", "cat", "name", "pid", "pid_label", "tid", "ts_ns", "dur_ns", "correlation",
                            "external_id")}
    for e in ev:
        a = e.get("args") or {}
        pid = e.get("pid")
        rows["ph"].append(e.get("ph", ""))
        rows["cat"].append(e.get("cat", ""))
        rows["name"].append(e.get("name", ""))
        rows["pid"].append(pid if isinstance(pid, int) else None)
        rows["pid_label"].append(pid if isinstance(pid, str) else None)
        rows["tid"].append(e["tid"] if isinstance(e.get("tid"), int) else None)
        ts = _ns(e.get("ts"))
        rows["ts_ns"].append(ts + base if ts is not None else None)
        rows["dur_ns"].append(_ns(e.get("dur")))
        rows["correlation"].append(a["correlation"] if isinstance(a.get("correlation"), int) else None)
        rows["external_id"].append(a["External id"] if isinstance(a.get("External id"), int) else None)
    schema = {c: (pl.String if c in ("ph", "cat", "name", "pid_label") else pl.Int64) for c in rows}
    return pl.DataFrame(rows, schema=schema)


@pytest.fixture(scope="module")
def traces(request) -> list[Path]:
    try:
        third = request.getfixturevalue("thirdparty")
    except pytest.skip.Exception:
        third = None
    files = _real_traces(third)
    if not files:
        pytest.skip("no real traces")
    return files


def test_chunked_parse_equals_reference_on_real_traces(traces: list[Path], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(C, "CHUNK_BYTES", 256 << 10)
    checked, referenced = 0, set()
    for path in traces:
        serial, meta_s = D._parse_serial(path)
        fast = C._parse_parallel(path, workers=1)
        if fast is None:      # a layout the chunker does not cut (e.g. a top-level list): serial is used
            continue
        frame, meta_f = fast
        assert frame.equals(serial), path.name
        assert meta_f == meta_s, path.name
        checked += 1
        if path.parent in referenced:         # the plain-json reference once per capture (its ranks are alike)
            continue
        referenced.add(path.parent)
        ref = _reference(path)
        got = frame.select(ref.columns).with_columns(pl.col(c).cast(pl.String) for c in ("ph", "cat", "name"))
        assert got.equals(ref), path.name
    assert checked >= 5 and len(referenced) >= 3


def test_parse_trace_uses_the_chunked_path_and_is_identical(traces: list[Path], monkeypatch: pytest.MonkeyPatch):
    """parse_trace on a 'big' file (threshold lowered) goes through the chunker in-process (workers=1)."""
    path = traces[0]
    serial, _ = D._parse_serial(path)
    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(C, "CHUNK_BYTES", 64 << 10)
    calls = []
    orig = C._parse_chunked_with
    monkeypatch.setattr(C, "_parse_chunked_with", lambda *a: calls.append(a) or orig(*a))
    frame, _ = C.parse_trace(path, workers=1)
    assert calls and frame.equals(serial)


def test_cut_inside_a_string_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A ``}, {`` inside a string makes a slice invalid JSON → the whole file goes to the serial decoder."""
    evs = [{"ph": "X", "cat": "kernel", "name": "k}, {" * 50, "pid": 0, "tid": 1, "ts": i, "dur": 1,
            "args": {"correlation": i}} for i in range(200)]
    p = tmp_path / "odd.trace.json"
    p.write_text(json.dumps({"traceEvents": evs, "baseTimeNanoseconds": 5}))
    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(C, "CHUNK_BYTES", 1 << 10)
    assert C._parse_parallel(p, workers=1) is None
    frame, _ = C.parse_trace(p, workers=1)
    assert frame.height == 200 and frame["ts_ns"].to_list()[:2] == [5, 1005]


def test_streaming_analysis_gives_the_same_tables(tmp_path: Path):
    """keep_events=False (rank by rank, events released after each) yields every table of the full analysis."""
    from servelab.analyse.trace import analyse
    from servelab.analyse.trace.actions import evidence_actions
    from servelab.analyse.trace.questions import ten_questions
    d = ROOT / "data" / "samples" / "h200x2" / "traces"
    full = analyse(d, cache_dir=tmp_path / "a")
    lean = analyse(d, cache_dir=tmp_path / "b", keep_events=False)
    for name in ("ranks", "windows", "window_metrics", "summary", "breakdown", "top_kernels", "gaps", "gap_summary",
                 "graph", "launch", "device_busy", "cpu_threads", "collective_skew", "step_skew", "pp", "nccl",
                 "interference", "census", "comm_by_collective"):
        a, b = getattr(full, name), getattr(lean, name)
        if "load_s" in a.columns:
            a, b = a.drop("load_s"), b.drop("load_s")
        # float sums of a parallel group_by may differ in the last bits between any two runs
        assert_frame_equal(a, b, check_exact=False, rel_tol=1e-9, abs_tol=1e-9)
    assert full.slow_rank == lean.slow_rank
    assert_frame_equal(ten_questions(full), ten_questions(lean), check_exact=False)
    assert_frame_equal(evidence_actions(full), evidence_actions(lean), check_exact=False)
    assert all(t.events.height == 0 for t in lean.capture.ranks)
    t0, t1 = full.capture.ranks[0], lean.capture.ranks[0]
    assert t1.reload_events().equals(t0.events)


TABLES = ("ranks", "windows", "window_metrics", "summary", "breakdown", "top_kernels", "gaps", "gap_summary",
          "graph", "launch", "device_busy", "cpu_threads", "collective_skew", "step_skew", "pp", "nccl",
          "interference", "census", "comm_by_collective", "stages", "stage_steps")


def _same_tables(a, b) -> None:
    from servelab.analyse.trace.actions import evidence_actions
    from servelab.analyse.trace.questions import ten_questions
    for name in TABLES:
        x, y = getattr(a, name), getattr(b, name)
        if "load_s" in x.columns:
            x, y = x.drop("load_s", "from_cache"), y.drop("load_s", "from_cache")
        assert_frame_equal(x, y, check_exact=False, rel_tol=1e-9, abs_tol=1e-9), name
    assert a.slow_rank == b.slow_rank
    assert_frame_equal(ten_questions(a), ten_questions(b), check_exact=False)
    assert_frame_equal(evidence_actions(a), evidence_actions(b), check_exact=False)


@pytest.mark.parametrize("sample", ["h200x2", "h200x2-pp2"])
def test_prepared_cache_gives_the_same_tables_without_reading_events(tmp_path: Path, sample: str):
    """A second analysis reads each rank's prepared tables from the cache, never its events, and every table,
    answer and action equals an analysis with no cache at all; the events are still there when asked for."""
    from servelab.analyse.trace import analyse
    d = ROOT / "data" / "samples" / sample / "traces"
    ref = analyse(d, cache=False)
    first = analyse(d, cache_dir=tmp_path)
    assert all(t.frame is not None for t in first.capture.ranks)
    second = analyse(d, cache_dir=tmp_path)
    assert all(t.from_cache and t.frame is None for t in second.capture.ranks)    # events never read
    _same_tables(ref, first)
    _same_tables(ref, second)
    streamed = analyse(d, cache_dir=tmp_path, keep_events=False)
    assert all(t.frame is None for t in streamed.capture.ranks)
    _same_tables(ref, streamed)
    t = second.capture.ranks[0]
    assert t.events.equals(ref.capture.ranks[0].events) and t.n_events is None      # read on first use
    entries = list(tmp_path.glob("*.prepared/*"))
    assert len(entries) == len(ref.capture.ranks) and all((e / "meta.json").exists() for e in entries)


def test_prepared_cache_key_follows_rules_regex_and_the_trace(tmp_path: Path):
    """Another step regex or kernel rule, a rewritten trace or an incomplete entry is never read as a hit:
    the tables are prepared again (and equal a cache-free analysis); one entry per trace is kept."""
    import os
    import shutil
    from servelab.analyse.trace import analyse
    d = tmp_path / "traces"
    shutil.copytree(ROOT / "data" / "samples" / "h200x2" / "traces", d)
    cache = tmp_path / "cache"
    analyse(d, cache_dir=cache)

    refs: dict[str, object] = {}             # the cache-free analysis per setting (the traces' content never changes)

    def hits(**kw) -> list[bool]:
        a = analyse(d, cache_dir=cache, **kw)
        key = repr(sorted(kw.items()))
        if key not in refs:
            refs[key] = analyse(d, cache=False, **kw)
        _same_tables(refs[key], a)
        return [t.frame is None for t in a.capture.ranks]

    assert hits() == [True, True]
    rule = [("communication", "AllGather", r"^ncclDevKernel_AllGather")]
    assert hits(extra_rules=rule) == [False, False] and hits(extra_rules=rule) == [True, True]
    regex = r"^(?:decode|prefill)_step"
    assert hits(window_regex=regex) == [False, False] and hits(window_regex=regex) == [True, True]
    assert all(len(list(p.iterdir())) == 1 for p in cache.glob("*.prepared"))    # the older entries removed
    assert hits() == [False, False]          # so the default key is prepared again
    f = sorted(d.glob("*.trace.json.gz"))[0]
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000_000))
    assert hits() == [False, True]            # the touched rank is parsed and prepared again
    for meta in cache.glob("*.prepared/*/meta.json"):
        meta.unlink()                        # an entry cut short before its meta.json: not a hit
    assert hits() == [False, False] and hits() == [True, True]
