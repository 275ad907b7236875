"""Loader: real traces → frame, rank identity, Parquet cache, errors that name the file.

Ground truth is computed here with plain json + gzip, never with the code under test."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from plain import plain_trace

from servelab.analyse.trace import chunked as C, decode as D, load as L
from servelab.analyse.trace.chunked import parse_trace
from servelab.analyse.trace.decode import TraceFormatError
from servelab.analyse.trace.identity import identity_from_name
from servelab.analyse.trace.load import load_capture, load_trace

TP0 = "20261129203606-TP-0.trace.json.gz"
TP1 = "20261129203606-TP-1.trace.json.gz"


def _events(path: Path) -> tuple[dict, list[dict]]:
    doc = plain_trace(path)
    return doc, doc["traceEvents"]


@pytest.fixture(scope="module")
def h200_dir(h200x2: Path) -> Path:
    return h200x2 / "traces"


def test_h200_frame_matches_plain_json(h200_dir: Path, tmp_path: Path):
    path = h200_dir / TP0
    doc, ev = _events(path)
    t = load_trace(path, cache_dir=tmp_path)
    df = t.events
    assert df.height == len(ev)
    # category counts
    want = Counter(e.get("cat", "") for e in ev)
    got = dict(df.group_by("cat").len().with_columns(pl.col("cat").cast(pl.String)).iter_rows())
    assert got == {k: v for k, v in want.items()}
    # absolute int64 ns timestamps: base + round(ts * 1000) for every kernel
    base = doc["baseTimeNanoseconds"]
    kern = [e for e in ev if e.get("cat") == "kernel"]
    want_ts = sorted(base + round(e["ts"] * 1000) for e in kern)
    got_ts = df.filter(pl.col("cat") == "kernel")["ts_ns"].sort().to_list()
    assert got_ts == want_ts
    want_dur = sum(round(e["dur"] * 1000) for e in kern)
    assert df.filter(pl.col("cat") == "kernel")["dur_ns"].sum() == want_dur
    # collective args on NCCL kernels (eager ones carry them, graph-replayed ones do not)
    nccl_args = [e["args"] for e in kern if "Collective name" in e["args"]]
    got_coll = df.filter((pl.col("cat") == "kernel") & pl.col("coll").is_not_null())
    assert got_coll.height == len(nccl_args) > 0
    assert got_coll["in_nelems"].sum() == sum(a["In msg nelems"] for a in nccl_args)
    assert set(got_coll["dtype"].cast(pl.String).to_list()) == {a["dtype"] for a in nccl_args}
    assert set(got_coll["pg_ranks"].to_list()) == {a["Process Group Ranks"] for a in nccl_args}
    # correlation and external id of kernels
    assert sorted(df.filter(pl.col("cat") == "kernel")["correlation"].to_list()) == \
        sorted(e["args"]["correlation"] for e in kern)
    # string pids ("Spans", "Traces", "") kept as labels, ints elsewhere
    str_pids = Counter(e["pid"] for e in ev if isinstance(e.get("pid"), str))
    assert dict(Counter(df["pid_label"].drop_nulls().to_list())) == dict(str_pids)
    # metadata and identity
    assert t.meta["distributedInfo"]["world_size"] == 2
    assert t.meta["baseTimeNanoseconds"] == base
    assert t.identity.rank == 0 and t.identity.tp == 0 and t.identity.engine == "sglang"
    assert t.meta["process_labels"]["0"] == "GPU 0"


def test_epoch_microsecond_trace_is_exact(thirdparty: Path, tmp_path: Path):
    """HTA sampled rank: integer epoch-µs timestamps (> 2**53 ns) must stay exact."""
    path = thirdparty / "hta/trace_filter/sampled_rank-1.json.gz"
    _, ev = _events(path)
    df = load_trace(path, cache_dir=tmp_path).events
    kern = [e for e in ev if e.get("cat") == "kernel"]
    assert sorted(df.filter(pl.col("cat") == "kernel")["ts_ns"].to_list()) == sorted(e["ts"] * 1000 for e in kern)


def test_capture_identity_and_cache(h200_dir: Path, tmp_path: Path):
    cap = load_capture(h200_dir, cache_dir=tmp_path)
    assert [t.rank for t in cap.ranks] == [0, 1]
    ids = cap.identities()
    assert ids["tp"].to_list() == [0, 1] and ids["profile_id"].to_list() == ["20261129203606"] * 2
    assert not any(t.from_cache for t in cap.ranks)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(f.endswith(".parquet") for f in files)
    again = load_capture(h200_dir, cache_dir=tmp_path)
    assert all(t.from_cache for t in again.ranks)
    assert again.ranks[0].events.equals(cap.ranks[0].events)
    assert again.ranks[1].meta == cap.ranks[1].meta


def test_cache_next_to_trace_and_invalidation(h200_dir: Path, tmp_path: Path):
    src = tmp_path / "cap"
    src.mkdir()
    p = src / TP1
    shutil.copyfile(h200_dir / TP1, p)
    first = load_trace(p)
    assert not first.from_cache and first.cache_path.parent == src / L.CACHE_DIRNAME
    assert load_trace(p).from_cache
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 1_000_000_000))   # touched → stale
    assert not load_trace(p).from_cache


def test_read_only_folder_caches_elsewhere(h200_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A read-only trace folder: the cache goes to the user cache dir, never next to the trace."""
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "usercache"))
    if h200_dir.stat().st_mode & 0o222:
        pytest.skip("the shared trace folder is not marked read-only here")
    t = load_trace(h200_dir / TP0)
    assert t.cache_path is not None and str(t.cache_path).startswith(str(tmp_path / "usercache"))
    assert not (h200_dir / L.CACHE_DIRNAME).exists()


