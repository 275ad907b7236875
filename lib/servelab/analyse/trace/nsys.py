"""Nsight Systems, read: an importer of ``nsys stats --format csv`` reports (kernels, CUDA API, NVTX, OS
runtime) and of the NCCL / GPU-utilisation recipes' outputs, the kernel comparison with a trace, and the method's
NCCL summary / GPU utilisation / overlap / OS-runtime tables of one folder (``read_nsys_folder``, ``method_reports``). The
command lines that make these files, and a capture per node bound to its case id, are acquisition:
:mod:`servelab.measure.nsys_capture`.

Column names follow the Nsight Systems analysis guide (``nsys stats`` report names; ``cuda_gpu_kern_sum``: ``Time
(%),Total Time (ns),Instances,Avg (ns),
Med (ns),Min (ns),Max (ns),StdDev (ns),Name``; ``cuda_api_sum`` the same with ``Num Calls``; ``nvtx_sum`` with
``Style,Range``; ...). Times are ns unless the report was written with ``--timeunit``; the importer
converts the unit found in the header to ns.
"""
from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import polars as pl

from servelab.analyse.trace.taxonomy import classify_names
from servelab.measure.nsys_capture import RECIPE_NAMES

class NsysReportError(ValueError):
    """A CSV that is not the nsys report it claims to be; the message names the file and the columns."""


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
    # OS runtime (libc/pthread calls) of the traced processes: where the host threads blocked (poll, futex, sleeps)
    "osrt_sum": ReportSpec(("Time (%)", "Total Time", "Num Calls", "Avg", "Med", "Min", "Max", "StdDev", "Name"),
                           _stats_rename("Num Calls", "calls", "Name")),
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
        # "Device" is a name in real cuda_gpu_trace output ("NVIDIA H200 (0)"), not a number
        numeric = ("instances", "calls", "gpu_ops", "correlation", "stream", "bytes")
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


# ------------------------------------------------------------------------------------------------ OS runtime

def osrt_summary(osrt_sum: pl.DataFrame, top_n: int = 10) -> pl.DataFrame:
    """The ``osrt_sum`` report's top calls by total time: name, calls, total_ms, avg_us, max_ms, time_pct. The
    host threads' blocking calls (``poll``, ``pthread_cond_timedwait``, ``futex``-backed waits) dominate an idle
    process; look at what blocks *during* the steps (``--capture-range`` keeps the report to the window)."""
    if osrt_sum.height == 0:
        return osrt_sum
    return (osrt_sum.sort("total_time_ns", descending=True).head(top_n)
            .select("name", "calls", (pl.col("total_time_ns") / 1e6).alias("total_ms"),
                    (pl.col("avg_ns") / 1e3).alias("avg_us"), (pl.col("max_ns") / 1e6).alias("max_ms"),
                    pl.col("time_pct")))


# ------------------------------------------------------------------------------------------------ recipes
#
# ``nsys recipe <name> --input <report>.nsys-rep --output <dir> [--csv]`` (Nsight Systems 2023.4+) writes a folder
# holding ``<dir>.nsys-analysis`` (JSON naming the recipe) and its tables as parquet (``--csv``: also CSV, for the
# stats recipes). The recipes and their tables, as Nsight Systems 2023.4.4 writes them (times in ns):
#
# - ``nccl_sum`` (NCCL Summary): the NCCL API ranges that NCCL's own NVTX annotations (domain "NCCL") mark —
#   ``all_stats`` (Text, Count, Mean, Std (approx), Min, Q1/Median/Q3 (approx), Max, Sum) and ``rank_stats`` (the
#   same per report file, with Rank, File);
# - ``nccl_gpu_proj_sum``: the same ranges projected onto the GPU (the kernels they launched);
# - ``cuda_gpu_time_util_map`` / ``nccl_gpu_time_util_map``: ``analysis.parquet``, the capture cut into bins
#   (Duration = the bin's start, ns from the session start), per bin the % of the bin a GPU was busy with any kernel
#   (Kernel; the NCCL map: All, and split into NCCL and Compute kernels), per PID, Device ID, File;
# - ``gpu_time_util``: ``analysis.parquet``, the stretches where a GPU's utilisation fell below ``--threshold``
#   (Row#, In-Use %, Duration, Start, PID, Device ID, Context ID, File; here Duration is the stretch's length).
#
# Newer Nsight Systems adds ``nccl_gpu_overlap_trace`` (per NCCL kernel, its overlap with compute); 2023.4.4 has no
# such recipe, so the overlap is taken from ``nccl_gpu_time_util_map`` (below).

