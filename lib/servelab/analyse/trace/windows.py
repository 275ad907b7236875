"""Step windows: CPU user annotations (SGLang ``step[EXTEND ...]`` / ``step[DECODE ...]``, or any regex)
projected onto the GPU through the kernels they launched (correlation ids).

A window's kernels are the GPU ops whose launching runtime call (``cudaLaunchKernel``, ``cudaGraphLaunch``,
...) happened inside the annotation on the CPU; its GPU span is [first op start, last op end]. When
annotations nest (``ProfilerStep#3`` around ``step[DECODE bs=32]``), only the innermost ones are windows.
"""
from __future__ import annotations

import re

import polars as pl

from servelab.analyse.trace.load import RankTrace

# SGLang model-runner steps, the H200 samples' ``*_step_i`` / ``mixed_prefill_chunk_N``, ProfilerStep#N, and the
# ``execute_<n>_context_<c>(..)_generation_<g>(..)`` spans of TraceLens-patched vLLM/SGLang traces, and vLLM's own
# per-step ``execute_context_<c>(<tokens>)_generation_<g>(<tokens>)`` worker annotation (vLLM 0.32, while profiling)
DEFAULT_WINDOW_REGEX = r"^(draft )?step\[|_step_\d+$|prefill_chunk|^ProfilerStep#\d+$|^execute_(\d+_)?context_\d+"

# first match wins; evaluated on the annotation name
KIND_RULES: tuple[tuple[str, str], ...] = (
    ("draft", r"^draft "),
    ("mixed", r"mixed|\bMIXED\b|SPLIT_PREFILL|context_[1-9]\d*\(.*generation_[1-9]"),
    ("prefill", r"EXTEND|prefill|PREFILL|context_[1-9]\d*\D.*generation_0\b"),
    ("decode", r"DECODE|decode|TARGET_VERIFY|IDLE|generation"),
)
# what a window carries, for prefill/decode interference: a "mixed" *scenario* window may hold pure prefill
PHASE_RULES: tuple[tuple[str, str], ...] = (
    ("mixed", r"\bMIXED\b|SPLIT_PREFILL|context_[1-9]\d*\(.*generation_[1-9]"),
    ("prefill", r"EXTEND|prefill|PREFILL|chunk|context_[1-9]"),
    ("decode", r"DECODE|decode|TARGET_VERIFY|generation"),
)
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def window_kind(name: str) -> str:
    """prefill | decode | mixed | draft | other, from the annotation name."""
    for kind, rx in KIND_RULES:
        if re.search(rx, name):
            return kind
    return "other"


def window_phase(name: str) -> str:
    """prefill | decode | mixed | other: the work a window carries (used for interference analysis)."""
    for phase, rx in PHASE_RULES:
        if re.search(rx, name):
            return phase
    return "other"


def _int_field(rx: str, name: str) -> int | None:
    m = re.search(rx, name)
    return int(m.group(1)) if m else None


def annotation_windows(trace: RankTrace, regex: str | None = None) -> pl.DataFrame:
    """Matched CPU annotations, innermost only. Columns: rank, window, name, kind, bs, toks, pid, tid,
    cpu_start_ns, cpu_end_ns (window = 0-based order of CPU start)."""
    rx = regex or DEFAULT_WINDOW_REGEX
    try:
        re.compile(rx)
    except re.error as e:
        raise ValueError(f"window regex {rx!r} is invalid: {e}") from e
    ev = trace.events
    # lazy: only the five columns read are gathered (an eager filter copies every column of the event frame)
    ann = (ev.lazy().filter((pl.col("cat") == "user_annotation") & pl.col("dur_ns").is_not_null())
           .with_columns(pl.col("name").cast(pl.String))
           .filter(pl.col("name").str.contains(rx))
           .select("name", "pid", "tid", pl.col("ts_ns").alias("cpu_start_ns"),
                   (pl.col("ts_ns") + pl.col("dur_ns")).alias("cpu_end_ns"))
           .sort("pid", "cpu_start_ns", pl.col("cpu_end_ns"), descending=[False, False, True]).collect())
    if ann.height:
        # innermost only: drop an annotation when the next one (same pid) starts inside it
        nxt_start = ann["cpu_start_ns"].shift(-1)
        same_pid = ann["pid"] == ann["pid"].shift(-1)
        contains = same_pid.fill_null(False) & (nxt_start < ann["cpu_end_ns"]).fill_null(False) & \
            (ann["cpu_end_ns"].shift(-1) <= ann["cpu_end_ns"]).fill_null(False)
        ann = ann.filter(~contains)
    return (ann.sort("cpu_start_ns")
            .with_columns(
                pl.col("name").map_elements(window_kind, return_dtype=pl.String).alias("kind"),
                pl.col("name").map_elements(window_phase, return_dtype=pl.String).alias("phase"),
                pl.col("name").map_elements(lambda n: _int_field(r"\bbs=(\d+)", n), return_dtype=pl.Int64)
                .alias("bs"),
                pl.col("name").map_elements(lambda n: _int_field(r"(?:\btoks=|chunk_)(\d+)", n),
                                            return_dtype=pl.Int64).alias("toks"))
            .with_row_index("window")
            .with_columns(pl.col("window").cast(pl.Int64), pl.lit(trace.rank, dtype=pl.Int64).alias("rank"))
            .select("rank", "window", "name", "kind", "phase", "bs", "toks", "pid", "tid", "cpu_start_ns",
                    "cpu_end_ns"))