@pytest.mark.parametrize("name, want", [
    ("1732000000.123-TP-3.trace.json.gz", dict(tp=3, dp=None, pp=None, ep=None, engine="sglang")),
    ("myrun-1732000000.1-TP-2-DP-1-PP-1-EP-5.trace.json.gz", dict(tp=2, dp=1, pp=1, ep=5, engine="sglang")),
    ("1732000000.1-TP-0-PP-1-decode.trace.json.gz", dict(tp=0, pp=1, stage="decode", engine="sglang")),
    ("1732000000.1-TP-7-DECODE.trace.json.gz", dict(tp=7, stage="decode")),
    ("rank3.1732000000123456789.pt.trace.json.gz", dict(rank=3, engine="vllm", profile_id="1732000000123456789")),
    ("dp0_pp1_tp2.1732000000123.pt.trace.json.gz", dict(dp=0, pp=1, tp=2, engine="vllm")),
    ("host.async_llm.1732000000123.pt.trace.json.gz", dict(role="frontend")),
])
def test_identity_from_file_names(name: str, want: dict):
    ident = identity_from_name(name)
    for k, v in want.items():
        assert getattr(ident, k) == v, (k, getattr(ident, k))


def test_vllm_folder_with_frontend(h200_dir: Path, tmp_path: Path):
    """A vLLM-style folder: rank traces load as ranks, the async_llm frontend trace is only listed."""
    d = tmp_path / "vllm"
    d.mkdir()
    shutil.copyfile(h200_dir / TP0, d / "rank0.1790000000000000001.pt.trace.json.gz")
    shutil.copyfile(h200_dir / TP1, d / "rank1.1790000000000000002.pt.trace.json.gz")
    (d / "api.async_llm.1790000000000000003.pt.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": []}'))
    cap = load_capture(d, cache=False)
    assert [t.rank for t in cap.ranks] == [0, 1]
    assert [f.role for f in cap.frontend] == ["frontend"]
    assert "frontend" in cap.identities()["role"].to_list()


def test_two_captures_in_one_folder_need_a_profile_id(h200_dir: Path, tmp_path: Path):
    d = tmp_path / "two"
    d.mkdir()
    shutil.copyfile(h200_dir / TP0, d / "111-TP-0.trace.json.gz")
    shutil.copyfile(h200_dir / TP0, d / "222-TP-0.trace.json.gz")
    with pytest.raises(TraceFormatError, match="profile_id"):
        load_capture(d, cache=False)
    assert [t.path.name for t in load_capture(d, cache=False, profile_id="222").ranks] == ["222-TP-0.trace.json.gz"]


def test_per_node_subfolders_set_the_node(h200_dir: Path, tmp_path: Path):
    for node, f in (("nodeA", TP0), ("nodeB", TP1)):
        (tmp_path / node).mkdir()
        shutil.copyfile(h200_dir / f, tmp_path / node / f)
    cap = load_capture(tmp_path, cache=False)
    assert [t.identity.node for t in cap.ranks] == ["nodeA", "nodeB"]