_STAT_COLS = {"Text": "name", "Count": "count", "Mean": "mean_ns", "Std (approx)": "std_ns", "Std": "std_ns",
              "Min": "min_ns", "Q1 (approx)": "q1_ns", "Q1": "q1_ns", "Median (approx)": "median_ns",
              "Median": "median_ns", "Q3 (approx)": "q3_ns", "Q3": "q3_ns", "Max": "max_ns", "Sum": "total_ns",
              "Rank": "rank", "File": "file"}
_UTIL_COLS = {"Duration": "bin_start_ns", "Kernel": "kernel_pct", "All": "all_pct", "NCCL": "nccl_pct",
              "Compute": "compute_pct", "PID": "pid", "Device ID": "device", "File": "file",
              "Row#": "row", "In-Use": "in_use_pct", "Start": "start_ns", "Context ID": "context"}


def recipe_name(folder: str | Path) -> str | None:
    """The recipe a ``nsys recipe`` output folder holds, from its ``*.nsys-analysis`` file."""
    for f in sorted(Path(folder).glob("*.nsys-analysis")):
        try:
            return json.loads(f.read_text()).get("RecipeName")
        except (OSError, ValueError):
            continue
    return None


def read_recipe(folder: str | Path) -> dict[str, pl.DataFrame]:
    """One ``nsys recipe`` output folder → {table: frame} with snake_case columns (``all_stats``, ``rank_stats``
    for the stats recipes; ``analysis`` for the maps). Raises :class:`NsysReportError` naming the folder when it
    is not a recipe output this module knows."""
    folder = Path(folder)
    name = recipe_name(folder)
    if name not in RECIPE_NAMES:
        raise NsysReportError(f"{folder}: not an nsys recipe output of {', '.join(RECIPE_NAMES)} "
                              f"(its .nsys-analysis names {name!r})")
    out: dict[str, pl.DataFrame] = {}
    for table in ("all_stats", "rank_stats", "analysis"):
        pq = folder / f"{table}.parquet"
        if not pq.exists():
            continue
        df = pl.read_parquet(pq)
        df = df.drop([c for c in df.columns if c.startswith("__index_level")])
        cols = _STAT_COLS if table != "analysis" else \
            ({**_UTIL_COLS, "Duration": "duration_ns"} if name == "gpu_time_util" else _UTIL_COLS)
        df = df.rename({c: cols.get(c, re.sub(r"[^0-9a-z]+", "_", c.lower()).strip("_")) for c in df.columns})
        out[table] = df
    if not out:
        raise NsysReportError(f"{folder}: recipe {name} but none of all_stats / rank_stats / analysis .parquet")
    return out


def read_recipes(folder: str | Path) -> dict[str, dict[str, pl.DataFrame]]:
    """Every recipe output folder directly under ``folder`` → {recipe name: tables}."""
    out: dict[str, dict[str, pl.DataFrame]] = {}
    for d in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        if recipe_name(d) in RECIPE_NAMES:
            out[recipe_name(d)] = read_recipe(d)
    return out


