"""Kineto (PyTorch profiler) Chrome-trace JSON(.gz) per rank → one columnar polars frame.

Measured choice: ISA-L gunzip, the events array cut into 4 MB slices decoded by parallel workers; each slice
goes through a compiled scanner (``_scan.c``) that writes the hot fields straight into columns (about 3× less
CPU than msgspec's typed decode plus building columns from its objects), and falls back to msgspec's typed
decode for the slices and the few events it does not take; the frame is the same either way (tests). Cached as
zstd Parquet. A lenient decoder (plain objects) takes over when a trace uses unexpected types for the few
typed fields.

Frame columns (one row per trace event; nulls where the event has no such field):

=============  =======  ===========================================================================
ph, cat, name  cat      Chrome-trace phase, Kineto category (``kernel``, ``cuda_runtime``, ...), name
pid, tid       Int64    process / thread (GPU events: pid = device, tid = stream); null if a string
pid_label      str      the pid when it is a string (SGLang merged traces, ``Spans``)
ts_ns, dur_ns  Int64    absolute start (``baseTimeNanoseconds`` + ts) and duration, integer ns
device,stream  Int64    ``args.device`` / ``args.stream`` (GPU ops)
correlation    Int64    runtime API ↔ GPU op link (``ac2g`` flow ids repeat it); ``external_id`` GPU op ↔ CPU op
coll, dtype    cat      ``Collective name`` / ``dtype`` args (torch c10d collectives and their kernels)
in_nelems ...  Int64    ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``Seq``
pg_name,pg_desc cat     ``Process Group Name`` / ``Process Group Description``
pg_ranks       str      ``Process Group Ranks`` (list or string in the trace; kept as text)
bytes          Int64    memcpy / memset bytes
graph_id       Int64    ``graph id`` kernel arg (Kineto ≥ 2026-02, CUDA ≥ 12)
=============  =======  ===========================================================================
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as pa_ipc
import pyarrow.parquet as pq

try:  # ISA-L gunzip is ~1.6x faster than zlib (measured); zlib is the fallback
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover - isal is a declared dependency of the trace analyser
    import gzip as _gzip

try:  # the compiled slice scanner (setup.py); without it every slice takes the msgspec decoder (same frame)
    from servelab.analyse.trace import _scan as _native
except ImportError:  # pragma: no cover - built by `pip install -e .` wherever a C compiler is
    _native = None

from servelab.core.paths import cache_root
from servelab.deploy.engines import engine_for, trace_identity, trace_name_hints, trace_skip_dirs
from servelab.deploy.engines.base import name_rank_tokens

PARSER_VERSION = 2                        # 2: gloo collectives carry their collective args
CACHE_DIRNAME = ".servelab_cache"
_MISSING_INT = -(2**63)  # sentinel of absent integer fields (ids can legitimately be -1)
_MISSING_F = float("-inf")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_US = 9.2e15                         # µs: beyond this, ns overflow int64


class TraceFormatError(ValueError):
    """A file that is not a readable Kineto/Chrome trace; the message names the file."""


# ----------------------------------------------------------------------------------------- decoding

class _Args(msgspec.Struct, frozen=True, gc=False):
    # typed: present on most events; a wrong type here sends the file to the (slow) lenient decoder
    external_id: int = msgspec.field(default=_MISSING_INT, name="External id")
    correlation: int = _MISSING_INT
    coll: str | None = msgspec.field(default=None, name="Collective name")
    # untyped: rare fields whose type varies between writers (e.g. ``bytes`` as a string); checked on use
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    group_size: Any = msgspec.field(default=None, name="Group size")
    dtype: Any = None
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    pg_desc: Any = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    seq: Any = msgspec.field(default=None, name="Seq")
    bytes: Any = None
    graph_id: Any = msgspec.field(default=None, name="graph id")
    meta_name: Any = msgspec.field(default=None, name="name")      # ph "M" process/thread names
    labels: Any = None                                              # ph "M" process_labels
    input_dims: Any = msgspec.field(default=None, name="Input Dims")    # record_shapes: read for gloo collectives
    input_type: Any = msgspec.field(default=None, name="Input type")


_EMPTY_ARGS = _Args()

GLOO_PREFIX = "gloo:"      # torch's gloo backend: one annotation per collective on its worker thread
_GLOO_TYPES = {"long int": "long", "int": "int", "float": "float", "double": "double", "c10::BFloat16": "bfloat16",
               "c10::Half": "half", "unsigned char": "uint8", "signed char": "int8", "bool": "bool", "short int": "short"}


def _gloo_collective(e: "_Event") -> None:
    """A ``gloo:<collective>`` annotation (torch's CPU collectives: ``gloo:all_reduce``, ``gloo:all_gather``,
    ``gloo:broadcast``, ``gloo:send``...) carries its tensor's ``Input Dims`` / ``Input type`` but no ``Collective
    name``: give it the collective args a c10d/NCCL event has (collective, elements of its first input, dtype), in
    place, so the communication analysis reads CPU-only captures like GPU ones."""
    a = e.args
    if a.coll is not None:
        return
    dims = a.input_dims[0] if isinstance(a.input_dims, list) and a.input_dims else None
    nelems = None
    if isinstance(dims, list) and all(v.__class__ is int for v in dims):
        nelems = 1
        for v in dims:
            nelems *= v
    ty = a.input_type[0] if isinstance(a.input_type, list) and a.input_type else None
    e.args = msgspec.structs.replace(a, coll=e.name[len(GLOO_PREFIX):], in_nelems=nelems,
                                     dtype=_GLOO_TYPES.get(ty, ty) if isinstance(ty, str) else None)


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = _MISSING_INT
    tid: int | str = _MISSING_INT
    ts: float = _MISSING_F
    dur: float = _MISSING_F
    args: _Args = _EMPTY_ARGS       # (flow events' "id" repeats the correlation: not decoded)


class _Trace(msgspec.Struct):
    traceEvents: list[_Event] | None = None
    baseTimeNanoseconds: int | None = None
    distributedInfo: Any = None
    deviceProperties: Any = None
    schemaVersion: Any = None
    traceName: Any = None
    trace_id: Any = None
    cuda_runtime_version: Any = None
    hip_runtime_version: Any = None
    cuda_driver_version: Any = None


_DECODER = msgspec.json.Decoder(_Trace)
_LIST_DECODER = msgspec.json.Decoder(list[_Event])
_LENIENT = msgspec.json.Decoder()

_INT_ARG_FIELDS = {  # column → (args key) for the lenient path
    "external_id": "External id", "correlation": "correlation", "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems", "group_size": "Group size",  # noqa: E501
    "seq": "Seq", "bytes": "bytes", "graph_id": "graph id",
}
_STR_ARG_FIELDS = {"coll": "Collective name", "dtype": "dtype", "pg_name": "Process Group Name",
                   "pg_desc": "Process Group Description"}
_CAT_COLUMNS = ("ph", "cat", "name", "coll", "dtype", "pg_name", "pg_desc")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
COLUMNS = ("ph", "cat", "name", "pid", "pid_label", "tid", "ts_ns", "dur_ns", "device", "stream", "correlation",
           "external_id", "coll", "in_nelems", "out_nelems", "group_size", "dtype", "pg_name",
           "pg_desc", "pg_ranks", "seq", "bytes", "graph_id")


def _read_bytes(path: Path) -> bytes:
    """The file's JSON text (gunzipped when it starts with the gzip magic)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read trace file ({e.strerror or e})") from e
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return _gzip.decompress(raw)
    except (EOFError, OSError, zlib.error, ValueError) as e:
        msg = str(e) or type(e).__name__
        raise TraceFormatError(f"{path}: gzip stream is truncated or corrupt ({msg})") from e
    except Exception as e:  # isal raises its own error type on corrupt streams
        raise TraceFormatError(f"{path}: gzip stream is truncated or corrupt ({e})") from e


