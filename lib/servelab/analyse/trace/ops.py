"""Per-rank GPU op table: kernels / memcpy / memset with their class, launching runtime call and step window."""
from __future__ import annotations

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

    @property
    def rank(self) -> int:
        return self.trace.rank


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
    ops = classify_ops(ops, rules)      # name / cat stay categorical: the op tables of all ranks are kept
    rt = runtime_calls(trace)
    launches = (rt.filter(pl.col("correlation").is_not_null())
                .unique("correlation", keep="first", maintain_order=True))
    windows = annotation_windows(trace, window_regex)
    found = windows.height > 0
    launches = assign_launches(launches, windows)
    ops = ops.join(launches.select("correlation", pl.col("name").alias("launcher"),
                                   pl.col("ts_ns").alias("launch_ts_ns"), pl.col("end_ns").alias("launch_end_ns"),
                                   pl.col("tid").alias("launch_tid"), "window"),
                   on="correlation", how="left")
    ops = ops.with_columns(matches(ops, "launcher", GRAPH_LAUNCH_REGEX).alias("graph"))
    if not found:
        windows = whole_trace_window(trace, ops)
        ops = ops.with_columns(pl.lit(0, dtype=pl.Int64).alias("window"))
    ops = ops.join(windows.select("window", "kind"), on="window", how="left").sort("ts_ns")
    windows = window_spans(windows, ops)
    return RankOps(trace=trace, ops=ops, windows=windows, runtime=rt, window_regex=window_regex,
                   windows_found=found)
