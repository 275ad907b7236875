"""Decoding one Kineto (PyTorch profiler) Chrome-trace JSON(.gz) into the columnar polars frame: the event structs,
the columns, the typed and the lenient decoders, the serial parse of a whole file.

msgspec's typed decode of the events (gunzip by ISA-L), the frame built column by column; a lenient decoder (plain
objects) takes over when a trace uses unexpected types for the few typed fields. Big files are cut into slices and
decoded in parallel by :mod:`servelab.analyse.trace.chunked`, into the same frame; :mod:`servelab.analyse.trace.load`
caches it and loads a capture.

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
import json
import re
import zlib
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import polars as pl

try:  # ISA-L gunzip is ~1.6x faster than zlib (measured); zlib is the fallback
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover - isal is a declared dependency of the trace analyser
    import gzip as _gzip


PARSER_VERSION = 2                        # 2: gloo collectives carry their collective args
_MISSING_INT = -(2**63)  # sentinel of absent integer fields (ids can legitimately be -1)
_MISSING_F = float("-inf")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_US = 9.2e15                         # µs: beyond this, ns overflow int64


class TraceFormatError(ValueError):
    """A file that is not a readable Kineto/Chrome trace; the message names the file."""


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
_SKIM = msgspec.json.Decoder(msgspec.Raw)

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


def _read_text(path: Path) -> tuple[bytes, dict[str, Any] | None]:
    """The file's JSON text, and — for a gzip stream cut short (a profiler killed mid-write) — what it held up
    to where it ends, with ``{"compressed_bytes", "json_bytes"}`` saying how much; None when it is whole.
    A stream that is corrupt (not merely short) is still an error."""
    try:
        return _read_bytes(path), None
    except TraceFormatError as first:
        try:
            raw = path.read_bytes()
            d = zlib.decompressobj(wbits=31)
            text = d.decompress(raw)
        except (OSError, zlib.error):
            raise first from None
        if d.eof or not text:        # whole (another error) or nothing readable: the first error stands
            raise first from None
        return text, {"compressed_bytes": len(raw), "json_bytes": len(text)}


_EVENT_SEP_RE = re.compile(rb"\}\s*,\s*\{")
_RECOVER_TRIES = 16


def _cut_to_whole_events(path: Path, text: bytes) -> bytes:
    """A trace whose text ends mid-event: the text up to its last whole event of ``traceEvents``, the array and
    the document closed. Tries the last separators first; :class:`TraceFormatError` when none decodes."""
    key = text.find(b'"traceEvents"')
    start = text.find(b"[", key) if key >= 0 else -1
    if start < 0:
        raise TraceFormatError(f"{path}: truncated before its first event (no 'traceEvents' array)")
    opener = text.lstrip()[:1]
    close = b"]" if opener == b"[" else b"]}"
    seps = list(_EVENT_SEP_RE.finditer(text, start))
    for m in reversed(seps[-_RECOVER_TRIES:]):
        candidate = text[:m.start() + 1] + close
        try:
            _SKIM.decode(candidate)             # syntax only: skimmed, no objects built
        except msgspec.DecodeError:
            continue
        return candidate
    raise TraceFormatError(f"{path}: truncated, and no whole event could be recovered from it")


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
        s = pl.Series(name, [_int64_or_none(v) for v in values], dtype=pl.Int64)
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
    ag = attrgetter
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
            vals = [_int64_or_none(v) for v in vals]
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


def _int64_or_none(v: Any) -> int | None:
    """An int field's value, or None where absent, not an int, or beyond int64 (as the scanner reads it; polars
    refuses to put such a value into an Int64 column)."""
    return v if v.__class__ is int and v != _MISSING_INT and _INT64_MIN <= v <= _INT64_MAX else None


def _nulls(name: str, n: int, dtype: pl.DataType) -> pl.Series:
    return pl.repeat(None, n, dtype=dtype, eager=True).alias(name)


def _sparse_int(events: list[_Event], rows: list[int], field: str, n: int) -> pl.Series | None:
    """``args.<field>`` of the given rows as an Int64 column over all ``n`` rows; None when no row has an int."""
    if not rows:
        return None
    vals = list(map(attrgetter(f"args.{field}"), map(events.__getitem__, rows)))
    vals = [_int64_or_none(v) for v in vals]
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


def _parse_serial(path: Path) -> tuple[pl.DataFrame, dict[str, Any]]:
    text, truncated = _read_text(path)
    head = text[:4096].lstrip()
    if not head:
        raise TraceFormatError(f"{path}: file is empty")
    if truncated is not None:           # analysed up to where it ends: its whole events
        text = _cut_to_whole_events(path, text)
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
    meta = _meta_dict(trace, meta_events)
    if truncated is not None:
        meta["truncated"] = {**truncated, "events_read": frame.height}
    return frame, meta


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