def _us_to_ns(ts_us: np.ndarray) -> np.ndarray:
    """µs floats → int64 ns, exact for integer µs even beyond 2**53 ns (epoch-µs traces)."""
    whole = np.floor(ts_us)
    return whole.astype(np.int64) * 1000 + np.rint((ts_us - whole) * 1000.0).astype(np.int64)


def _int_column(values: list, name: str) -> pl.Series:
    """Python ints (``_MISSING_INT`` = absent) → Int64 series; strings, floats and bools → null. Polars builds
    the column from the list directly (4× faster than ``np.fromiter``); a list holding anything but ints takes
    the non-strict build, which turns those into nulls."""
    try:
        s = pl.Series(name, values, dtype=pl.Int64)
    except (TypeError, OverflowError, pl.exceptions.PolarsError):
        s = pl.Series(name, [v if v.__class__ is int and _INT64_MIN <= v <= _INT64_MAX else None for v in values],
                      dtype=pl.Int64)
    missing = s == _MISSING_INT
    return s.set(missing, None) if missing.any() else s


def _float_ns_column(values: list, name: str) -> pl.Series:
    """µs floats (``-inf`` = absent) → Int64 ns; a value beyond the int64 ns range (±292 years) is absent too."""
    arr = pl.Series(values, dtype=pl.Float64).to_numpy()
    missing = ~(np.abs(arr) < _MAX_US)
    s = pl.Series(name, _us_to_ns(np.where(missing, 0.0, arr) if missing.any() else arr))
    return s.set(pl.Series(missing), None) if missing.any() else s


def _str_column(values: list, name: str) -> pl.Series:
    return pl.Series(name, values, dtype=pl.String)


# the column order of one slice's frame, as _events_to_frame makes it
_SLICE_ORDER = ("ph", "cat", "name", "pid", "tid", "ts_ns", "dur_ns", "correlation", "external_id", "coll", "pid_label",
                "in_nelems", "out_nelems", "group_size", "dtype", "pg_name", "pg_desc", "pg_ranks", "seq", "bytes",
                "graph_id")
_COLL_FIELDS = ("in_nelems", "out_nelems", "group_size", "dtype", "pg_name", "pg_desc", "pg_ranks", "seq")


