"""Parsing a trace file, serially or — for big files — in parallel: the events array cut into 4 MB slices decoded by
worker processes, each slice through the compiled scanner (``_scan.c``) that writes the hot fields straight into
columns (about 3× less CPU than msgspec's typed decode plus building columns from its objects), falling back to
msgspec's typed decode (:mod:`servelab.analyse.trace.decode`) for the slices and the few events it does not take;
workers spill their slices as Arrow files. The frame is the same either way (tests).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import re
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as pa_ipc

from servelab.core import threads

try:  # ISA-L gunzip is ~1.6x faster than zlib (measured); zlib is the fallback
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover - isal is a declared dependency of the trace analyser
    import gzip as _gzip

try:  # the compiled slice scanner (setup.py); without it every slice takes the msgspec decoder (same frame)
    from servelab.analyse.trace import _scan as _native
except ImportError:  # pragma: no cover - built by `pip install -e .` wherever a C compiler is
    _native = None

from servelab.analyse.trace.decode import (GLOO_PREFIX, TraceFormatError, _CAT_COLUMNS, _COLL_FIELDS, _DECODER,
                                          _Event, _INT64_MAX, _INT64_MIN, _LIST_DECODER, _SLICE_ORDER, _events_to_frame,
                                          _finish_frame, _gloo_collective, _meta_dict, _parse_serial, _ranks_text)

PARALLEL_MIN_BYTES = 64 << 20     # JSON text size from which the chunked streaming parse is used
SPILL_GROUP = 8                   # consecutive slices a worker decodes and spills as one Arrow file
CHUNK_BYTES = 4 << 20             # JSON text per decode task: 4 MB slices cost ~25 % less CPU than 24 MB (measured,
#                                  fewer Python objects alive per process) and halve the workers' peak memory


def default_workers() -> int:
    """Worker processes for parsing: this process's share of threads (:func:`servelab.core.threads.share`: every
    usable CPU unless its starter gave it fewer — a Dask worker's share of its node). Each parse child is held to
    one thread of its own (:func:`spawn_pool`)."""
    return threads.share()


def parse_trace(path: str | Path, workers: int | None = None, executor=None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Parse one trace file (no cache). Returns (events frame, metadata dict).

    Metadata: ``baseTimeNanoseconds``, ``distributedInfo``, ``deviceProperties``, versions, and
    ``process_names`` / ``thread_names`` / ``process_labels`` from the ``ph: "M"`` events.
    Large files (≥ ``PARALLEL_MIN_BYTES`` of JSON) are gunzipped as a stream, cut at event boundaries into
    ``CHUNK_BYTES`` slices and decoded by ``workers`` processes (default: this process's share of CPUs, every
    usable one unless its starter gave fewer; in this process when 1; ``executor``: a process pool to reuse
    across files), so the whole text and all its Python
    objects never exist at once; any doubt about a cut falls back to the single-process decoder, which also
    produces the error messages.
    Raises :class:`TraceFormatError` naming the file for truncated gzip, invalid JSON, or JSON that is
    not a Chrome trace.
    """
    path = Path(path)
    workers = default_workers() if workers is None else max(1, int(workers))
    if json_size_hint(path) >= PARALLEL_MIN_BYTES:
        result = _parse_parallel(path, workers, executor)
        if result is not None:
            return result
    return _parse_serial(path)


def spawn_pool(workers: int):
    """A spawn-context process pool whose workers are up, or None when this process cannot spawn.

    Spawned workers re-import ``__main__``; a script without an ``if __name__ == "__main__":`` guard makes
    that child try to spawn again, which Python refuses with RuntimeError. We re-raise it there so the
    child stops at once, and the parent — seeing its worker die — parses serially."""
    ex = None
    try:
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        # one task per worker submitted together: the pool spawns a process per task while none is idle, so
        # all workers import at once (one task alone starts one; the next would start only when work comes);
        # each child decodes one slice at a time: its libraries get one thread (else N children × all cores)
        with threads.spawning_with(1):
            for f in [ex.submit(int, 0) for _ in range(workers)]:
                f.result()
        return ex
    except Exception:
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise
        return None