# ------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("frac", [0.02, 0.3, 0.75, 0.999])
def test_a_gzip_cut_mid_write_is_read_up_to_where_it_ends(h200_dir: Path, tmp_path: Path, frac: float):
    """A profiler killed mid-write: the stream cut at a byte offset. The events read are exactly the whole events
    of the text the cut stream holds (ground truth: zlib + json here, cut at the last whole event by hand), in
    order; the metadata says it is truncated and how much was read."""
    import zlib
    raw = (h200_dir / TP0).read_bytes()
    bad = tmp_path / "cut-TP-0.trace.json.gz"
    bad.write_bytes(raw[: int(len(raw) * frac)])
    text = zlib.decompressobj(wbits=31).decompress(bad.read_bytes())
    start = text.index(b"[", text.index(b'"traceEvents"'))
    whole = json.loads(text[: text.rindex(b"\n  },\n  {") + 4] + b"]}") if text.count(b"\n  },\n  {", start) \
        else None
    frame, meta = parse_trace(bad, workers=1)
    assert meta["truncated"]["compressed_bytes"] == len(bad.read_bytes())
    assert meta["truncated"]["json_bytes"] == len(text)
    want = whole["traceEvents"]
    assert frame.height == meta["truncated"]["events_read"] == len(want) > 0
    assert frame["name"].cast(pl.String).to_list() == [str(e.get("name", "")) for e in want]
    full, _ = parse_trace(h200_dir / TP0, workers=1)
    assert frame.height < full.height


def test_a_gzip_cut_before_any_event_names_the_file(h200_dir: Path, tmp_path: Path):
    raw = (h200_dir / TP0).read_bytes()
    bad = tmp_path / "cut-TP-0.trace.json.gz"
    bad.write_bytes(raw[:300])
    with pytest.raises(TraceFormatError) as e:
        parse_trace(bad, workers=1)
    assert str(bad) in str(e.value) and "truncated" in str(e.value)


def test_truncated_json_names_the_file(h200_dir: Path, tmp_path: Path):
    text = gzip.decompress((h200_dir / TP0).read_bytes())
    bad = tmp_path / "halfjson.json.gz"
    bad.write_bytes(gzip.compress(text[: len(text) // 2]))
    with pytest.raises(TraceFormatError) as e:
        parse_trace(bad, workers=1)
    assert str(bad) in str(e.value) and "JSON" in str(e.value)


def test_not_json_names_the_file(tmp_path: Path):
    bad = tmp_path / "notes.json"
    bad.write_text("this is a log file, not a trace\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(bad, cache=False)
    assert str(bad) in str(e.value)


def test_json_without_trace_events_names_the_file(tmp_path: Path):
    bad = tmp_path / "config.json.gz"
    bad.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "model": "x"}).encode()))
    with pytest.raises(TraceFormatError) as e:
        load_trace(bad, cache=False)
    assert str(bad) in str(e.value) and "traceEvents" in str(e.value)


def test_empty_file_and_missing_folder(tmp_path: Path):
    empty = tmp_path / "empty.json"
    empty.write_text("   ")
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(empty, cache=False)
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_capture(tmp_path / "nowhere")
    (tmp_path / "nothing_here").mkdir()
    with pytest.raises(TraceFormatError, match="no \\*.json"):
        load_capture(tmp_path / "nothing_here")


def test_lenient_path_for_odd_types(tmp_path: Path):
    """A trace whose ids are strings does not fit the typed decoder; the lenient path still loads it."""
    doc = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10.5, "dur": 2.25,
         "args": {"correlation": "12", "stream": 7, "device": 0}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": 5, "ts": 9.0, "dur": 1.0,
         "args": {"correlation": 12}}]}
    p = tmp_path / "odd.json"
    p.write_text(json.dumps(doc))
    df, _ = parse_trace(p, workers=1)
    k = df.filter(pl.col("cat") == "kernel").row(0, named=True)
    assert k["correlation"] == 12 and k["ts_ns"] == 10_500 and k["dur_ns"] == 2_250