def nccl_summary(recipe: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """The NCCL Summary (``nccl_sum``; or ``nccl_gpu_proj_sum``, the GPU side) as the page shows it: collective,
    calls, total_ms, mean_us, median_us, max_us, share_pct of all NCCL time."""
    s = recipe.get("all_stats")
    if s is None or s.height == 0:
        return pl.DataFrame()
    total = s["total_ns"].sum()
    return (s.select(pl.col("name").alias("collective"), pl.col("count").alias("calls"),
                     (pl.col("total_ns") / 1e6).alias("total_ms"), (pl.col("mean_ns") / 1e3).alias("mean_us"),
                     (pl.col("median_ns") / 1e3).alias("median_us"), (pl.col("max_ns") / 1e3).alias("max_us"),
                     (100 * pl.col("total_ns") / total).alias("share_pct"))
            .sort("total_ms", descending=True))


def gpu_utilisation(recipe: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """From ``cuda_gpu_time_util_map`` or ``nccl_gpu_time_util_map``: per GPU (device, pid), the bins, the bin width,
    the mean utilisation over the bins and the share of bins that are idle (0 %) or saturated (≥ 95 %). The
    recipe's utilisation of a bin is the % of its time covered by kernels."""
    a = recipe.get("analysis")
    if a is None or a.height == 0:
        return pl.DataFrame()
    col = "kernel_pct" if "kernel_pct" in a.columns else "all_pct"
    width = (a.sort("bin_start_ns").group_by("device", "pid", maintain_order=True)
             .agg(pl.col("bin_start_ns").diff().median().alias("bin_ns")))
    g = a.group_by("device", "pid", maintain_order=True).agg(
        pl.len().alias("bins"), pl.col(col).mean().alias("util_mean_pct"),
        (100 * (pl.col(col) == 0).mean()).alias("idle_bins_pct"),
        (100 * (pl.col(col) >= 95).mean()).alias("busy_bins_pct"),
        *([pl.col("nccl_pct").mean().alias("nccl_mean_pct"), pl.col("compute_pct").mean().alias("compute_mean_pct")]
          if "nccl_pct" in a.columns else []))
    return g.join(width, on=["device", "pid"]).with_columns((pl.col("bin_ns") / 1e6).alias("bin_ms")).drop("bin_ns")


def nccl_overlap(recipe: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """Communication/computation overlap per bin from ``nccl_gpu_time_util_map``: the recipe gives, per bin, the %
    of time covered by any kernel (All), by NCCL kernels and by the others (Compute), each a union over the GPU's
    streams, so NCCL + Compute − All is the % of the bin where both ran at once. Per GPU: nccl_pct and
    overlapped_pct (summed over bins, as % of one bin), and overlap_of_nccl_pct = the share of NCCL time that ran
    beside compute (100 − the exposed share)."""
    a = recipe.get("analysis")
    if a is None or a.height == 0 or "nccl_pct" not in a.columns:
        return pl.DataFrame()
    # the recipe rounds each % to 0.1: so is the difference (no float noise in "no overlap")
    a = a.with_columns((pl.col("nccl_pct") + pl.col("compute_pct") - pl.col("all_pct")).round(1).clip(lower_bound=0)
                       .alias("both_pct"))
    g = a.group_by("device", "pid", maintain_order=True).agg(
        pl.len().alias("bins"), (pl.col("nccl_pct") > 0).sum().alias("bins_with_nccl"),
        pl.col("nccl_pct").sum().alias("nccl_pct_sum"), pl.col("both_pct").sum().alias("both_pct_sum"))
    return g.with_columns(pl.when(pl.col("nccl_pct_sum") > 0)
                          .then(100 * pl.col("both_pct_sum") / pl.col("nccl_pct_sum")).otherwise(None)
                          .alias("overlap_of_nccl_pct"))


# ------------------------------------------------------------------------------------------------ one folder

def read_nsys_folder(folder: str | Path) -> tuple[dict[str, pl.DataFrame], dict[str, dict[str, pl.DataFrame]]]:
    """A folder of one capture's exports → ``(stats reports, recipes)``: the ``nsys stats`` CSVs directly in it or
    in ``<folder>/stats/``, the ``nsys recipe`` output folders directly in it or in ``<folder>/recipes/``. Raises
    :class:`NsysReportError` naming the folder when it is missing or has no ``<base>_cuda_gpu_kern_sum.csv``."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise NsysReportError(f"nsys_dir {folder}: no such folder")
    reports = read_stats_dir(folder)
    if not reports and (folder / "stats").is_dir():          # <dir>/stats/*.csv beside <dir>/recipes/<recipe>/
        reports = read_stats_dir(folder / "stats")
    if "cuda_gpu_kern_sum" not in reports:
        raise NsysReportError(f"nsys_dir {folder}: no <base>_cuda_gpu_kern_sum.csv among "
                              f"{sorted(x.name for x in folder.glob('*.csv')) or 'no CSV files'}")
    recipes: dict[str, dict[str, pl.DataFrame]] = {}
    for where in (folder, folder / "recipes"):
        if where.is_dir():
            recipes.update(read_recipes(where))
    return reports, recipes


METHOD_REPORTS = ("nccl", "gpu_util", "overlap", "osrt")


def method_reports(reports: dict[str, pl.DataFrame], recipes: dict[str, dict[str, pl.DataFrame]]
                   ) -> dict[str, pd.DataFrame]:
    """The method's other Nsight Systems reports from one folder's exports, rounded to 3 decimals, each empty when
    its input is missing: ``nccl`` (``nccl_sum``), ``gpu_util`` (``nccl_gpu_time_util_map``, else
    ``cuda_gpu_time_util_map``), ``overlap`` (``nccl_gpu_time_util_map``) and ``osrt`` (``osrt_sum``)."""
    util_map = recipes.get("nccl_gpu_time_util_map") or recipes.get("cuda_gpu_time_util_map") or {}
    frames = {"nccl": nccl_summary(recipes["nccl_sum"]) if "nccl_sum" in recipes else pl.DataFrame(),
              "gpu_util": gpu_utilisation(util_map),
              "overlap": nccl_overlap(recipes.get("nccl_gpu_time_util_map") or {}),
              "osrt": osrt_summary(reports["osrt_sum"]) if "osrt_sum" in reports else pl.DataFrame()}
    return {k: df.to_pandas().round(3) if df.height else pd.DataFrame() for k, df in frames.items()}