def _events_to_frame(events: list[_Event], base_ns: int, categorical: bool = True, derived: bool = True
                     ) -> tuple[pl.DataFrame, list[dict]]:
    """Typed events → frame; also returns the ``ph == "M"`` metadata events as dicts (``derived=False``: without
    the ``device`` / ``stream`` columns, which :func:`_finish_frame` derives from pid / tid).

    Only the fields present on most events are extracted for every event (one C-level ``map`` each);
    collective args, bytes and graph ids are gathered for the few rows that carry them.
    """
    from operator import attrgetter as ag
    n = len(events)
    cols: dict[str, pl.Series] = {
        "ph": _str_column(list(map(ag("ph"), events)), "ph"),
        "cat": _str_column(list(map(ag("cat"), events)), "cat"),
        "name": _str_column(list(map(ag("name"), events)), "name"),
    }
    for i in cols["name"].str.starts_with(GLOO_PREFIX).arg_true().to_list():
        _gloo_collective(events[i])
    pid_raw = list(map(ag("pid"), events))
    cols["pid"] = _int_column(pid_raw, "pid")
    cols["tid"] = _int_column(list(map(ag("tid"), events)), "tid")
    ts_ns = _float_ns_column(list(map(ag("ts"), events)), "ts_ns")
    cols["ts_ns"] = ts_ns + base_ns if base_ns else ts_ns
    cols["dur_ns"] = _float_ns_column(list(map(ag("dur"), events)), "dur_ns")
    cols["correlation"] = _int_column(list(map(ag("args.correlation"), events)), "correlation")
    cols["external_id"] = _int_column(list(map(ag("args.external_id"), events)), "external_id")
    coll = pl.Series("coll", list(map(ag("args.coll"), events)), dtype=pl.String)
    cols["coll"] = coll
    frame = pl.DataFrame(list(cols.values()))

    # the sparse columns only where some row has a value: a missing column is added as typed nulls by
    # _finish_frame (or by the diagonal concat of slices), which is cheaper than building all-null columns here
    extra: dict[str, pl.Series] = {}
    str_pid_rows = frame["pid"].is_null().arg_true().to_list() if frame["pid"].null_count() else []
    labels = [(i, pid_raw[i]) for i in str_pid_rows if isinstance(pid_raw[i], str)]
    if labels:
        extra["pid_label"] = _nulls("pid_label", n, pl.String).scatter([i for i, _ in labels],
                                                                       [v for _, v in labels])
    rows = coll.is_not_null().arg_true().to_list() if coll.null_count() < n else []
    for f in _COLL_FIELDS if rows else ():
        vals = [getattr(events[i].args, f) for i in rows]
        if f in ("dtype", "pg_name", "pg_desc"):
            full = _nulls(f, n, pl.String)
            vals = [v if isinstance(v, str) else None for v in vals]
        elif f == "pg_ranks":
            full = _nulls(f, n, pl.String)
            vals = [_ranks_text(v) for v in vals]
        else:
            full = _nulls(f, n, pl.Int64)
            vals = [v if v.__class__ is int and v != _MISSING_INT else None for v in vals]
        extra[f] = full.scatter(rows, vals)
    cat = cols["cat"]
    mem_rows = (cat.is_in(["gpu_memcpy", "gpu_memset"])).arg_true().to_list()
    kern_rows = (cat == "kernel").arg_true().to_list()
    for f, f_rows in (("bytes", mem_rows), ("graph_id", kern_rows)):
        col = _sparse_int(events, f_rows, f, n)
        if col is not None:
            extra[f] = col
    if extra:
        frame = frame.with_columns(*extra.values())
    if categorical:
        frame = frame.with_columns([pl.col(c).cast(pl.Categorical) for c in _CAT_COLUMNS if c in frame.columns])
    meta_rows = (cols["ph"] == "M").arg_true().to_list()
    meta = [{"name": events[i].name, "pid": events[i].pid, "tid": events[i].tid,
             "args": {"name": events[i].args.meta_name, "labels": events[i].args.labels}} for i in meta_rows]
    return (_finish_frame(frame) if derived else frame), meta


_SCHEMA = {"ph": pl.Categorical, "cat": pl.Categorical, "name": pl.Categorical, "pid": pl.Int64,
           "pid_label": pl.String, "tid": pl.Int64, "ts_ns": pl.Int64, "dur_ns": pl.Int64, "device": pl.Int64,
           "stream": pl.Int64, "correlation": pl.Int64, "external_id": pl.Int64, "coll": pl.Categorical,
           "in_nelems": pl.Int64, "out_nelems": pl.Int64, "group_size": pl.Int64, "dtype": pl.Categorical,
           "pg_name": pl.Categorical, "pg_desc": pl.Categorical, "pg_ranks": pl.String, "seq": pl.Int64,
           "bytes": pl.Int64, "graph_id": pl.Int64}


def _finish_frame(frame: pl.DataFrame) -> pl.DataFrame:
    """Missing columns as typed nulls, ``device`` / ``stream`` from pid / tid on GPU rows, ``COLUMNS`` order."""
    gpu = pl.col("cat").is_in(list(GPU_CATS))
    return frame.select(
        *(pl.col(c) if c in frame.columns else pl.lit(None, dtype=_SCHEMA[c]).alias(c)
          for c in COLUMNS if c not in ("device", "stream")),
        device=pl.when(gpu).then(pl.col("pid")),
        stream=pl.when(gpu).then(pl.col("tid")),
    ).select(COLUMNS)


def _nulls(name: str, n: int, dtype: pl.DataType) -> pl.Series:
    return pl.repeat(None, n, dtype=dtype, eager=True).alias(name)


def _sparse_int(events: list[_Event], rows: list[int], field: str, n: int) -> pl.Series | None:
    """``args.<field>`` of the given rows as an Int64 column over all ``n`` rows; None when no row has an int."""
    if not rows:
        return None
    vals = list(map(attrgetter(f"args.{field}"), map(events.__getitem__, rows)))
    vals = [v if v.__class__ is int and v != _MISSING_INT else None for v in vals]
    if vals.count(None) == len(vals):
        return None
    return _nulls(field, n, pl.Int64).scatter(rows, vals)