@pytest.mark.slow                  # a pool of two parse worker processes (spawned: each imports the loader)
def test_chunked_parallel_parse_equals_serial(h200_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The multi-process path (forced on a small file with small chunks) gives the serial frame."""
    path = h200_dir / TP1
    serial, meta_s = D._parse_serial(path)
    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(C, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(C, "SPILL_GROUP", 2)     # several groups of slices per worker, interleaved
    assert C.json_size_hint(path) >= 8 << 20, "the sample is too small to give each worker two groups"
    spills = lambda: set(Path(tempfile.gettempdir()).glob(f"{C._SPILL_PREFIX}{os.getpid()}-*"))  # noqa: E731
    before = spills()
    par = C._parse_parallel(path, workers=2)
    assert par is not None, "parallel parse fell back"
    frame, meta_p = par
    assert frame.equals(serial)
    assert meta_p == meta_s
    assert spills() == before, "the workers' slice folder was left behind"


@pytest.mark.slow                  # a pool of two parse worker processes
def test_workers_keep_their_columns_when_the_temp_folder_cannot_take_them(h200_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path):
    """A spill write that fails (here: the folder does not exist; on a node, a full or small /tmp) is not a
    parse failure: the workers return their columns through the pool instead, same frame."""
    path = h200_dir / TP1
    serial, _ = D._parse_serial(path)
    monkeypatch.setattr(C, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(C, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(C, "SPILL_GROUP", 2)
    monkeypatch.setattr(C, "_spill_dir", lambda: str(tmp_path / "gone" / "servelab-parse-x"))
    par = C._parse_parallel(path, workers=2)
    assert par is not None, "the parse fell back to the serial path"
    assert par[0].equals(serial)


def test_a_slice_folder_left_by_a_dead_process_is_removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A parse killed before its clean-up leaves its folder; the next parse removes it (its pid is gone), and
    leaves a live process's folder alone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f"{C._SPILL_PREFIX}{dead}-x1"
    live = tmp_path / f"{C._SPILL_PREFIX}{os.getpid()}-x2"
    for d in (stale, live):
        d.mkdir()
        (d / "0000000.arrow").write_bytes(b"x")
    mine = Path(C._spill_dir())
    assert not stale.exists() and live.exists() and mine.parent == tmp_path


def test_merged_and_graph_capture_files_are_set_aside(h200_dir: Path, tmp_path: Path):
    d = tmp_path / "sg"
    (d / "graph_capture_profile").mkdir(parents=True)
    shutil.copyfile(h200_dir / TP0, d / TP0)
    shutil.copyfile(h200_dir / TP1, d / "graph_capture_profile" / "cuda_graph_capture-decode-TP-1.json.gz")
    shutil.copyfile(h200_dir / TP1, d / "merged-20261129203606.trace.json.gz")
    cap = load_capture(d, cache=False)
    assert [t.path.name for t in cap.ranks] == [TP0]
    assert cap.skipped == ["merged-20261129203606.trace.json.gz"]
    only = tmp_path / "merged_only"
    only.mkdir()
    shutil.copyfile(h200_dir / TP1, only / "merged-1.trace.json.gz")
    with pytest.raises(TraceFormatError, match="per-rank"):
        load_capture(only, cache=False)


def test_non_trace_json_in_the_folder_is_set_aside(h200_dir: Path, tmp_path: Path):
    d = tmp_path / "case"
    d.mkdir()
    shutil.copyfile(h200_dir / TP0, d / TP0)
    (d / "capture.json").write_text(json.dumps({"tp": 2, "pp": 1}))
    cap = load_capture(d, cache=False)
    assert [t.path.name for t in cap.ranks] == [TP0] and cap.skipped == ["capture.json"]


def test_a_truncated_rank_is_analysed_and_weakens_the_answers_while_the_other_is_whole(h200_dir: Path,
                                                                                       tmp_path: Path):
    """A capture whose rank 0 was cut mid-write (60 % of its gzip bytes) and whose rank 1 is whole: both ranks
    analysed; rank 1 exactly as alone; rank 0 marked truncated with its events and steps read; every answered
    question says the truncated rank weakens it; trace_analysis.json lists it."""
    from servelab.analyse.trace.analysis import analyse, write_tables
    from servelab.analyse.trace.questions import ten_questions
    cap = tmp_path / "cap"
    cap.mkdir()
    raw = (h200_dir / TP0).read_bytes()
    (cap / TP0).write_bytes(raw[: int(len(raw) * 0.6)])
    shutil.copyfile(h200_dir / TP1, cap / TP1)
    a = analyse(cap, cache_dir=tmp_path / "c")
    ranks = {r["rank"]: r for r in a.ranks.to_dicts()}
    assert ranks[0]["truncated"] is True and ranks[1]["truncated"] is False
    whole1, _ = parse_trace(h200_dir / TP1, workers=1)
    assert ranks[1]["events"] == whole1.height
    assert 0 < ranks[0]["events"] < parse_trace(h200_dir / TP0, workers=1)[0].height
    r0, r1 = (next(r for r in a.rops if r.rank == k) for k in (0, 1))
    steps0, seen0 = r0.steps_read, r0.windows.height
    assert 0 < steps0 < seen0 and r1.steps_read == r1.windows.height    # rank 0's later steps lost their kernels
    q = ten_questions(a)
    answered = q.filter(pl.col("answerable"))
    assert answered.height > 0
    want = f"rank 0's trace {TP0} is truncated (cut mid-write): analysed up to where it ends, " \
           f"{ranks[0]['events']} events and {steps0} of {seen0} steps read"
    assert all(want in e for e in answered["evidence"].to_list())
    out = tmp_path / "tables"
    out.mkdir()
    write_tables(a, out)
    summary = json.loads((out / "trace_analysis.json").read_text())
    assert summary["truncated"][TP0]["steps_read"] == steps0
    assert summary["truncated"][TP0]["events_read"] == ranks[0]["events"]
