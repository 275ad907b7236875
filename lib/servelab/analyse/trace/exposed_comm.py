"""Exposed communication — the method's headline trace metric: communication time on the critical path, per step
window and device (:func:`window_metrics`), with the window's busy time, idle time and CUDA-graph share beside it.

Definitions (all times from the GPU op intervals of one device, int64 ns):

- busy: length of the union of GPU op intervals (kernels + memcpy + memset) inside the window's GPU span.
- compute: kernels whose class is not ``communication``; comm: ops of class ``communication``.
- exposed comm: comm time (union) not covered by any compute kernel on the same device — time on the
  critical path spent only communicating. overlap % = 1 − exposed / comm.
- idle and its host-bound part: the window's gaps as :func:`servelab.analyse.trace.metrics.gap_intervals` finds
  and classifies them.

Per window kind these rows are summed by :func:`servelab.analyse.trace.metrics.summarise_windows`; the same exposed
time per collective is :func:`servelab.analyse.trace.metrics.comm_by_collective`.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from servelab.analyse.trace import intervals as iv
from servelab.analyse.trace.metrics import gap_intervals
from servelab.analyse.trace.ops import KERNEL_CATS, RankOps


def window_metrics(rops: RankOps, gaps: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per (window, device): GPU span, busy, comm, exposed comm, idle, host-bound idle, graph share.

    Columns (ms unless named otherwise): rank, device, window, name, kind, bs, toks, gpu_span_ms, busy_ms,
    busy_pct, compute_ms (union), comm_ms (union), exposed_comm_ms, overlap_pct, idle_ms, host_bound_idle_ms,
    other_idle_ms, gaps, ops, graph_ops, graph_op_pct, cpu_span_ms, launch_to_gpu_ms.
    ``gaps``: the rank's :func:`gap_intervals` (all gaps, no minimum) when already computed.
    """
    ops = rops.ops.select("device", "window", "cat", "cls", "ts_ns", "end_ns", "graph")  # not every column
    rows = []
    for dev, dops in ops.filter(pl.col("window").is_not_null()).group_by("device", maintain_order=True):
        device = dev[0]
        all_ops = ops.filter(pl.col("device") == device)
        s_all, e_all = iv.union(all_ops["ts_ns"].to_numpy(), all_ops["end_ns"].to_numpy())
        comp = all_ops.filter(pl.col("cat").is_in(list(KERNEL_CATS)) & (pl.col("cls") != "communication"))
        s_cmp, e_cmp = iv.union(comp["ts_ns"].to_numpy(), comp["end_ns"].to_numpy())
        spans = (dops.group_by("window").agg(
            pl.col("ts_ns").min().alias("g0"), pl.col("end_ns").max().alias("g1"), pl.len().alias("ops"),
            pl.col("graph").sum().alias("graph_ops")).sort("window"))
        w = spans["window"].to_numpy()
        g0, g1 = spans["g0"].to_numpy(), spans["g1"].to_numpy()
        busy = iv.covered_in(s_all, e_all, g0, g1)
        compute = iv.covered_in(s_cmp, e_cmp, g0, g1)
        comm_ops = dops.filter(pl.col("cls") == "communication")
        cg, cs, ce = iv.union_grouped(comm_ops["window"].to_numpy(), comm_ops["ts_ns"].to_numpy(),
                                      comm_ops["end_ns"].to_numpy())
        pos = np.searchsorted(w, cg)
        comm = np.bincount(pos, weights=(ce - cs), minlength=w.size) if cg.size else np.zeros(w.size)
        exposed_seg = (ce - cs) - iv.covered_in(s_cmp, e_cmp, cs, ce)
        exposed = np.bincount(pos, weights=exposed_seg, minlength=w.size) if cg.size else np.zeros(w.size)
        dgaps = gap_intervals(rops, device=device) if gaps is None else gaps.filter(pl.col("device") == device)
        inside = dgaps.filter(pl.col("window").is_not_null()).group_by("window").agg(
            pl.col("gap_ns").sum().alias("idle_ns"),
            pl.col("gap_ns").filter(pl.col("category") == "host_bound").sum().alias("host_ns"),
            pl.len().alias("gaps"))
        frame = pl.DataFrame({
            "rank": np.full(w.size, rops.rank), "device": np.full(w.size, device), "window": w,
            "busy_ns": busy, "compute_ns": compute, "comm_ns": comm.astype(np.int64),
            "exposed_ns": exposed.astype(np.int64), "ops": spans["ops"].to_numpy(),
            "graph_ops": spans["graph_ops"].to_numpy(), "span_ns": g1 - g0})
        frame = frame.join(inside, on="window", how="left").with_columns(
            pl.col("idle_ns").fill_null(0), pl.col("host_ns").fill_null(0), pl.col("gaps").fill_null(0))
        rows.append(frame)
    if not rows:
        return pl.DataFrame()
    df = pl.concat(rows, how="vertical_relaxed")
    meta = rops.windows.select("window", "name", "kind", "bs", "toks", "cpu_span_ms", "launch_to_gpu_ms")
    return (df.join(meta, on="window", how="left")
            .with_columns(
                (pl.col("span_ns") / 1e6).alias("gpu_span_ms"),
                (pl.col("busy_ns") / 1e6).alias("busy_ms"),
                (100 * pl.col("busy_ns") / pl.col("span_ns")).alias("busy_pct"),
                (pl.col("compute_ns") / 1e6).alias("compute_ms"),
                (pl.col("comm_ns") / 1e6).alias("comm_ms"),
                (pl.col("exposed_ns") / 1e6).alias("exposed_comm_ms"),
                pl.when(pl.col("comm_ns") > 0).then(100 * (1 - pl.col("exposed_ns") / pl.col("comm_ns")))
                .alias("overlap_pct"),
                (pl.col("idle_ns") / 1e6).alias("idle_ms"),
                (pl.col("host_ns") / 1e6).alias("host_bound_idle_ms"),
                ((pl.col("idle_ns") - pl.col("host_ns")) / 1e6).alias("other_idle_ms"),
                (100 * pl.col("graph_ops") / pl.col("ops")).alias("graph_op_pct"))
            .select("rank", "device", "window", "name", "kind", "bs", "toks", "gpu_span_ms", "busy_ms", "busy_pct",
                    "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_pct", "idle_ms", "host_bound_idle_ms",
                    "other_idle_ms", "gaps", "ops", "graph_ops", "graph_op_pct", "cpu_span_ms", "launch_to_gpu_ms")
            .sort("rank", "window"))