def _ranks_text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, str):
        return v
    return json.dumps(v)


def _lenient_frame(events: list[dict], base_ns: int) -> tuple[pl.DataFrame, list[dict]]:
    """Slow path for traces whose fields do not fit the typed schema (e.g. string ids)."""
    def num(v: Any) -> float:
        try:
            return float(v)
        except (TypeError, ValueError):
            return _MISSING_F

    def as_int(v: Any) -> int:
        if isinstance(v, bool):
            return _MISSING_INT
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            return int(v)
        return _MISSING_INT

    typed = []
    for e in events:
        if not isinstance(e, dict):
            continue
        a = e.get("args") if isinstance(e.get("args"), dict) else {}
        args = _Args(
            **{k: as_int(a.get(src, _MISSING_INT)) for k, src in _INT_ARG_FIELDS.items()},
            **{k: (str(a[src]) if a.get(src) is not None else None) for k, src in _STR_ARG_FIELDS.items()},
            pg_ranks=a.get("Process Group Ranks"), meta_name=a.get("name"), labels=a.get("labels"),
            input_dims=a.get("Input Dims"), input_type=a.get("Input type"))
        pid, tid = e.get("pid", _MISSING_INT), e.get("tid", _MISSING_INT)
        typed.append(_Event(
            ph=str(e.get("ph", "")), cat=str(e.get("cat", "")), name=str(e.get("name", "")),
            pid=pid if isinstance(pid, (int, str)) and not isinstance(pid, bool) else _MISSING_INT,
            tid=tid if isinstance(tid, (int, str)) and not isinstance(tid, bool) else _MISSING_INT,
            ts=num(e.get("ts")), dur=num(e.get("dur")), args=args))
    return _events_to_frame(typed, base_ns)


PARALLEL_MIN_BYTES = 64 << 20     # JSON text size from which the chunked streaming parse is used
SPILL_GROUP = 8                   # consecutive slices a worker decodes and spills as one Arrow file
CHUNK_BYTES = 4 << 20             # JSON text per decode task: 4 MB slices cost ~25 % less CPU than 24 MB (measured,
#                                  fewer Python objects alive per process) and halve the workers' peak memory


def default_workers() -> int:
    """Worker processes for parsing: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def parse_trace(path: str | Path, workers: int | None = None, executor=None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Parse one trace file (no cache). Returns (events frame, metadata dict).

    Metadata: ``baseTimeNanoseconds``, ``distributedInfo``, ``deviceProperties``, versions, and
    ``process_names`` / ``thread_names`` / ``process_labels`` from the ``ph: "M"`` events.
    Large files (≥ ``PARALLEL_MIN_BYTES`` of JSON) are gunzipped as a stream, cut at event boundaries into
    ``CHUNK_BYTES`` slices and decoded by ``workers`` processes (default: the usable CPUs, ≤ 8; in this
    process when 1; ``executor``: a process pool to reuse across files), so the whole text and all its Python
    objects never exist at once; any doubt about a cut falls back to the single-process decoder, which also
    produces the error messages.
    Raises :class:`TraceFormatError` naming the file for truncated gzip, invalid JSON, or JSON that is
    not a Chrome trace.
    """
    path = Path(path)
    workers = default_workers() if workers is None else max(1, int(workers))
    if _json_size_hint(path) >= PARALLEL_MIN_BYTES:
        result = _parse_parallel(path, workers, executor)
        if result is not None:
            return result
    return _parse_serial(path)