def json_size_hint(path: Path) -> int:
    """Uncompressed size: the gzip ISIZE trailer (mod 4 GiB; compressed size × 10 when it wraps), else the
    file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if f.read(2) != b"\x1f\x8b":
                return size
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
        return isize if isize >= size else size * 10
    except OSError:
        return 0


# ------------------------------------------------------------------------------- chunked (big files)
#
# Big traces are never held whole: the JSON text is gunzipped as a stream, cut into ``CHUNK_BYTES`` slices of
# the ``traceEvents`` array at ``}, {`` separators, and each slice is decoded (typed msgspec) into columns.
# With ``workers`` processes, each one streams the whole file itself and decodes its groups of ``SPILL_GROUP``
# consecutive slices, groups k, k + n, k + 2n, ... (ISA-L gunzips 1.8 GB in 0.65 s here, less than handing
# the text from a parent through pipes cost: 5 s of the parent's CPU for the same file); each group's columns
# go to an Arrow file in a private temporary folder, which the main process maps and concatenates in order.
# Only one slice of Python objects per process exists at a time. A cut that falls inside a string or nested list
# leaves a slice that is not valid JSON — detected by the decoder, and the whole file then goes to the serial
# path. The cuts depend only on the text and ``CHUNK_BYTES``, so every process cuts the same slices.

_BOUNDARY_RE = re.compile(rb"\}\s*,\s*\{")
_SEARCH_WINDOW = 64 << 10       # the last separator is searched in this much text first (×8 until found)
_HEAD_LIMIT = 64 << 20           # the "traceEvents" key must start within this much text


def _open_text(path: Path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return _gzip.open(path, "rb") if gz else open(path, "rb")


def _last_boundary(buf: bytearray) -> int | None:
    """Offset of the comma of the last ``}, {`` separator in ``buf`` (None when there is none)."""
    n = len(buf)
    window = _SEARCH_WINDOW
    while True:
        lo = max(0, n - window)
        last = None
        for last in _BOUNDARY_RE.finditer(buf, lo):  # noqa: B007 (the last match is what we want)
            pass
        if last is not None:
            return last.start() + last.group(0).index(b",")
        if lo == 0:
            return None
        window *= 8


def _stream_events(path: Path, chunk_bytes: int, submit, wanted=None) -> tuple[bytes, bytes, int] | None:
    """Stream the JSON text and cut the events array into slices; ``submit(i, b"[" + events + b"]")`` is called
    in order for each slice ``i`` that ``wanted(i)`` accepts (all when None; the others are never copied).
    Returns the text before the events array (``header``, up to its ``[``), the rest after the last slice
    (``rest``: the last events, the closing ``]`` and what follows) and the number of slices cut. None when
    the layout is not the expected one."""
    with _open_text(path) as f:
        buf = bytearray()
        while True:
            block = f.read(chunk_bytes)
            buf += block
            key = buf.find(b'"traceEvents"')
            a0 = buf.find(b"[", key) if key >= 0 else -1
            if a0 >= 0:
                break
            if not block or len(buf) > _HEAD_LIMIT:
                return None
        header = bytes(buf[:a0])
        del buf[:a0]            # the buffer always starts with the '[' of its slice
        i = 0
        while True:
            if len(buf) >= chunk_bytes:
                cut = _last_boundary(buf)
                if cut is not None:
                    if wanted is None or wanted(i):
                        buf[cut] = 0x5D                 # ',' → ']' closes this slice ...
                        with memoryview(buf) as mv:
                            data = bytes(mv[:cut + 1])
                        buf[cut] = 0x5B                 # ... and '[' opens the next one
                        submit(i, data)
                        del data
                    else:
                        buf[cut] = 0x5B
                    del buf[:cut]
                    i += 1
            block = f.read(chunk_bytes)
            if not block:
                break
            buf += block
    return header, bytes(buf[1:]), i


def _decode_chunk(data: bytes, native: bool = True) -> tuple[pl.DataFrame, list[dict]] | None:
    """One ``[...]`` slice of events → (frame without ``baseTimeNanoseconds``, metadata events); None when the
    slice is not valid JSON or needs the lenient decoder. The compiled scanner takes the slice when it can
    (``native``), msgspec otherwise: the same frame either way."""
    got = _scan_slice(data) if native and _native is not None else None
    if got is not None:
        frame, meta = got
    else:
        try:
            events = _LIST_DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        del data
        frame, meta = _events_to_frame(events, 0, categorical=True, derived=False)
        del events
    # all-null columns (most slices carry no collective / memcpy / graph rows) are dropped: the diagonal
    # concat restores them; this halves what crosses the process boundary
    return frame.select([c for c in frame.columns if frame[c].null_count() < frame.height]), meta


_EVENT_DECODER = msgspec.json.Decoder(_Event)


def _scan_slice(data: bytes) -> tuple[pl.DataFrame, list[dict]] | None:
    """The compiled scanner's columns for one slice: the same frame as :func:`_events_to_frame` (not derived,
    categorical) gives from msgspec's events, built in one Arrow conversion. The few events it marks (metadata,
    string pids, collectives) are decoded with msgspec for the pid label, the collective args and the metadata
    events. None when the scanner hands the slice back (not strict JSON, a typed field of another type)."""
    got = _native.scan(data)
    if got is None:
        return None
    n, ph_o, ph_d, cat_o, cat_d, name_o, name_d = got[:7]
    ints = dict(zip(("pid", "tid", "ts_ns", "dur_ns", "external_id", "correlation", "bytes", "graph_id"),
                    (_int_array(n, values, valid) for values, valid in zip(got[7:15], got[16:24]))))
    special = got[15]
    cols: dict[str, pa.Array] = {}
    for name, offsets, text in (("ph", ph_o, ph_d), ("cat", cat_o, cat_d), ("name", name_o, name_d)):
        cols[name] = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(text)]
                                           ).dictionary_encode()
    for name in ("pid", "tid", "ts_ns", "dur_ns", "correlation", "external_id"):
        cols[name] = ints[name]
    meta: list[dict] = []
    spans = np.frombuffer(special, dtype=np.int64).reshape(-1, 3)
    if len(spans):
        try:
            events = [_EVENT_DECODER.decode(data[a:b]) for a, b in spans[:, 1:].tolist()]
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        rows = spans[:, 0].tolist()
        for e in events:
            if e.name.startswith(GLOO_PREFIX):
                _gloo_collective(e)
        meta = [{"name": e.name, "pid": e.pid, "tid": e.tid,
                 "args": {"name": e.args.meta_name, "labels": e.args.labels}} for e in events if e.ph == "M"]
        sparse = {"pid_label": [e.pid if isinstance(e.pid, str) else None for e in events]}
        coll = list(map(attrgetter("args.coll"), events))
        if coll.count(None) < len(coll):
            sparse["coll"] = coll
            for f in _COLL_FIELDS:          # the collective args only on rows with a collective name
                raw = map(attrgetter(f"args.{f}"), events)
                if f in ("dtype", "pg_name", "pg_desc"):
                    sparse[f] = [v if c is not None and isinstance(v, str) else None for c, v in zip(coll, raw)]
                elif f == "pg_ranks":
                    sparse[f] = [None if c is None else _ranks_text(v) for c, v in zip(coll, raw)]
                else:
                    sparse[f] = [v if c is not None and v.__class__ is int and _INT64_MIN < v <= _INT64_MAX
                                 else None for c, v in zip(coll, raw)]
        for name, vals in sparse.items():
            if vals.count(None) < len(vals):
                cols[name] = _sparse_array(name, n, rows, vals)
    for name in ("bytes", "graph_id"):           # only on memcpy / memset and kernel rows (the scanner's mask)
        if ints[name].null_count < n:
            cols[name] = ints[name]
    order = [c for c in _SLICE_ORDER if c in cols]
    frame = pl.from_arrow(pa.RecordBatch.from_arrays([cols[c] for c in order], names=order))
    return frame, meta


_STRING_SPARSE = {"pid_label", "coll", "dtype", "pg_name", "pg_desc", "pg_ranks"}


def _sparse_array(name: str, n: int, rows: list[int], vals: list) -> pa.Array:
    """``vals`` at ``rows``, null elsewhere, as an Arrow column of ``n`` rows (strings dictionary-encoded; only
    the categorical columns stay so)."""
    valid = np.zeros(n, dtype=bool)
    at = np.asarray(rows, dtype=np.int64)
    present = np.array([v is not None for v in vals], dtype=bool)
    valid[at[present]] = True
    if name in _STRING_SPARSE:
        uniq = list(dict.fromkeys(v for v in vals if v is not None))
        code = {v: i for i, v in enumerate(uniq)}
        idx = np.zeros(n, dtype=np.int32)
        idx[at[present]] = [code[v] for v in vals if v is not None]
        col = pa.DictionaryArray.from_arrays(pa.array(idx, mask=~valid), pa.array(uniq, type=pa.string()))
        return col if name in _CAT_COLUMNS else col.dictionary_decode()
    arr = np.zeros(n, dtype=np.int64)
    arr[at[present]] = [v for v in vals if v is not None]
    return pa.array(arr, mask=~valid)


def _int_array(n: int, values: bytes, valid: bytes) -> pa.Array:
    """The scanner's int64 column and its validity bitmap as an Arrow array (no copy)."""
    return pa.Array.from_buffers(pa.int64(), n, [pa.py_buffer(valid), pa.py_buffer(values)])


