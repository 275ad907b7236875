"""Nsight Systems: the ``nsys profile`` / ``nsys stats`` command lines of ``docs/method.md#capture-scenarios``, and an importer of
``nsys stats --format csv`` reports.

Column names follow the Nsight Systems analysis guide (``nsys stats`` report names; ``cuda_gpu_kern_sum``: ``Time
(%),Total Time (ns),Instances,Avg (ns),
Med (ns),Min (ns),Max (ns),StdDev (ns),Name``; ``cuda_api_sum`` the same with ``Num Calls``; ``nvtx_sum`` with
``Style,Range``; ...). Times are ns unless the report was written with ``--timeunit``; the importer
converts the unit found in the header to ns.
"""
from __future__ import annotations

import csv
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd
import polars as pl

from servelab.analyse.trace.taxonomy import classify_names

CAPTURE_RANGES = ("cudaProfilerApi", "nvtx", "hotkey", "none")
RANGE_END_MODES = ("defer", "sync", "async")


class NsysReportError(ValueError):
    """A CSV that is not the nsys report it claims to be; the message names the file and the columns."""


def nsys_profile_argv(app_argv: Sequence[str], output: str, *, trace: Sequence[str] = ("cuda", "nvtx", "nccl"),
                      trace_fork_before_exec: bool = True, cuda_graph_trace: str | None = "node",
                      capture_range: str | None = "cudaProfilerApi", capture_range_end: str | None = "repeat",
                      repeat: int | None = None, repeat_mode: str | None = None, sample: str | None = None,
                      force_overwrite: bool = True, nsys: str = "nsys", extra: Sequence[str] = ()) -> list[str]:
    """``nsys profile`` argv wrapping ``app_argv`` (``docs/method.md#capture-scenarios``).

    ``capture_range_end="repeat"`` with ``repeat=3`` and ``repeat_mode="defer"`` gives
    ``--capture-range-end=repeat:3:defer`` (three capture ranges in one model load; results written at
    exit). ``output`` may contain nsys placeholders such as ``%n`` (range number) or ``%h`` (host).
    """
    if not app_argv:
        raise ValueError("nsys_profile_argv: app_argv is empty — the command to profile is required")
    if capture_range is not None and capture_range not in CAPTURE_RANGES:
        raise ValueError(f"capture_range {capture_range!r}: expected one of {', '.join(CAPTURE_RANGES)}")
    argv = [nsys, "profile", f"--trace={','.join(trace)}"]
    if trace_fork_before_exec:
        argv.append("--trace-fork-before-exec=true")
    if cuda_graph_trace:
        if cuda_graph_trace not in ("node", "graph"):
            raise ValueError(f"cuda_graph_trace {cuda_graph_trace!r}: expected 'node' or 'graph'")
        argv.append(f"--cuda-graph-trace={cuda_graph_trace}")
    if sample is not None:
        argv.append(f"--sample={sample}")
    if capture_range:
        argv.append(f"--capture-range={capture_range}")
    if capture_range_end:
        end = capture_range_end
        if end.startswith("repeat"):
            if repeat is not None:
                if int(repeat) < 1:
                    raise ValueError(f"repeat={repeat}: must be ≥ 1")
                end = f"{end}:{int(repeat)}"
            if repeat_mode is not None:
                if repeat_mode not in RANGE_END_MODES:
                    raise ValueError(f"repeat_mode {repeat_mode!r}: expected one of {', '.join(RANGE_END_MODES)}")
                if repeat is None and end == "repeat":
                    raise ValueError("repeat_mode needs repeat=N (nsys syntax repeat[:N][:mode])")
                end = f"{end}:{repeat_mode}"
        elif capture_range_end not in ("none", "stop", "stop-shutdown"):
            raise ValueError(f"capture_range_end {capture_range_end!r}: expected none | stop | stop-shutdown | "
                             "repeat | repeat-shutdown:N")
        argv.append(f"--capture-range-end={end}")
    if force_overwrite:
        argv.append("--force-overwrite=true")
    argv += ["-o", output, *extra, *app_argv]
    return argv


