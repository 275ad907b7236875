"""Per-rank device op table: kernels / memcpy / memset with their class, launching runtime call and step window.

A rank whose trace holds no GPU op at all (an engine on CPU: SGLang or vLLM with ``--device cpu``) gets the same
table from its CPU work instead (:func:`cpu_device_ops`): the outermost ``cpu_op`` events of the threads that run
the steps (the model forward, ``aten::linear`` ...) play the kernels, each on its thread as its stream, and the
collectives that torch's gloo backend runs on its worker threads (``gloo:all_reduce`` ...) play the communication
kernels. Every metric then reads a CPU capture as it reads a GPU one; the page says which it was.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import polars as pl

from servelab.analyse.trace.load import RankTrace
from servelab.analyse.trace.taxonomy import GPU_OP_CATS, Rule, classify_ops, load_rules
from servelab.analyse.trace.windows import (LAUNCH_CATS, annotation_windows, assign_launches, whole_trace_window,
                                    window_spans)

GRAPH_LAUNCH_REGEX = r"GraphLaunch"          # cudaGraphLaunch, hipGraphLaunch, cuGraphLaunch (+ _v… suffixes)
SYNC_REGEX = r"Synchronize|^(cuda|hip)Memcpy(2D|3D)?$|^cuMemcpy(DtoH|HtoD)?(_v2)?$"


@dataclass
class RankOps:
    """One rank, prepared for metrics.

    ``ops``: one row per GPU op with ``cls``/``subclass``, ``launcher`` (runtime API name), ``launch_ts_ns``,
    ``launch_end_ns``, ``graph`` (launched by a graph launch), ``window`` and ``kind`` of its step window.
    ``windows``: the step windows with CPU and GPU spans. ``runtime``: runtime/driver API calls.

    ``ops``' ``name``, ``cat`` and ``launcher`` and ``runtime``'s ``name`` keep the event frame's dtype
    (categorical from the loader: a 4-byte code per row instead of a ~230-byte kernel name, for every rank of a
    capture). Compare them with ``==`` / ``is_in``; for a regex use :func:`matches` (once per distinct value)
    or cast to ``pl.String`` first — polars' ``.str`` namespace refuses categoricals.
    """
    trace: RankTrace
    ops: pl.DataFrame
    windows: pl.DataFrame
    runtime: pl.DataFrame
    window_regex: str | None = None
    windows_found: bool = True
    device: str = "gpu"          # "cpu": the trace has no GPU op; ``ops`` are its CPU work (cpu_device_ops)

    @property
    def rank(self) -> int:
        return self.trace.rank

    @property
    def steps_read(self) -> int:
        """Step windows whose device work is in the trace (a trace cut mid-write keeps the later steps' CPU
        annotations without their kernels: those are not read steps)."""
        if "gpu_ops" not in self.windows.columns:
            return self.windows.height
        return int((self.windows["gpu_ops"] > 0).sum())


def matches(frame: pl.DataFrame, column: str, regex: str) -> pl.Expr:
    """Whether ``frame[column]`` (categorical or string) matches ``regex`` (``str.contains``), null → False;
    the regex runs once per distinct value, not once per row."""
    distinct = frame.get_column(column).drop_nulls().unique().cast(pl.String)
    hits = distinct.filter(distinct.str.contains(regex)).to_list()
    return pl.col(column).is_in(hits).fill_null(False)


def runtime_calls(trace: RankTrace) -> pl.DataFrame:
    """CUDA/HIP runtime and driver API calls: pid, tid, name (the event frame's dtype), ts_ns, end_ns,
    correlation."""
    return (trace.events.lazy().filter(pl.col("cat").is_in(list(LAUNCH_CATS)) & pl.col("dur_ns").is_not_null())
            .select("pid", "tid", "name", "ts_ns",
                    (pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"), "correlation").collect())


_OP_COLUMNS = ("rank", "device", "stream", "cat", "name", "ts_ns", "dur_ns", "end_ns", "correlation", "external_id",
               "coll", "in_nelems", "out_nelems", "group_size", "dtype", "pg_name", "pg_ranks", "seq", "bytes",
               "graph_id")
# the op-table categories that are device work: GPU kernels; for an engine on CPU its forward's ops and gloo's
# collectives (a GPU trace's op table holds neither of the last two: the filter is the same for both)
KERNEL_CATS = ("kernel", "cpu_op", "user_annotation")
COLLECTIVE_CALL_REGEX = r"^c10d::"     # the forward thread's call into a collective (enqueue, wait): not compute
GLOO_REGEX = r"^gloo:"
P2P_REGEX = re.compile(r"send|recv", re.I)   # point-to-point comm ops (nccl.parse_comm_name's SendRecv rule)


def outermost(frame: pl.DataFrame) -> pl.DataFrame:
    """Rows (pid, tid, ts_ns, end_ns) not nested in an earlier row of the same thread: the top level of each
    thread's call tree."""
    f = frame.sort("pid", "tid", "ts_ns", pl.col("end_ns"), descending=[False, False, False, True])
    reach = f.select(pl.col("end_ns").cum_max().shift(1).over("pid", "tid").alias("reach"))["reach"]
    return f.filter(reach.is_null() | (f["ts_ns"] >= reach))


def cpu_device_ops(trace: RankTrace, windows: pl.DataFrame) -> pl.DataFrame:
    """The device op table of a CPU-only trace: the outermost ``cpu_op`` events of every thread that holds a step
    window (its collective calls ``c10d::*`` left out: the gloo work itself is counted), plus every gloo collective
    annotation (``gloo:all_reduce`` ..., on gloo's worker threads, with the collective args the loader gave it).
    Without step windows, the threads with the most cpu_op time stand for the forward. Columns as the GPU table's
    (device = the process, stream = the thread, no launching call, no graph)."""
    ev = trace.events.lazy().filter(pl.col("dur_ns").is_not_null())
    threads = (windows.select("pid", "tid").drop_nulls().unique() if windows.height and "tid" in windows.columns
               else None)
    cpu = ev.filter(pl.col("cat") == "cpu_op").with_columns((pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"))
    if threads is None or threads.height == 0:
        busiest = (cpu.group_by("pid", "tid").agg(pl.col("dur_ns").sum()).sort("dur_ns", descending=True)
                   .head(1).collect())
        threads = busiest.select("pid", "tid")
    cpu = cpu.join(threads.lazy().with_columns(pl.col("pid").cast(pl.Int64), pl.col("tid").cast(pl.Int64)),
                   on=["pid", "tid"], how="inner").collect()
    top = outermost(cpu)
    top = top.filter(~top["name"].cast(pl.String).str.contains(COLLECTIVE_CALL_REGEX))
    gloo = (ev.filter(pl.col("name").cast(pl.String).str.contains(GLOO_REGEX))
            .with_columns((pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns")).collect())
    both = pl.concat([top, gloo], how="diagonal_relaxed") if gloo.height else top
    return both.select(pl.lit(trace.rank, dtype=pl.Int64).alias("rank"), pl.col("pid").alias("device"),
                       pl.col("tid").alias("stream"), "pid", *[c for c in _OP_COLUMNS[3:] if c in both.columns]
                       ).sort("ts_ns")


def attribute_outside_comm(ops: pl.DataFrame, windows: pl.DataFrame) -> pl.DataFrame:
    """Give every point-to-point op that no step window claimed (a pipeline send/recv between two annotated
    forwards, gloo's or an NCCL SendRecv kernel launched outside the step) the step it delays: the first
    window of the rank that starts at or after the op starts (the step cannot begin its work before the stage
    boundary's data has moved), else — an op after the rank's last window — that last window. A window's start
    is its first op's start (its CPU start when it has none). Adds ``attributed`` (True: placed by this rule, not
    by the step's annotation); docs/metrics.md#point-to-point."""
    ops = ops.with_columns(pl.lit(False).alias("attributed"))
    comm = ops.filter(pl.col("window").is_null() & (pl.col("cls") == "communication"))["name"].unique()
    p2p = [n for n in comm.to_list() if P2P_REGEX.search(str(n))]
    loose = pl.col("window").is_null() & pl.col("name").is_in(p2p)
    if windows.height == 0 or not p2p:
        return ops
    first = (ops.filter(pl.col("window").is_not_null()).group_by("window").agg(pl.col("ts_ns").min().alias("_g0")))
    starts = (windows.select("window", "cpu_start_ns").join(first, on="window", how="left")
              .select(pl.col("window").alias("_w"), pl.coalesce("_g0", "cpu_start_ns").cast(pl.Int64).alias("_start"))
              .drop_nulls().sort("_start"))
    if starts.height == 0:
        return ops
    last = int(starts["_w"][-1])
    todo = ops.with_row_index("_row").filter(loose).select("_row", pl.col("ts_ns").cast(pl.Int64)).sort("ts_ns")
    placed = (todo.join_asof(starts, left_on="ts_ns", right_on="_start", strategy="forward", check_sortedness=False)
              .select("_row", pl.col("_w").fill_null(last)))
    return (ops.with_row_index("_row").join(placed, on="_row", how="left")
            .with_columns(pl.coalesce("window", pl.col("_w").cast(ops.schema["window"])).alias("window"),
                          pl.col("_w").is_not_null().alias("attributed"))
            .drop("_row", "_w"))


def prepare_rank(trace: RankTrace, rules: list[Rule] | None = None, window_regex: str | None = None) -> RankOps:
    """Build the GPU op table of one rank and attribute every op to its step window.

    Ops are attributed by correlation id: op → the runtime call that launched it → the innermost matching
    CPU annotation containing that call. Without matching annotations the whole trace is one window ``all``.
    """
    rules = rules if rules is not None else load_rules()
    ev = trace.events
    # lazy: the filter gathers only the selected columns, not every column of the event frame
    ops = (ev.lazy().filter(pl.col("cat").is_in(list(GPU_OP_CATS)) & pl.col("dur_ns").is_not_null())
           .select(pl.lit(trace.rank, dtype=pl.Int64).alias("rank"),
                   pl.coalesce("device", "pid").alias("device"), pl.coalesce("stream", "tid").alias("stream"),
                   "cat", "name", "ts_ns", "dur_ns",
                   (pl.col("ts_ns") + pl.col("dur_ns")).alias("end_ns"), "correlation", "external_id",
                   pl.col("coll").cast(pl.String), "in_nelems", "out_nelems", "group_size",
                   pl.col("dtype").cast(pl.String), pl.col("pg_name").cast(pl.String), "pg_ranks", "seq",
                   "bytes", "graph_id").collect())
    windows = annotation_windows(trace, window_regex)
    found = windows.height > 0
    rt = runtime_calls(trace)
    device = "gpu"
    if ops.height == 0:                  # no GPU op at all: an engine on CPU
        device = "cpu"
        cpu = cpu_device_ops(trace, windows)
        ops = (assign_launches(cpu.rename({"pid": "_pid"}).with_columns(pl.col("_pid").alias("pid")), windows)
               .drop("pid").rename({"_pid": "pid"}) if cpu.height else cpu)
        ops = classify_ops(ops.with_columns(pl.col("cat").cast(ops.schema["cat"]), pl.col("name")), rules) \
            if ops.height else classify_ops(ops, rules)
        ops = ops.with_columns(pl.lit(None, dtype=pl.String).alias("launcher"),
                               pl.col("ts_ns").alias("launch_ts_ns"), pl.col("end_ns").alias("launch_end_ns"),
                               pl.col("stream").alias("launch_tid"),
                               *([] if "window" in ops.columns else [pl.lit(None, dtype=pl.Int64).alias("window")]),
                               pl.lit(False).alias("graph")).drop("pid")
    else:
        ops = classify_ops(ops, rules)      # name / cat stay categorical: the op tables of all ranks are kept
        launches = (rt.filter(pl.col("correlation").is_not_null())
                    .unique("correlation", keep="first", maintain_order=True))
        launches = assign_launches(launches, windows)
        ops = ops.join(launches.select("correlation", pl.col("name").alias("launcher"),
                                       pl.col("ts_ns").alias("launch_ts_ns"), pl.col("end_ns").alias("launch_end_ns"),
                                       pl.col("tid").alias("launch_tid"), "window"),
                       on="correlation", how="left")
        ops = ops.with_columns(matches(ops, "launcher", GRAPH_LAUNCH_REGEX).alias("graph"))
    if not found:
        windows = whole_trace_window(trace, ops)
        ops = ops.with_columns(pl.lit(0, dtype=pl.Int64).alias("window"))
    ops = attribute_outside_comm(ops, windows)
    ops = ops.join(windows.select("window", "kind"), on="window", how="left").sort("ts_ns")
    windows = window_spans(windows, ops)
    return RankOps(trace=trace, ops=ops, windows=windows, runtime=rt, window_regex=window_regex,
                   windows_found=found, device=device)