def _spawn_pool(workers: int):
    """A spawn-context process pool whose workers are up, or None when this process cannot spawn.

    Spawned workers re-import ``__main__``; a script without an ``if __name__ == "__main__":`` guard makes
    that child try to spawn again, which Python refuses with RuntimeError. We re-raise it there so the
    child stops at once, and the parent — seeing its worker die — parses serially."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    ex = None
    try:
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        # one task per worker submitted together: the pool spawns a process per task while none is idle, so
        # all workers import at once (one task alone starts one; the next would start only when work comes)
        for f in [ex.submit(int, 0) for _ in range(workers)]:
            f.result()
        return ex
    except Exception:
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise
        return None


def _json_size_hint(path: Path) -> int:
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


def _parse_serial(path: Path) -> tuple[pl.DataFrame, dict[str, Any]]:
    text = _read_bytes(path)
    head = text[:4096].lstrip()
    if not head:
        raise TraceFormatError(f"{path}: file is empty")
    gc_was = gc.isenabled()
    gc.disable()  # msgspec allocates millions of small objects; cyclic GC passes double the time
    try:
        try:
            if head[:1] == b"[":
                trace = _Trace(traceEvents=_LIST_DECODER.decode(text))
            else:
                trace = _DECODER.decode(text)
            lenient_events = None
        except msgspec.ValidationError:
            doc = _decode_generic(path, text)
            lenient_events = doc.get("traceEvents") if isinstance(doc, dict) else doc
            if not isinstance(lenient_events, list):
                raise TraceFormatError(f"{path}: JSON has no 'traceEvents' list — not a Kineto/Chrome trace") \
                    from None
            trace = _Trace(**{k: doc.get(k) for k in _Trace.__struct_fields__ if k != "traceEvents"}) \
                if isinstance(doc, dict) else _Trace()
            if trace.baseTimeNanoseconds is not None and not isinstance(trace.baseTimeNanoseconds, int):
                trace.baseTimeNanoseconds = None
        except msgspec.DecodeError as e:
            raise TraceFormatError(f"{path}: not valid JSON ({e}); truncated or not a trace file") from e
        del text
        if lenient_events is None and trace.traceEvents is None:
            raise TraceFormatError(f"{path}: JSON has no 'traceEvents' list — not a Kineto/Chrome trace")
        base_ns = int(trace.baseTimeNanoseconds or 0)
        if lenient_events is not None:
            frame, meta_events = _lenient_frame(lenient_events, base_ns)
        else:
            frame, meta_events = _events_to_frame(trace.traceEvents, base_ns)
        trace.traceEvents = None
    finally:
        if gc_was:
            gc.enable()
    return frame, _meta_dict(trace, meta_events)


def _meta_dict(trace: _Trace, meta_events: list[dict]) -> dict[str, Any]:
    return {
        "baseTimeNanoseconds": trace.baseTimeNanoseconds,
        "distributedInfo": trace.distributedInfo if isinstance(trace.distributedInfo, dict) else None,
        "deviceProperties": trace.deviceProperties if isinstance(trace.deviceProperties, list) else [],
        "schemaVersion": trace.schemaVersion,
        "traceName": trace.traceName,
        "trace_id": trace.trace_id,
        "cuda_runtime_version": trace.cuda_runtime_version,
        "hip_runtime_version": trace.hip_runtime_version,
        "cuda_driver_version": trace.cuda_driver_version,
        **_meta_names(meta_events),
    }


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
    ex = _spawn_pool(workers)
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


def _decode_generic(path: Path, text: bytes) -> Any:
    try:
        return _LENIENT.decode(text)
    except msgspec.DecodeError as e:
        raise TraceFormatError(f"{path}: not valid JSON ({e}); truncated or not a trace file") from e


def _meta_names(meta_events: list[dict]) -> dict[str, Any]:
    procs: dict[str, str] = {}
    labels: dict[str, str] = {}
    threads: dict[str, str] = {}
    for e in meta_events:
        a = e.get("args") or {}
        if e["name"] == "process_name" and a.get("name") is not None:
            procs[str(e["pid"])] = str(a["name"])
        elif e["name"] == "process_labels" and a.get("labels") is not None:
            labels[str(e["pid"])] = str(a["labels"])
        elif e["name"] == "thread_name" and a.get("name") is not None:
            threads[f"{e['pid']}/{e['tid']}"] = str(a["name"])
    return {"process_names": procs, "process_labels": labels, "thread_names": threads}


# ------------------------------------------------------------------------------------------- identity

TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass
class RankIdentity:
    """Who wrote a trace file. ``rank`` is the global torch rank (``distributedInfo.rank`` when present)."""
    file: str
    role: str = "rank"                  # rank | frontend | merged
    rank: int | None = None
    world_size: int | None = None
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    stage: str | None = None            # SGLang profile_by_stage suffix (prefill/decode) or forward mode
    profile_id: str | None = None
    node: str = "node0"
    engine: str | None = None           # the engine whose naming rules the file follows, or None
    source: str = ""                    # which evidence gave rank/tp/pp

    @property
    def label(self) -> str:
        parts = [f"rank{self.rank}" if self.rank is not None else Path(self.file).name]
        for k in ("tp", "dp", "pp", "ep"):
            v = getattr(self, k)
            if v is not None:
                parts.append(f"{k.upper()}{v}")
        return " ".join(parts)


def identity_from_name(path: str | Path) -> RankIdentity:
    """Rank identity from a file name.

    Names an engine writes follow its adapter's rules (``EngineAdapter.trace_identity``): SGLang
    ``[prefix-]{profile_id}-TP-{tp}[-DP-{dp}][-PP-{pp}][-EP-{ep}][-{stage}].trace.json.gz``; vLLM (torch
    ``tensorboard_trace_handler``) ``{worker_name}.{time_ns}.pt.trace.json.gz`` whose worker name holds ``rank0`` /
    ``dp0_pp0_tp0``, and the API-server process's ``async_llm`` trace (role frontend). Other names: the
    ``rank``/``tp``/``pp``/``dp``/``ep`` tokens they hold, and the timestamp of a torch ``.pt.trace`` name.
    """
    name = Path(path).name
    ident = RankIdentity(file=str(path))
    fields = trace_identity(name)
    if fields is not None:
        for key, val in fields.items():
            setattr(ident, key, val)
        return ident
    stem = name.split(".pt.trace")[0] if ".pt.trace" in name else name.split(".json")[0]
    for key, val in name_rank_tokens(stem).items():
        setattr(ident, key, val)
    if ".pt.trace" in name:
        parts = name.split(".")
        if len(parts) > 2 and parts[1].isdigit():
            ident.profile_id = parts[1]
    if ident.rank is not None or ident.tp is not None:
        ident.source = "filename"
    return ident


def _apply_distributed_info(ident: RankIdentity, info: dict | None) -> RankIdentity:
    if not info:
        return ident
    r, w = info.get("rank"), info.get("world_size")
    if isinstance(r, int):
        ident.rank = r
        ident.source = "+".join(s for s in (ident.source, "distributedInfo") if s)
    if isinstance(w, int):
        ident.world_size = w
    return ident


# --------------------------------------------------------------------------------------------- cache

@dataclass
class RankTrace:
    """One rank's parsed trace: the event frame, the file's metadata and who wrote it.

    ``frame`` is the event frame in memory; ``None`` while it has not been read (a Parquet cache hit loaded
    with ``events=False``: the analysis found the rank's prepared tables in the cache and needs no events).
    :attr:`events` reads it then, so a caller always gets the full frame. ``n_events`` / ``n_kernels`` are set
    while the frame is not in memory (not read yet, or released by a streaming analysis)."""
    path: Path
    identity: RankIdentity
    frame: pl.DataFrame | None
    meta: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0
    from_cache: bool = False
    cache_path: Path | None = None
    n_events: int | None = None          # set while the event frame is not in memory
    n_kernels: int | None = None

    @property
    def events(self) -> pl.DataFrame:
        """The event frame (read from the Parquet cache on first use when it was not read at load; an empty
        frame once released)."""
        if self.frame is None:
            self.frame = self.reload_events()
            self.n_events = self.n_kernels = None
        return self.frame

    def release_events(self) -> None:
        """Drop the event frame (keeping its row and kernel counts): multi-rank analysis streams rank by rank
        and keeps only the per-rank tables; :meth:`reload_events` reads it back from the Parquet cache."""
        if self.n_events is None:
            ev = self.events
            self.n_events = ev.height
            self.n_kernels = int((ev["cat"] == "kernel").sum())
        self.frame = self.frame.clear() if self.frame is not None else _empty_events()

    def reload_events(self, columns: list[str] | None = None) -> pl.DataFrame:
        """The event frame (only ``columns`` when given): in memory, else from the Parquet cache, else parsed."""
        if self.n_events is None and self.frame is not None:
            return self.frame if columns is None else self.frame.select(columns)
        if self.cache_path is not None and Path(self.cache_path).exists():
            return pl.read_parquet(self.cache_path, columns=columns)
        frame = parse_trace(self.path)[0]
        return frame if columns is None else frame.select(columns)

    @property
    def rank(self) -> int:
        return self.identity.rank if self.identity.rank is not None else -1

    @property
    def label(self) -> str:
        return self.identity.label


def _empty_events() -> pl.DataFrame:
    return pl.DataFrame(schema=_SCHEMA)


def cache_path_for(path: Path, cache_dir: Path | None = None) -> Path:
    """``<trace dir>/.servelab_cache/<file>.v<N>.parquet``, or under ``cache_dir`` / the user cache when the
    trace folder is read-only (e.g. a shared data folder)."""
    name = f"{path.name}.v{PARSER_VERSION}.parquet"
    if cache_dir is not None:
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        return Path(cache_dir) / f"{digest}-{name}"
    local = path.parent / CACHE_DIRNAME
    if _writable(path.parent) and (not local.exists() or _writable(local)):
        return local / name
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    return cache_root() / "traces" / f"{digest}-{name}"


def _writable(d: Path) -> bool:
    """Writable for us *and* not marked read-only by its mode bits (root ignores the bits, we do not: a
    ``r-x`` shared data folder must stay untouched)."""
    try:
        return os.access(d, os.W_OK) and bool(d.stat().st_mode & 0o222)
    except OSError:
        return False


def cache_stamp(path: Path) -> dict[str, str]:
    """What makes a Parquet cache file valid for a trace: its size, mtime and the parser version."""
    st = path.stat()
    return {"size": str(st.st_size), "mtime_ns": str(st.st_mtime_ns), "parser": str(PARSER_VERSION)}


def _read_cache(cpath: Path, stamp: dict[str, str], events: bool = True
                ) -> tuple[pl.DataFrame | None, dict, int, int | None] | None:
    """(frame, trace metadata, events, kernels) from a valid cache file, else None. ``events=False`` reads the
    file's footer only (frame None; kernels None when an older cache did not record them)."""
    try:
        pmd = pq.read_metadata(cpath)
        md = pmd.metadata or {}
        if any(md.get(f"servelab.{k}".encode()) != v.encode() for k, v in stamp.items()):
            return None
        meta = json.loads(md[b"servelab.meta"])
        kernels = int(md[b"servelab.kernels"]) if b"servelab.kernels" in md else None
        if not events:
            return None, meta, pmd.num_rows, kernels
        return pl.read_parquet(cpath), meta, pmd.num_rows, kernels    # polars' reader: ~3× faster than pyarrow
    except Exception:  # stale/corrupt cache → parse the trace again
        return None


def _write_cache(cpath: Path, frame: pl.DataFrame, meta: dict, stamp: dict[str, str]) -> bool:
    """The frame as Parquet (zstd) with the stamp, the trace metadata and the kernel count in the file's
    key-value metadata; written to a temporary name and renamed. Polars' writer: 1.4 s for 6.6 M events where
    pyarrow's took 2.4 s (on this critical path of every cold load)."""
    try:
        cpath.parent.mkdir(parents=True, exist_ok=True)
        md = {f"servelab.{k}": v for k, v in stamp.items()}
        md["servelab.meta"] = json.dumps(meta, default=str)
        md["servelab.kernels"] = str(int((frame["cat"] == "kernel").sum()))    # not a stamp key
        tmp = cpath.with_suffix(f".tmp{os.getpid()}")
        try:
            frame.write_parquet(tmp, compression="zstd", statistics=False, metadata=md)
            os.replace(tmp, cpath)
        finally:
            tmp.unlink(missing_ok=True)
        return True
    except (OSError, pl.exceptions.PolarsError):
        return False


def load_trace(path: str | Path, *, cache: bool = True, cache_dir: str | Path | None = None,
               node: str | None = None, workers: int | None = None, executor=None,
               events: bool = True) -> RankTrace:
    """Load one rank's trace (Parquet cache hit when size+mtime+parser version match).

    The cache lives in ``.servelab_cache/`` next to the trace, or in ``cache_dir`` / the user cache
    directory when the trace folder is not writable. ``events=False``: on a cache hit the event frame is not
    read now (:attr:`RankTrace.events` reads it on first use); a parsed trace always keeps its frame.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such trace file")
    t0 = time.perf_counter()
    stamp = cache_stamp(path)
    cpath = cache_path_for(path, Path(cache_dir) if cache_dir else None) if cache else None
    hit = _read_cache(cpath, stamp, events) if cpath is not None and cpath.exists() else None
    n_events = n_kernels = None
    if hit is not None:
        frame, meta, rows, kernels = hit
        from_cache = True
        if frame is None:
            n_events = rows
            n_kernels = kernels if kernels is not None else \
                int((pl.read_parquet(cpath, columns=["cat"])["cat"] == "kernel").sum())
    else:
        frame, meta = parse_trace(path, workers=workers, executor=executor)
        from_cache = False
        if cpath is not None and not _write_cache(cpath, frame, meta, stamp):
            cpath = None
    ident = _apply_distributed_info(identity_from_name(path), meta.get("distributedInfo"))
    if node:
        ident.node = node
    return RankTrace(path=path, identity=ident, frame=frame, meta=meta, load_s=time.perf_counter() - t0,
                     from_cache=from_cache, cache_path=cpath, n_events=n_events, n_kernels=n_kernels)


SKIP_DIRS = (CACHE_DIRNAME, *trace_skip_dirs())   # our cache; engines' folders of non-serving traces


_TRACE_NAME_RE = re.compile("|".join((r"\.trace\.json", r"rank\d+", *trace_name_hints())), re.IGNORECASE)


def looks_like_trace(path: Path, peek_bytes: int = 1 << 20) -> bool:
    """Whether a ``*.json(.gz)`` file is a trace: a trace-like name, or ``"traceEvents"`` / a leading ``[`` in
    its first MiB. Other JSON files in a capture folder (``capture.json``, ``summary.json``) are set aside."""
    if _TRACE_NAME_RE.search(path.name):
        return True
    try:
        if path.name.endswith(".gz"):
            with _gzip.open(path, "rb") as f:
                head = f.read(peek_bytes)
        else:
            with open(path, "rb") as f:
                head = f.read(peek_bytes)
    except Exception:
        return True      # unreadable: let the loader report it with the file name
    return b'"traceEvents"' in head or head.lstrip()[:1] == b"["


def find_trace_files(trace_dir: str | Path) -> list[Path]:
    """Trace files under ``trace_dir`` (recursive): ``*.json`` / ``*.json.gz``, outside ``SKIP_DIRS`` (our cache
    folder and the engines' folders of capture-time traces, e.g. SGLang's ``graph_capture_profile/``)."""
    root = Path(trace_dir)
    if not root.is_dir():
        raise TraceFormatError(f"{root}: trace folder does not exist")
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).parts
        if not p.is_file() or any(d in rel[:-1] for d in SKIP_DIRS) or p.name.startswith("."):
            continue
        if p.name.endswith(TRACE_SUFFIXES):
            out.append(p)
    return out


def _cached(path: Path, cache: bool, cache_dir: str | Path | None) -> bool:
    if not cache:
        return False
    cpath = cache_path_for(path, Path(cache_dir) if cache_dir else None)
    return cpath.exists() and _read_cache(cpath, cache_stamp(path), events=False) is not None


def _load_one(path: Path, cache: bool, cache_dir: str | Path | None, node: str, events: bool = True) -> RankTrace:
    """Worker: parse one rank single-process (the pool already uses the CPUs)."""
    return load_trace(path, cache=cache, cache_dir=cache_dir, node=node, workers=1, events=events)


def _load_many(todo: list[tuple[Path, str]], cache: bool, cache_dir: str | Path | None, workers: int,
               done=None, events: bool = True) -> list[RankTrace]:
    """Ranks in order. Big ranks (≥ ``PARALLEL_MIN_BYTES`` of JSON each) are parsed one after another, each
    chunked over one shared pool of ``workers`` processes (memory: one rank's frame plus a few slices at a
    time); several smaller ranks are parsed one rank per worker process."""
    need = [p for p, _ in todo if not _cached(p, cache, cache_dir)]
    sizes = {p: _json_size_hint(p) for p in need}
    if workers > 1 and need and max(sizes.values()) >= PARALLEL_MIN_BYTES:
        ex = _spawn_pool(workers)
        if ex is not None:
            with ex:
                return [done(load_trace(p, cache=cache, cache_dir=cache_dir, node=node, workers=workers,
                                        executor=ex, events=events)) for p, node in todo]
    big = sum(sizes.values()) >= PARALLEL_MIN_BYTES
    if workers > 1 and len(need) > 1 and big:
        ex = _spawn_pool(min(workers, len(todo)))
        if ex is not None:
            try:
                with ex:
                    futs = [ex.submit(_load_one, p, cache, cache_dir, node, events) for p, node in todo]
                    return [done(f.result()) for f in futs]
            except TraceFormatError:
                raise
            except Exception:  # a worker died (e.g. out of memory): load one by one below
                pass
    return [done(load_trace(p, cache=cache, cache_dir=cache_dir, node=node, workers=workers, events=events))
            for p, node in todo]


@dataclass
class Capture:
    """All rank traces of one capture plus the frontend traces that were set aside."""
    trace_dir: Path
    ranks: list[RankTrace]
    frontend: list[RankIdentity] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def identities(self) -> pl.DataFrame:
        """One row per rank: identity, events, kernels, load time and whether it came from the cache."""
        rows = []
        for t in self.ranks:
            d = asdict(t.identity)
            d["file"] = Path(d["file"]).name
            in_memory = t.n_events is None          # else: counted at load or at release, the frame not read
            d.update(events=t.events.height if in_memory else t.n_events,
                     kernels=int((t.events["cat"] == "kernel").sum()) if in_memory else t.n_kernels,
                     gpu=", ".join(sorted({str(p.get("name")) for p in t.meta.get("deviceProperties") or []
                                          if isinstance(p, dict)})) or None,
                     load_s=round(t.load_s, 3), from_cache=t.from_cache)
            rows.append(d)
        for f in self.frontend:
            d = asdict(f)
            d["file"] = Path(d["file"]).name
            rows.append(d)
        return pl.DataFrame(rows, infer_schema_length=None)


def load_capture(trace_dir: str | Path, *, profile_id: str | None = None, cache: bool = True,
                 cache_dir: str | Path | None = None, nodes: dict[str, str] | None = None,
                 workers: int | None = None, on_rank=None, events: bool = True) -> Capture:
    """Load every rank trace of a capture folder (SGLang per-rank files or vLLM ``rank*.pt.trace.json.gz``).

    Frontend traces (vLLM ``async_llm``) are listed but not loaded as ranks. A folder holding several
    SGLang captures needs ``profile_id``. Node: ``nodes[<sub-folder>]`` or the sub-folder name when
    traces sit in per-node sub-folders, else ``node0``. Ranks are sorted by global rank.
    When several ranks must be parsed (no cache hit) and together hold ≥ ``PARALLEL_MIN_BYTES`` of JSON,
    they are parsed by ``workers`` processes, one rank each (default: usable CPUs, ≤ 8); big ranks are parsed
    one after another, each chunked over the same processes. ``on_rank(trace)`` is called on each rank as soon
    as it is loaded (rank identity settled) — streaming analysis prepares it there and releases its events.
    ``events=False``: a rank found in the Parquet cache is loaded without its event frame, which
    :attr:`RankTrace.events` reads on first use (the analysis needs none when the rank's prepared tables are
    cached too).
    """
    root = Path(trace_dir)
    files = find_trace_files(root)
    if not files:
        raise TraceFormatError(f"{root}: no *.json / *.json.gz trace files in this folder")
    idents = {p: identity_from_name(p) for p in files}
    ids = sorted({i.profile_id for i in idents.values()
                  if i.engine and i.profile_id and engine_for(i.engine).trace_profile_id_shared})
    if profile_id is None and len(ids) > 1:
        raise TraceFormatError(f"{root}: holds {len(ids)} SGLang captures ({', '.join(ids)}); "
                               f"pass profile_id= to choose one")
    frontend, skipped, todo = [], [], []
    merged = [p for p in files if idents[p].role == "merged"]
    if merged and len(merged) == len(files):
        raise TraceFormatError(f"{root}: only SGLang merged traces ({', '.join(p.name for p in merged)}); they hold "
                               "every rank in one file without clock alignment — analyse the per-rank "
                               "*-TP-<n>*.trace.json.gz files instead")
    for p in files:
        ident = idents[p]
        if p in merged or (profile_id is not None and ident.profile_id != profile_id) or not looks_like_trace(p):
            skipped.append(p.name)
            continue
        rel = p.parent.relative_to(root)
        node = str(rel) if str(rel) != "." else "node0"
        if nodes:
            node = nodes.get(node, nodes.get(p.name, node))
        if ident.role == "frontend":
            ident.node = node
            frontend.append(ident)
            continue
        todo.append((p, node))
    order = {p: i for i, p in enumerate(sorted((p for p, _ in todo), key=str))}

    def done(t: RankTrace) -> RankTrace:
        if t.identity.rank is None:
            t.identity.rank = t.identity.tp if t.identity.tp is not None else order[t.path]
            t.identity.source = t.identity.source or "file order"
        if on_rank is not None:
            on_rank(t)
        return t

    ranks = _load_many(todo, cache, cache_dir, default_workers() if workers is None else max(1, int(workers)), done,
                       events)
    if not ranks:
        raise TraceFormatError(f"{root}: no rank traces found (frontend traces: "
                               f"{', '.join(Path(f.file).name for f in frontend) or 'none'}; set aside: "
                               f"{', '.join(skipped) or 'none'})")
    seen: dict[tuple, str] = {}
    for t in ranks:
        key = (t.identity.rank, t.identity.stage, t.identity.dp, t.identity.pp)
        if key in seen:
            raise TraceFormatError(f"{root}: {t.path.name} and {seen[key]} both claim rank {t.identity.rank}; "
                                   f"the folder mixes captures — pass profile_id= or split the folder")
        seen[key] = t.path.name
    ranks.sort(key=lambda t: (t.identity.stage or "", t.rank))
    return Capture(trace_dir=root, ranks=ranks, frontend=frontend, skipped=skipped)