def nsys_stats_argv(report: str, reports: Sequence[str] = ("cuda_gpu_kern_sum", "cuda_api_sum", "nvtx_sum"),
                    output_base: str | None = None, nsys: str = "nsys") -> list[str]:
    """``nsys stats --report a,b --format csv --output <base>`` → files ``<base>_<report>.csv``."""
    base = output_base or re.sub(r"\.(nsys-rep|qdrep|sqlite)$", "", report)
    return [nsys, "stats", "--report", ",".join(reports), "--format", "csv", "--output", base, "--force-export=true",
            report]


def display(argv: Sequence[str]) -> str:
    """Shell-quoted rendering for humans (commands are run as argv lists)."""
    return shlex.join(list(argv))


# ------------------------------------------------------------------------------------------------ import

@dataclass(frozen=True)
class ReportSpec:
    required: tuple[str, ...]
    rename: dict[str, str]


_SUM_STATS = {"Avg": "avg", "Med": "med", "Min": "min", "Max": "max", "StdDev": "stddev"}


def _stats_rename(count_col: str, count_name: str, name_col: str) -> dict[str, str]:
    r = {"Time (%)": "time_pct", "Total Time": "total_time_ns", count_col: count_name, name_col: "name"}
    r.update({k: f"{v}_ns" for k, v in _SUM_STATS.items()})
    return r


REPORTS: dict[str, ReportSpec] = {
    "cuda_gpu_kern_sum": ReportSpec(("Time (%)", "Total Time", "Instances", "Avg", "Med", "Min", "Max", "StdDev",
                                     "Name"), _stats_rename("Instances", "instances", "Name")),
    "cuda_api_sum": ReportSpec(("Time (%)", "Total Time", "Num Calls", "Avg", "Med", "Min", "Max", "StdDev", "Name"),
                               _stats_rename("Num Calls", "calls", "Name")),
    "nvtx_sum": ReportSpec(("Time (%)", "Total Time", "Instances", "Avg", "Med", "Min", "Max", "StdDev", "Range"),
                           {**_stats_rename("Instances", "instances", "Range"), "Style": "style"}),
    "nvtx_gpu_proj_sum": ReportSpec(("Range", "Total Proj Time", "Range Instances"),
                                    {"Range": "name", "Style": "style", "Total Proj Time": "total_proj_time_ns",
                                     "Total Range Time": "total_range_time_ns", "Range Instances": "instances",
                                     "Proj Avg": "proj_avg_ns", "Proj Med": "proj_med_ns", "Proj Min": "proj_min_ns",
                                     "Proj Max": "proj_max_ns", "Proj StdDev": "proj_stddev_ns",
                                     "Total GPU Ops": "gpu_ops", "Avg GPU Ops": "avg_gpu_ops"}),
    "cuda_gpu_trace": ReportSpec(("Start", "Duration", "Name"),
                                 {"Start": "start_ns", "Duration": "duration_ns", "CorrId": "correlation",
                                  "Device": "device", "Strm": "stream", "Name": "name", "Bytes": "bytes"}),
}

