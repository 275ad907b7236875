"""Phase 3's Nsight Systems section: import the ``nsys stats`` CSVs of a folder and put their kernels next to the
same kernels of the analysed trace, or say how to produce them. Phase 3's :func:`run` calls :func:`nsys_import`; the
page shows :func:`nsys_view`."""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import polars as pl
from IPython.display import HTML

from servelab.analyse.kernels import function_base
from servelab.core.run import FILL_IN
from servelab.analyse.trace.nsys import compare_kernels, method_reports, read_nsys_folder
from servelab.measure.nsys_capture import display, nsys_profile_argv, nsys_stats_argv
from servelab.core.scope import RunScope
from servelab.report.banner import banner, banner_html
from servelab.report.tables import table_html


@dataclass
class NsysImport:
    """``nsys stats --format csv`` reports of one folder, and their kernels next to this trace's."""
    folder: str
    reports: dict[str, pl.DataFrame]
    kernels: pd.DataFrame        # nsys kernel summary, classified, with the trace's time for the same kernel
    classes: pd.DataFrame        # kernel time share per class: nsys vs the trace
    # the method's other Nsight Systems reports, when the folder holds them (empty otherwise)
    nccl: pd.DataFrame = field(default_factory=pd.DataFrame)       # nccl_sum (NCCL's NVTX API ranges)
    gpu_util: pd.DataFrame = field(default_factory=pd.DataFrame)   # cuda/nccl_gpu_time_util_map
    overlap: pd.DataFrame = field(default_factory=pd.DataFrame)    # from nccl_gpu_time_util_map
    osrt: pd.DataFrame = field(default_factory=pd.DataFrame)       # osrt_sum, top calls
    recipes: list = field(default_factory=list)


def nsys_howto(trace_dir: str = "") -> str:
    """How to produce the CSVs this section imports (the commands of ``docs/method.md#capture-scenarios``)."""
    prof = display(nsys_profile_argv(["ENGINE_COMMAND"], "/data/nsys/report"))
    stats = display(nsys_stats_argv("/data/nsys/report.nsys-rep"))
    return (f"Profile the engine under Nsight Systems: {prof} — then export the summaries as CSV: {stats} "
            "(writes report_cuda_gpu_kern_sum.csv, report_cuda_api_sum.csv, report_nvtx_sum.csv; add osrt_sum for "
            "the OS runtime, and nsys recipe nccl_sum / nccl_gpu_time_util_map --input /data/nsys/report.nsys-rep "
            "--output /data/nsys/nccl_sum (and /data/nsys/nccl_gpu_time_util_map) for the NCCL summary, GPU "
            "utilisation and overlap) and re-run this phase with -p nsys_dir=/data/nsys. Fill in: ENGINE_COMMAND — "
            f"{FILL_IN['ENGINE_COMMAND']}.")


def nsys_import(ctx: RunScope, p: Any, nsys_dir: str = "", top_n: int = 10) -> NsysImport | None:
    """Import the ``nsys stats`` CSVs of ``nsys_dir`` (``<base>_cuda_gpu_kern_sum.csv`` and the other reports
    :mod:`servelab.analyse.trace.nsys` knows) and put the ``top_n`` kernels of the Nsight Systems summary next to
    the same kernels in the trace of the Phase 3 analysis ``p`` (matched on the function name,
    ``ncu --kernel-name-base function`` style), plus the time share per kernel class on both sides. Writes
    ``nsys_kernels.csv`` and ``nsys_classes.csv``. ``None`` when ``nsys_dir`` is empty."""
    if not nsys_dir:
        return None
    folder = Path(nsys_dir).expanduser()
    reports, recipes = read_nsys_folder(folder)
    kernels, classes = compare_kernels(reports["cuda_gpu_kern_sum"], [r.ops for r in p.analysis.rops], function_base,
                                       top_n)
    kernels.to_csv(ctx.phase_dir / "nsys_kernels.csv", index=False)
    classes.to_csv(ctx.phase_dir / "nsys_classes.csv", index=False)
    out = method_reports(reports, recipes)
    for name, t in out.items():
        if not t.empty:
            t.to_csv(ctx.phase_dir / f"nsys_{name}.csv", index=False)
    return NsysImport(str(folder), reports, kernels.round(3), classes.round(3), recipes=sorted(recipes), **out)


def nsys_view(imp: NsysImport | None) -> Any:
    """The Nsight Systems section: the imported kernels next to the trace's and the class shares — or, without
    ``nsys_dir``, how to produce the CSVs."""
    if imp is None:
        return banner(nsys_howto(), "info", "No Nsight Systems reports imported (nsys_dir is empty)")
    found = ", ".join(f"{name} ({df.height} rows)" for name, df in sorted(imp.reports.items()))
    matched = int(imp.kernels["in_trace"].sum())
    text = (f"From {imp.folder}: {found}. {matched} of the {len(imp.kernels)} top Nsight Systems kernels are in this "
            "trace too (same function name); shares are of each side's own kernel time, so a capture of a different "
            "run or length compares by share, not by milliseconds.")
    parts = [banner_html(text, "info", "Nsight Systems stats imported"), table_html(imp.kernels),
             "<p><b>Kernel time per class</b> (the trace taxonomy on both sides)</p>", table_html(imp.classes)]
    sections = (
        ("nccl", "NCCL summary (recipe nccl_sum: NCCL's own NVTX ranges, one per API call; times of the calls, not "
                 "of their kernels)"),
        ("gpu_util", "GPU utilisation (recipe nccl_gpu_time_util_map, else cuda_gpu_time_util_map: % of each time bin "
                     "covered by kernels, averaged over the bins)"),
        ("overlap", "Communication/computation overlap (from nccl_gpu_time_util_map: NCCL + compute − all = the % of a "
                    "bin where both ran; overlap_of_nccl_pct = the share of NCCL time that ran beside compute)"),
        ("osrt", "OS runtime (osrt_sum: the host threads' libc/pthread calls by total time)"))
    for key, caption in sections:
        t = getattr(imp, key)
        if not t.empty:
            parts += [f"<p><b>{html.escape(caption)}</b></p>", table_html(t)]
    missing = [k for k, _ in sections if getattr(imp, k).empty]
    if missing:
        parts.append(banner_html("Not in this folder: " + ", ".join(missing) + " — run nsys stats -r osrt_sum and "
                                 "nsys recipe nccl_sum / nccl_gpu_time_util_map on the report (servelab.analyse.trace."
                                 "nsys.nsys_recipe_argv) and put their folders beside the CSVs.", "info",
                                 "Some Nsight Systems reports missing"))
    return HTML("".join(parts))