def _decode_share(path: str, chunk_bytes: int, k: int, n: int, spill: str | None = None,
                  group_of: int = SPILL_GROUP) -> tuple[Any, list] | None:
    """Worker (or this process when n == 1): stream the whole file and decode its groups of ``group_of``
    consecutive slices: groups k, k + n, ...

    Returns (the trace's top-level fields as ``_Trace`` when k == 0, else None; [(slice index, (frame, metadata
    events))]), or None when the layout is not the expected one or a slice needs the lenient decoder.
    ``spill``: a folder; each group's frame is written there as Arrow IPC at once and its file name stands in
    for the frame (a worker then holds one group at a time and returns a few kB instead of pickling its
    share of the columns through a pipe at the end). When a write fails (a full or small temp folder), the
    worker keeps its frames in memory from then on and returns them."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        parts: list = []
        group: list = []            # spill: decoded slices of the current group, not yet written
        spilling = [spill is not None]

        def flush() -> None:
            frame = pl.concat([g[1][0] for g in group], how="diagonal_relaxed")
            meta = [m for g in group for m in g[1][1]]
            if spilling[0]:
                f = os.path.join(spill, f"{group[0][0]:07d}.arrow")
                try:
                    frame.write_ipc(f, compression="uncompressed")
                    frame = f
                except (OSError, pl.exceptions.PolarsError):
                    spilling[0] = False
                    Path(f).unlink(missing_ok=True)
            parts.append((group[0][0], (frame, meta)))
            group.clear()

        def decoded(i: int, data: bytes) -> None:
            got = _decode_chunk(data)
            if spill is None or got is None:
                parts.append((i, got))
                return
            if group and group[0][0] // group_of != i // group_of:
                flush()
            group.append((i, got))

        got = _stream_events(Path(path), chunk_bytes, decoded, wanted=lambda i: (i // group_of) % n == k)
        if got is None:
            return None
        header, rest, count = got
        b1 = rest.rfind(b"]")
        trace = None
        for _ in range(4):  # the tail may hold ']' inside strings: the metadata decode decides
            if b1 < 0:
                return None
            try:
                trace = _DECODER.decode(header + b"[]" + rest[b1 + 1:])
                break
            except (msgspec.DecodeError, msgspec.ValidationError):
                b1 = rest.rfind(b"]", 0, b1)
        if trace is None:
            return None
        if (count // group_of) % n == k and rest[:b1].strip():
            decoded(count, b"[" + rest[:b1] + b"]")
        if group:
            flush()
        if any(p is None for _, p in parts):
            return None
        return (trace if k == 0 else None), parts
    finally:
        if gc_was:
            gc.enable()


def _parse_parallel(path: Path, workers: int, executor=None) -> tuple[pl.DataFrame, dict[str, Any]] | None:
    """Chunked streaming parse (see above) with ``workers`` decoding processes (``executor`` when given, a
    spawn pool otherwise; in-process when workers == 1 or no process can be spawned). None → use the serial
    path (which also produces the error messages)."""
    if executor is not None or workers <= 1:
        return _parse_chunked_with(executor, path, workers)
    ex = spawn_pool(workers)
    if ex is None:
        return _parse_chunked_with(None, path, 1)
    with ex:
        return _parse_chunked_with(ex, path, workers)


_SPILL_PREFIX = "servelab-parse-"


def _spill_dir() -> str:
    """A private temporary folder for the workers' slices, named with this process's id; folders left by a
    process that no longer exists (killed before its clean-up ran) are removed first."""
    root = Path(tempfile.gettempdir())
    for d in root.glob(f"{_SPILL_PREFIX}*-*"):
        pid = d.name[len(_SPILL_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and d.is_dir() and d.stat().st_uid == os.getuid():
            shutil.rmtree(d, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_SPILL_PREFIX}{os.getpid()}-")


def _parse_chunked_with(ex, path: Path, workers: int) -> tuple[pl.DataFrame, dict[str, Any]] | None:
    n = max(1, workers) if ex is not None else 1
    spill = _spill_dir() if ex is not None else None
    try:
        try:
            if ex is None:
                shares = [_decode_share(str(path), CHUNK_BYTES, 0, 1)]
            else:
                futs = [ex.submit(_decode_share, str(path), CHUNK_BYTES, k, n, spill, SPILL_GROUP) for k in range(n)]
                shares = [f.result() for f in futs]
        except TraceFormatError:
            raise
        except Exception:  # corrupt gzip, a worker died (e.g. out of memory): the serial path decides
            return None
        if any(s is None for s in shares):
            return None
        trace = shares[0][0]
        parts = sorted((p for s in shares for p in s[1]), key=lambda p: p[0])
        del shares
        if parts:
            if spill:
                # memory-mapped Arrow reads and one conversion (polars' read_ipc per file took 4× as long), not
                # copied into one chunk per column (0.3 s): the frame's columns stay on the mapped files, each
                # unlinked once mapped, so their pages go when the frame goes (not now, in the parse's time)
                tables = []
                for _, (got, _) in parts:
                    if isinstance(got, str):
                        tables.append(pa_ipc.open_file(pa.memory_map(got)).read_all())
                        os.unlink(got)
                    else:
                        tables.append(got.to_arrow())
                table = pa.concat_tables(tables, promote_options="default")
                del tables
                frame = _finish_frame(pl.from_arrow(table, rechunk=False))
                del table
            else:
                frame = _finish_frame(pl.concat([p[1][0] for p in parts], how="diagonal_relaxed", rechunk=True))
        else:
            frame, _ = _events_to_frame([], 0)
    finally:
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    base_ns = int(trace.baseTimeNanoseconds or 0)
    if base_ns:
        frame = frame.with_columns(pl.col("ts_ns") + base_ns)
    meta_events = [m for p in parts for m in p[1][1]]
    return frame, _meta_dict(trace, meta_events)