_UNIT_NS = {"ns": 1, "us": 1_000, "μs": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
_HEADER_UNIT = re.compile(r"^(?P<base>.+?)\s*\((?P<unit>ns|us|μs|µs|ms|s|%)\)\s*$")


def _report_name(path: Path) -> str | None:
    for name in sorted(REPORTS, key=len, reverse=True):
        if path.stem.endswith(name) or path.stem == name:
            return name
    return None


def read_stats_csv(path: str | Path, report: str | None = None) -> pl.DataFrame:
    """Read one ``nsys stats --format csv`` file into a frame with snake_case columns and times in ns.

    ``report`` defaults to the ``_<report>.csv`` suffix nsys writes. Preamble lines before the header
    (``Generating SQLite file…``, ``Processing [...]``) are skipped. Raises :class:`NsysReportError` naming
    the file when required columns are missing or a value is not numeric.
    """
    path = Path(path)
    report = report or _report_name(path)
    if report not in REPORTS:
        raise NsysReportError(f"{path}: unknown nsys report '{report}' (known: {', '.join(REPORTS)}); pass report=")
    spec = REPORTS[report]
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise NsysReportError(f"{path}: cannot read ({e.strerror or e})") from e
    lines = text.splitlines()
    first_req = spec.required[0]
    start = next((i for i, ln in enumerate(lines) if first_req in ln and "," in ln), None)
    if start is None:
        raise NsysReportError(f"{path}: no '{report}' header line (expected columns {', '.join(spec.required)})")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], [r for r in rows[1:] if r and any(c.strip() for c in r)]
    bases, units = [], []
    for h in header:
        m = _HEADER_UNIT.match(h.strip())
        if m and m["unit"] != "%":
            bases.append(m["base"])
            units.append(m["unit"])
        else:
            bases.append(h.strip())
            units.append("%" if m else None)
    missing = [c for c in spec.required if c not in bases]
    if missing:
        raise NsysReportError(f"{path}: '{report}' report lacks columns {missing}; found {bases}")
    cols: dict[str, list] = {}
    for j, (b, u) in enumerate(zip(bases, units)):
        out = spec.rename.get(b, re.sub(r"[^0-9a-z]+", "_", b.lower()).strip("_"))
        vals = [r[j] if j < len(r) else "" for r in body]
        numeric = ("instances", "calls", "gpu_ops", "correlation", "device", "stream", "bytes")
        if u in _UNIT_NS or u == "%" or out.endswith("_ns") or out in numeric:
            scale = _UNIT_NS.get(u, 1) if u != "%" else 1
            try:
                nums = [None if v.strip() in ("", "-", "N/A") else float(v.replace(",", "")) * scale for v in vals]
            except ValueError as e:
                raise NsysReportError(f"{path}: column '{b}' holds a non-numeric value ({e})") from e
            if out.endswith("_ns") or out in numeric:
                cols[out] = [None if v is None else int(round(v)) for v in nums]
            else:
                cols[out] = nums
        else:
            cols[out] = vals
    df = pl.DataFrame(cols, strict=False)
    return df


def kernel_summary(kern_sum: pl.DataFrame) -> pl.DataFrame:
    """``cuda_gpu_kern_sum`` rows classified with the trace taxonomy (cls, subclass) — the same classes as
    the Kineto analysis, so an nsys capture answers Q1/Q2 alike. Adds total_ms and share_pct."""
    if kern_sum.height == 0:
        return kern_sum
    cl = classify_names(kern_sum["name"].to_list())
    out = kern_sum.with_columns(pl.Series("cls", cl["cls"]), pl.Series("subclass", cl["subclass"]),
                                (pl.col("total_time_ns") / 1e6).alias("total_ms"))
    return out.with_columns((100 * pl.col("total_ms") / pl.col("total_ms").sum()).alias("share_pct"))


def class_breakdown(kern_sum: pl.DataFrame) -> pl.DataFrame:
    """Kernel time per class from a ``cuda_gpu_kern_sum`` report: cls, total_ms, instances, share_pct."""
    k = kernel_summary(kern_sum)
    if k.height == 0:
        return k
    return (k.group_by("cls").agg(pl.col("total_ms").sum(), pl.col("instances").sum())
            .with_columns((100 * pl.col("total_ms") / pl.col("total_ms").sum()).alias("share_pct"))
            .sort("total_ms", descending=True))