def assign_launches(launches: pl.DataFrame, windows: pl.DataFrame) -> pl.DataFrame:
    """Give every launch (columns pid, ts_ns) the window whose CPU span contains it (null if none)."""
    if windows.height == 0 or launches.height == 0:
        return launches.with_columns(pl.lit(None, dtype=pl.Int64).alias("window"))
    w = windows.select("pid", "window", "cpu_start_ns", "cpu_end_ns").sort("cpu_start_ns")
    joined = (launches.with_row_index("_row").sort("ts_ns")
              .join_asof(w, left_on="ts_ns", right_on="cpu_start_ns", by="pid", strategy="backward",
                         check_sortedness=False)
              .with_columns(pl.when(pl.col("ts_ns") < pl.col("cpu_end_ns")).then(pl.col("window"))
                            .alias("window"))
              .sort("_row").drop("_row", "cpu_start_ns", "cpu_end_ns"))
    return joined


def window_spans(windows: pl.DataFrame, ops: pl.DataFrame) -> pl.DataFrame:
    """Windows with their GPU span from the ops attributed to them (ops need window, ts_ns, end_ns)."""
    span = (ops.filter(pl.col("window").is_not_null())
            .group_by("window")
            .agg(pl.col("ts_ns").min().alias("gpu_start_ns"), pl.col("end_ns").max().alias("gpu_end_ns"),
                 pl.len().alias("gpu_ops"), pl.col("dur_ns").sum().alias("gpu_op_ns")))
    out = windows.join(span, on="window", how="left").with_columns(
        pl.col("gpu_ops").fill_null(0),
        ((pl.col("gpu_end_ns") - pl.col("gpu_start_ns")) / 1e6).alias("gpu_span_ms"),
        ((pl.col("cpu_end_ns") - pl.col("cpu_start_ns")) / 1e6).alias("cpu_span_ms"),
        ((pl.col("gpu_start_ns") - pl.col("cpu_start_ns")) / 1e6).alias("launch_to_gpu_ms"))
    return out.sort("window")


def whole_trace_window(trace: RankTrace, ops: pl.DataFrame) -> pl.DataFrame:
    """A single window ``all`` covering every GPU op, for traces without matching annotations."""
    if ops.height == 0:
        start = end = 0
    else:
        start, end = int(ops["ts_ns"].min()), int(ops["end_ns"].max())
    return pl.DataFrame({"rank": [trace.rank], "window": [0], "name": ["whole trace"], "kind": ["all"],
                         "phase": ["other"], "bs": [None], "toks": [None], "pid": [None], "tid": [None],
                         "cpu_start_ns": [start], "cpu_end_ns": [end]},
                        schema={"rank": pl.Int64, "window": pl.Int64, "name": pl.String, "kind": pl.String,
                                "phase": pl.String,
                                "bs": pl.Int64, "toks": pl.Int64, "pid": pl.Int64, "tid": pl.Int64,
                                "cpu_start_ns": pl.Int64, "cpu_end_ns": pl.Int64})