def nccl_ranges(nvtx_sum: pl.DataFrame) -> pl.DataFrame:
    """NCCL API ranges (``--trace=nccl`` writes them as NVTX ranges named ``ncclAllReduce`` …) from an
    ``nvtx_sum`` report: name, instances, total_ms, avg_us."""
    if nvtx_sum.height == 0:
        return nvtx_sum
    n = nvtx_sum.filter(pl.col("name").str.contains(r"(?i)nccl"))
    return n.select("name", "instances", (pl.col("total_time_ns") / 1e6).alias("total_ms"),
                    (pl.col("avg_ns") / 1e3).alias("avg_us")).sort("total_ms", descending=True)


def read_stats_dir(folder: str | Path, base: str | None = None) -> dict[str, pl.DataFrame]:
    """Every known ``<base>_<report>.csv`` in a folder → {report: frame}."""
    out: dict[str, pl.DataFrame] = {}
    for p in sorted(Path(folder).glob("*.csv")):
        name = _report_name(p)
        if name and (base is None or p.stem.startswith(base)):
            out[name] = read_stats_csv(p, name)
    return out


# ---------------------------------------------------------------- an nsys summary next to a trace

def trace_kernels(rank_ops: list[pl.DataFrame], function_of: Callable[[str], str]) -> pd.DataFrame:
    """The trace's kernel time per function (all ranks, all windows): function, cls, trace_ms, trace_share_pct."""
    ops = [r.filter(pl.col("cat") == "kernel").select("name", "cls", "dur_ns") for r in rank_ops]
    ops = [o for o in ops if o.height]
    if not ops:
        return pd.DataFrame(columns=["function", "trace_cls", "trace_ms", "trace_share_pct"])
    t = (pl.concat(ops, how="vertical_relaxed").group_by("name", "cls").agg(pl.col("dur_ns").sum())
         .with_columns(pl.col("name").cast(pl.String)).to_pandas())
    t["function"] = t["name"].map(function_of)
    t = t.groupby("function", as_index=False).agg(trace_cls=("cls", "first"), trace_ns=("dur_ns", "sum"))
    t["trace_ms"] = t["trace_ns"] / 1e6
    t["trace_share_pct"] = 100 * t["trace_ms"] / t["trace_ms"].sum()
    return t.drop(columns="trace_ns")


def compare_kernels(kern_sum: pl.DataFrame, rank_ops: list[pl.DataFrame], function_of: Callable[[str], str],
                    top_n: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``top_n`` kernels of an Nsight Systems kernel summary next to the same kernels (by ``function_of`` of each
    name, e.g. ``ncu --kernel-name-base function`` style) in a trace's per-rank ops, and the time share per kernel class on
    both sides: ``(kernels, classes)``."""
    ks = kernel_summary(kern_sum).to_pandas()
    ks["function"] = ks["name"].map(function_of)
    trace = trace_kernels(rank_ops, function_of)
    k = ks.sort_values("total_ms", ascending=False).head(int(top_n)).merge(trace, on="function", how="left")
    k.insert(0, "nsys_rank", range(1, len(k) + 1))
    k["in_trace"] = k["trace_ms"].notna()
    kernels = k[["nsys_rank", "function", "cls", "instances", "total_ms", "share_pct", "avg_ns", "in_trace", "trace_ms",
                 "trace_share_pct"]].rename(columns={"total_ms": "nsys_ms", "share_pct": "nsys_share_pct",
                                                     "avg_ns": "nsys_avg_ns"})
    nb = class_breakdown(kern_sum).to_pandas()[["cls", "total_ms", "share_pct"]]
    tb = trace.groupby("trace_cls", as_index=False)["trace_ms"].sum().rename(columns={"trace_cls": "cls"})
    tb["trace_share_pct"] = 100 * tb["trace_ms"] / tb["trace_ms"].sum()
    classes = nb.rename(columns={"total_ms": "nsys_ms", "share_pct": "nsys_share_pct"}).merge(tb, on="cls", how="outer")
    classes = classes.sort_values("nsys_ms", ascending=False, na_position="last").reset_index(drop=True)
    return kernels, classes
