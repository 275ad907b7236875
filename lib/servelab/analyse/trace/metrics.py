"""Per-rank timeline metrics: kernel breakdown, top kernels, idle gaps (host-bound vs other), CUDA-graph coverage,
device busy, launch delay, CPU threads, decode interference, communication per collective — and the per-window-kind
summary of :mod:`servelab.analyse.trace.exposed_comm`'s per-window rows (exposed communication, busy, idle).

Definitions (all times from the GPU op intervals of one device, int64 ns; busy, compute, comm and exposed comm as in
:mod:`servelab.analyse.trace.exposed_comm`):

- gap: a hole between consecutive busy intervals. ``host_bound`` when the op that ends the gap was not yet
  submitted when the GPU went idle (its launch call started after the gap began, or a direct launch was
  still in progress); ``other`` when it had been submitted earlier (stream/event dependency, peer wait);
  ``unknown`` when the op has no matching runtime call in the trace.
- CUDA-graph coverage: share of ops (and of op time) launched by ``cudaGraphLaunch``/``hipGraphLaunch``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from servelab.analyse.trace import intervals as iv
from servelab.analyse.trace.ops import KERNEL_CATS, SYNC_REGEX, RankOps, matches
from servelab.analyse.trace.taxonomy import short_name
from servelab.analyse.trace.nccl import parse_comm_name

KIND_ORDER = ("prefill", "decode", "mixed", "draft", "other", "all")


def gap_intervals(rops: RankOps, device: int | None = None, min_gap_ns: int = 0) -> pl.DataFrame:
    """Every idle hole between busy intervals of a device, classified.

    Columns: rank, device, gap_start_ns, gap_end_ns, gap_ns, category (host_bound | other | unknown),
    next_op (name of the op that ends the gap; both it and launcher keep the op table's dtype, categorical
    from the loader), launcher, after_sync (a synchronising runtime call ended
    inside the gap), window (when the gap lies inside one window's GPU span, else null), position
    (``in_step`` | ``between_steps`` | ``outside``).
    """
    ops = rops.ops.select("device", "ts_ns", "end_ns", "launch_ts_ns", "launch_end_ns", "graph", "name", "launcher")
    ops = ops if device is None else ops.filter(pl.col("device") == device)
    out = []
    for dev, dops in ops.group_by("device", maintain_order=True):
        if not dops["ts_ns"].is_sorted():          # the op table comes sorted by start: skip a full copy
            dops = dops.sort("ts_ns")
        ts = dops["ts_ns"].to_numpy()
        s, e = iv.union(ts, dops["end_ns"].to_numpy())
        gs, ge = iv.gaps(s, e)
        keep = (ge - gs) > min_gap_ns
        gs, ge = gs[keep], ge[keep]
        nxt = np.searchsorted(ts, ge, side="left")
        nxt = np.minimum(nxt, max(ts.size - 1, 0))
        launch_ts = dops["launch_ts_ns"].to_numpy()[nxt] if ts.size else np.array([])
        launch_end = dops["launch_end_ns"].to_numpy()[nxt] if ts.size else np.array([])
        graph = dops["graph"].to_numpy()[nxt] if ts.size else np.array([], dtype=bool)
        launch_ts = np.asarray(launch_ts, dtype=np.float64)   # nulls → nan
        launch_end = np.asarray(launch_end, dtype=np.float64)
        unknown = np.isnan(launch_ts)
        host = (~unknown) & ((launch_ts > gs) | ((~graph) & (launch_end > gs)))
        # codes, then names: a numpy array of strings costs ~5× more on a million gaps
        cat = pl.Series("category", np.where(unknown, 0, np.where(host, 1, 2)).astype(np.int8)).replace_strict(
            {0: "unknown", 1: "host_bound", 2: "other"}, return_dtype=pl.String)
        sync = rops.runtime.filter(matches(rops.runtime, "name", SYNC_REGEX))["end_ns"].sort().to_numpy()
        after_sync = (np.searchsorted(sync, ge, side="left") - np.searchsorted(sync, gs, side="right")) > 0 \
            if sync.size else np.zeros(gs.size, dtype=bool)
        nxt_ops = dops.select(pl.col("name").alias("next_op"), "launcher")[nxt] if ts.size else \
            pl.DataFrame(schema={"next_op": dops.schema["name"], "launcher": dops.schema["launcher"]})
        frame = pl.DataFrame({
            "rank": np.full(gs.size, rops.rank, dtype=np.int64), "device": np.full(gs.size, dev[0], dtype=np.int64),
            "gap_start_ns": gs, "gap_end_ns": ge, "gap_ns": ge - gs, "category": cat}).hstack(nxt_ops) \
            .with_columns(pl.Series("after_sync", after_sync))
        out.append(_place_gaps(frame, rops.windows))
    if not out:
        return pl.DataFrame(schema={"rank": pl.Int64, "device": pl.Int64, "gap_start_ns": pl.Int64,
                                    "gap_end_ns": pl.Int64, "gap_ns": pl.Int64, "category": pl.String,
                                    "next_op": pl.String, "launcher": pl.String, "after_sync": pl.Boolean,
                                    "window": pl.Int64, "kind": pl.String, "position": pl.String})
    return pl.concat(out, how="vertical_relaxed")


def _place_gaps(gaps: pl.DataFrame, windows: pl.DataFrame) -> pl.DataFrame:
    w = (windows.filter(pl.col("gpu_start_ns").is_not_null())
         .select("window", "kind", "gpu_start_ns", "gpu_end_ns").sort("gpu_start_ns"))
    if w.height == 0 or gaps.height == 0:
        return gaps.with_columns(pl.lit(None, dtype=pl.Int64).alias("window"), pl.lit(None, dtype=pl.String)
                                 .alias("kind"), pl.lit("outside").alias("position"))
    j = ((gaps if gaps["gap_start_ns"].is_sorted() else gaps.sort("gap_start_ns"))
         .join_asof(w, left_on="gap_start_ns", right_on="gpu_start_ns", strategy="backward"))
    first, last = int(w["gpu_start_ns"].min()), int(w["gpu_end_ns"].max())
    return (j.with_columns(
        (pl.col("gap_end_ns") <= pl.col("gpu_end_ns")).fill_null(False).alias("_in"))
        .with_columns(
            pl.when(pl.col("_in")).then(pl.col("window")).alias("window"),
            pl.when(pl.col("_in")).then(pl.col("kind")).alias("kind"),
            pl.when(pl.col("_in")).then(pl.lit("in_step"))
            .when((pl.col("gap_start_ns") >= first) & (pl.col("gap_end_ns") <= last)).then(pl.lit("between_steps"))
            .otherwise(pl.lit("outside")).alias("position"))
        .drop("_in", "gpu_start_ns", "gpu_end_ns"))


def summarise_windows(wm: pl.DataFrame) -> pl.DataFrame:
    """Window metrics aggregated per (rank, kind): sums of ms and the derived percentages."""
    if wm.height == 0:
        return wm
    g = (wm.group_by("rank", "kind")
         .agg(pl.len().alias("windows"), pl.col("gpu_span_ms").sum(), pl.col("busy_ms").sum(),
              pl.col("compute_ms").sum(), pl.col("comm_ms").sum(), pl.col("exposed_comm_ms").sum(),
              pl.col("idle_ms").sum(), pl.col("host_bound_idle_ms").sum(), pl.col("other_idle_ms").sum(),
              pl.col("gaps").sum(), pl.col("ops").sum(), pl.col("graph_ops").sum(),
              pl.col("gpu_span_ms").median().alias("median_step_ms")))
    return (g.with_columns(
        (100 * pl.col("busy_ms") / pl.col("gpu_span_ms")).alias("busy_pct"),
        (100 * pl.col("comm_ms") / pl.col("gpu_span_ms")).alias("comm_pct"),
        (100 * pl.col("exposed_comm_ms") / pl.col("gpu_span_ms")).alias("exposed_comm_pct"),
        pl.when(pl.col("comm_ms") > 0).then(100 * (1 - pl.col("exposed_comm_ms") / pl.col("comm_ms")))
        .alias("overlap_pct"),
        (100 * pl.col("host_bound_idle_ms") / pl.col("gpu_span_ms")).alias("host_bound_idle_pct"),
        (100 * pl.col("graph_ops") / pl.col("ops")).alias("graph_op_pct"))
        .with_columns(pl.col("kind").replace_strict({k: i for i, k in enumerate(KIND_ORDER)}, default=99)
                      .alias("_o"))
        .sort("rank", "_o").drop("_o"))


def breakdown_part(r: RankOps) -> pl.DataFrame:
    """One rank's share of :func:`kernel_breakdown`: GPU op ns and ops per (kind, class) — made where the rank is
    (a cluster worker), summed over ranks exactly by :func:`breakdown_from`."""
    return (r.ops.select(pl.col("kind").fill_null("outside steps"), "cls", "dur_ns")
            .group_by("kind", "cls").agg(pl.col("dur_ns").sum().alias("ns"), pl.len().alias("ops")))


def breakdown_from(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """:func:`kernel_breakdown` from the ranks' :func:`breakdown_part` tables."""
    g = (pl.concat(parts, how="vertical_relaxed").group_by("kind", "cls")
         .agg((pl.col("ns").sum() / 1e6).alias("total_ms"), pl.col("ops").sum().cast(pl.UInt32)))
    return (g.with_columns((100 * pl.col("total_ms") / pl.col("total_ms").sum().over("kind")).alias("share_pct"))
            .with_columns(pl.col("kind").replace_strict({k: i for i, k in enumerate(KIND_ORDER)}, default=99)
                          .alias("_o"))
            .sort("_o", "total_ms", descending=[False, True]).drop("_o"))


def kernel_breakdown(rops: list[RankOps]) -> pl.DataFrame:
    """GPU op time per (window kind, class), summed over ranks: total_ms, ops, share_pct of the kind's op time."""
    return breakdown_from([breakdown_part(r) for r in rops])


def top_part(r: RankOps) -> pl.DataFrame:
    """One rank's share of :func:`top_kernels`: per (kind, name) its class and subclass (the first op's), ops and
    ns, and the rank — merged exactly by :func:`top_from` (the mean is the summed ns over the summed count)."""
    return (r.ops.select(pl.col("kind").fill_null("outside steps"), "name", "cls", "subclass", "dur_ns")
            .group_by("kind", "name")
            .agg(pl.col("cls").first(), pl.col("subclass").first(), pl.len().alias("count"),
                 pl.col("dur_ns").sum().alias("ns"))
            .with_columns(pl.lit(r.rank).alias("rank")))


def top_from(parts: list[pl.DataFrame], top_n: int = 10, by_kind: bool = True) -> pl.DataFrame:
    """:func:`top_kernels` from the ranks' :func:`top_part` tables, in rank order (a kernel's class is its first
    rank's)."""
    keys = ["kind", "name"] if by_kind else ["name"]
    g = (pl.concat(parts, how="vertical_relaxed").group_by(*keys, maintain_order=True)
         .agg(pl.col("cls").first(), pl.col("subclass").first(), pl.col("count").sum().cast(pl.UInt32),
              (pl.col("ns").sum() / 1e6).alias("total_ms"),
              (pl.col("ns").sum() / pl.col("count").sum() / 1e3).alias("avg_us"),
              pl.col("rank").n_unique().alias("ranks")))
    if by_kind:
        g = g.with_columns((100 * pl.col("total_ms") / pl.col("total_ms").sum().over("kind")).alias("share_pct"),
                           pl.col("total_ms").rank("ordinal", descending=True).over("kind").alias("rank_in_kind"))
    else:
        g = g.with_columns((100 * pl.col("total_ms") / pl.col("total_ms").sum()).alias("share_pct"),
                           pl.col("total_ms").rank("ordinal", descending=True).alias("rank_in_kind"),
                           pl.lit("all").alias("kind"))
    g = g.filter(pl.col("rank_in_kind") <= top_n)
    g = g.with_columns(pl.col("name").map_elements(short_name, return_dtype=pl.String).alias("kernel"))
    return (g.with_columns(pl.col("kind").replace_strict({k: i for i, k in enumerate(KIND_ORDER)}, default=99)
                           .alias("_o"))
            .sort("_o", "rank_in_kind").drop("_o")
            .select("kind", "rank_in_kind", "kernel", "cls", "subclass", "count", "total_ms", "avg_us", "share_pct",
                    "ranks", pl.col("name").cast(pl.String)))


def top_kernels(rops: list[RankOps], top_n: int = 10, by_kind: bool = True) -> pl.DataFrame:
    """The ``top_n`` GPU ops by total time (summed over ranks) per window kind.

    Columns: kind, rank_in_kind, kernel (short name), cls, subclass, count, total_ms, avg_us, share_pct
    (of the kind's GPU op time), ranks (how many ranks ran it), name (full)."""
    return top_from([top_part(r) for r in rops], top_n, by_kind)


def device_busy(rops: RankOps, cats: tuple[str, ...] = (*KERNEL_CATS, "gpu_memcpy", "gpu_memset")) -> pl.DataFrame:
    """Per device of a rank: ops, busy_ms (union of op intervals of ``cats``), window_ms (first start → last
    end), busy_pct, streams."""
    ops = rops.ops.select("device", "cat", "stream", "ts_ns", "end_ns").filter(pl.col("cat").is_in(list(cats)))
    rows = []
    for dev, d in ops.group_by("device", maintain_order=True):
        s, e = iv.union(d["ts_ns"].to_numpy(), d["end_ns"].to_numpy())
        span = int(d["end_ns"].max() - d["ts_ns"].min())
        rows.append({"rank": rops.rank, "device": dev[0], "ops": d.height, "busy_ms": iv.total(s, e) / 1e6,
                     "window_ms": span / 1e6, "busy_pct": 100 * iv.total(s, e) / span if span else None,
                     "streams": d["stream"].n_unique()})
    return pl.DataFrame(rows)


def gap_summary(gaps: pl.DataFrame) -> pl.DataFrame:
    """Gaps per (rank, position, kind, category): count, total_ms, p50/p95/max gap in µs (nearest-rank
    quantiles), and how many followed a synchronising call."""
    if gaps.height == 0:
        return gaps
    return (gaps.with_columns(pl.col("kind").fill_null("-"))
            .group_by("rank", "position", "kind", "category")
            .agg(pl.len().alias("gaps"), (pl.col("gap_ns").sum() / 1e6).alias("total_ms"),
                 (pl.col("gap_ns").quantile(0.5, "nearest") / 1e3).alias("p50_us"),
                 (pl.col("gap_ns").quantile(0.95, "nearest") / 1e3).alias("p95_us"),
                 (pl.col("gap_ns").max() / 1e3).alias("max_us"),
                 pl.col("after_sync").sum().alias("after_sync"))
            .sort("rank", "position", "kind", "total_ms", descending=[False, False, False, True]))


def graph_part(r: RankOps) -> pl.DataFrame:
    """One rank's share of :func:`graph_coverage`: per step window its ops, graph-launched ops, their ns and the
    launchers seen, with the window's kind and batch size."""
    o = r.ops.filter(pl.col("window").is_not_null())
    per_w = o.group_by("window").agg(pl.len().alias("ops"), pl.col("graph").sum().alias("graph_ops"),
                                     pl.col("dur_ns").sum().alias("ns"),
                                     pl.col("dur_ns").filter(pl.col("graph")).sum().alias("graph_ns"),
                                     pl.col("launcher").drop_nulls().unique().cast(pl.String).sort()
                                     .str.join(", ").alias("launchers"))
    return (per_w.join(r.windows.select("window", "kind", "bs"), on="window", how="left")
            .with_columns(pl.lit(r.rank).alias("rank")))


def graph_from(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """:func:`graph_coverage` from the ranks' :func:`graph_part` tables."""
    if not parts:
        return pl.DataFrame()
    w = pl.concat(parts, how="vertical_relaxed")
    g = (w.group_by("kind", "bs")
         .agg(pl.len().alias("windows"),
              (pl.col("graph_ops") >= 0.9 * pl.col("ops")).sum().alias("windows_graphed"),
              pl.col("ops").sum(), pl.col("graph_ops").sum(), pl.col("ns").sum(), pl.col("graph_ns").sum(),
              pl.col("launchers").str.split(", ").list.explode(keep_nulls=False, empty_as_null=False).unique().sort()
              .str.join(", ").alias("launchers")))
    return (g.with_columns((100 * pl.col("graph_ops") / pl.col("ops")).alias("graph_op_pct"),
                           (100 * pl.col("graph_ns") / pl.col("ns")).alias("graph_time_pct"))
            .drop("ns", "graph_ns")
            .with_columns(pl.col("kind").replace_strict({k: i for i, k in enumerate(KIND_ORDER)}, default=99)
                          .alias("_o"))
            .sort("_o", "bs").drop("_o"))


def graph_coverage(rops: list[RankOps]) -> pl.DataFrame:
    """CUDA-graph coverage per (kind, bs): windows, windows_graphed (≥ 90 % of their ops from a graph
    launch), ops, graph_op_pct, graph_time_pct (of op time), launchers seen."""
    return graph_from([graph_part(r) for r in rops])


def launch_part(r: RankOps) -> pl.DataFrame:
    """One rank's launch → start delays (ns) with their window kind and whether a graph launched them:
    :func:`launch_stats`' quantiles need every value, so a rank's share is its values in three narrow columns
    (the kind a categorical code, the graph flag a bit), not its op table."""
    return (r.ops.filter(pl.col("launch_ts_ns").is_not_null())
            .select(pl.col("kind").fill_null("outside steps").cast(pl.Categorical), "graph",
                    (pl.col("ts_ns") - pl.col("launch_ts_ns")).alias("delay_ns")))


def launch_from(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """:func:`launch_stats` from the ranks' :func:`launch_part` tables."""
    ops = pl.concat(parts, how="vertical_relaxed") if parts else pl.DataFrame()
    if ops.height == 0:
        return pl.DataFrame()
    return (ops.group_by("kind", "graph")
            .agg(pl.len().alias("ops"), (pl.col("delay_ns").quantile(0.5, "nearest") / 1e3).alias("p50_us"),
                 (pl.col("delay_ns").quantile(0.95, "nearest") / 1e3).alias("p95_us"),
                 (pl.col("delay_ns").max() / 1e3).alias("max_us"))
            .select(pl.col("kind").cast(pl.String),
                    pl.when(pl.col("graph")).then(pl.lit("graph")).otherwise(pl.lit("direct")).alias("launch"),
                    "ops", "p50_us", "p95_us", "max_us")
            .sort("kind", "launch"))


def launch_stats(rops: list[RankOps]) -> pl.DataFrame:
    """Launch → start delay (GPU op start − launch call start, µs) per (kind, launch type), for direct
    launches and graph launches separately; nearest-rank quantiles."""
    return launch_from([launch_part(r) for r in rops])


def cpu_thread_busy(rops: RankOps) -> pl.DataFrame:
    """Per CPU thread: union of cpu_op / runtime / python_function intervals over the captured span —
    how busy the launching thread was (annotations excluded; without python tracing, Python time between
    ops is not seen, so this is a lower bound)."""
    ev = (rops.trace.events.lazy()
          .filter(pl.col("cat").is_in(["cpu_op", "cuda_runtime", "cuda_driver", "python_function"])
                  & pl.col("dur_ns").is_not_null() & pl.col("tid").is_not_null())
          .select("pid", "tid", "ts_ns", "dur_ns").collect())
    ops = rops.ops
    if ev.height == 0 or ops.height == 0:
        return pl.DataFrame()
    t0, t1 = int(ops["ts_ns"].min()), int(ops["end_ns"].max())
    rows = []
    for (pid, tid), d in ev.group_by("pid", "tid", maintain_order=True):
        s, e = iv.union(d["ts_ns"].to_numpy(), (d["ts_ns"] + d["dur_ns"]).to_numpy())
        busy = int(iv.covered_in(s, e, np.array([t0]), np.array([t1]))[0])
        rows.append({"rank": rops.rank, "pid": pid, "tid": tid, "events": d.height, "busy_ms": busy / 1e6,
                     "span_ms": (t1 - t0) / 1e6, "busy_pct": 100 * busy / (t1 - t0) if t1 > t0 else None})
    return pl.DataFrame(rows).sort("busy_ms", descending=True)


def decode_interference(rops: RankOps) -> pl.DataFrame:
    """How long each decode-carrying step waited on the GPU, and how much prefill work ran before it.

    Steps (windows) are taken in GPU order. For every decode or mixed step: ``interval_ms`` = its GPU end −
    the previous decode-carrying step's GPU end (the token interval as the GPU delivers it);
    ``prefill_between_ms`` = GPU time of prefill-phase windows in between (their op time); ``baseline_ms`` =
    median interval of decode steps with no prefill in between; ``delay_ms`` = interval − baseline;
    ``queued_ms`` = GPU start − CPU start of the step (how long its launches waited behind earlier work);
    ``prefill_span_ms`` = GPU wall time of those prefill windows (first op start → last op end, summed).
    """
    w = (rops.windows.filter(pl.col("gpu_start_ns").is_not_null()).sort("gpu_start_ns")
         .select("window", "name", "kind", "phase", "cpu_start_ns", "gpu_start_ns", "gpu_end_ns", "gpu_op_ns"))
    if w.height == 0 or "phase" not in w.columns:
        return pl.DataFrame()
    rows = []
    prev_end = None
    prefill_ns, prefill_span, prefill_names = 0, 0, []
    for r in w.iter_rows(named=True):
        if r["phase"] == "prefill":
            prefill_ns += r["gpu_op_ns"] or 0
            prefill_span += r["gpu_end_ns"] - r["gpu_start_ns"]
            prefill_names.append(r["name"])
            continue
        if r["phase"] not in ("decode", "mixed"):
            continue
        if prev_end is not None:
            rows.append({"rank": rops.rank, "window": r["window"], "name": r["name"], "phase": r["phase"],
                         "interval_ms": (r["gpu_end_ns"] - prev_end) / 1e6,
                         "step_ms": (r["gpu_end_ns"] - r["gpu_start_ns"]) / 1e6,
                         "queued_ms": (r["gpu_start_ns"] - r["cpu_start_ns"]) / 1e6,
                         "prefill_between_ms": prefill_ns / 1e6, "prefill_span_ms": prefill_span / 1e6,
                         "prefill_windows": ", ".join(prefill_names)})
        prev_end = r["gpu_end_ns"]
        prefill_ns, prefill_span, prefill_names = 0, 0, []
    if not rows:
        return pl.DataFrame()
    df = pl.DataFrame(rows)
    clean = df.filter((pl.col("phase") == "decode") & (pl.col("prefill_between_ms") == 0))
    if clean.height == 0:
        clean = df.filter(pl.col("prefill_between_ms") == 0)
    base = float(clean["interval_ms"].median()) if clean.height else None
    return df.with_columns(pl.lit(base, dtype=pl.Float64).alias("baseline_ms"),
                           (pl.col("interval_ms") - pl.lit(base, dtype=pl.Float64)).alias("delay_ms"))


def comm_by_collective(rops: list[RankOps]) -> pl.DataFrame:
    """Communication per (rank, window kind, collective): ops, comm_ms (union per step window, summed over the
    windows as in :func:`servelab.analyse.trace.exposed_comm.window_metrics`) and exposed_ms (not covered by compute
    on the same GPU). Separates TP collectives (AllReduce, AllGather, ...) from PP SendRecv, whose kernel time
    includes waiting for the other stage."""
    rows = []
    for r in rops:
        ops = r.ops.select("device", "cat", "cls", "name", "kind", "window", "ts_ns", "end_ns")   # not every column
        comm = ops.filter(pl.col("cls") == "communication")
        if comm.height == 0:
            continue
        coll = {n: (parse_comm_name(n)["collective"] or "other") for n in comm["name"].unique().to_list()}
        comm = comm.with_columns(pl.col("name").replace_strict(coll, return_dtype=pl.String).alias("collective"),
                                 pl.col("kind").fill_null("outside steps"))
        for dev, d in comm.group_by("device", maintain_order=True):
            dev_ops = ops.filter((pl.col("device") == dev[0]) & pl.col("cat").is_in(list(KERNEL_CATS))
                                   & (pl.col("cls") != "communication"))
            cs, ce = iv.union(dev_ops["ts_ns"].to_numpy(), dev_ops["end_ns"].to_numpy())
            keys = (d.group_by("kind", "collective", maintain_order=True).agg(pl.len().alias("ops"))
                    .with_row_index("_k"))
            d = d.join(keys.select("kind", "collective", "_k"), on=["kind", "collective"], how="left")
            # one union per (kind, collective, step window) as trace_summary's comm / exposed, all in one pass:
            # the group id folds the window in (no window: its own group)
            w = d["window"].fill_null(-1).to_numpy().astype(np.int64) + 1
            span = int(w.max()) + 1
            g, s, e = iv.union_grouped(d["_k"].to_numpy().astype(np.int64) * span + w, d["ts_ns"].to_numpy(),
                                       d["end_ns"].to_numpy())
            total = np.zeros(keys.height, dtype=np.int64)
            covered = np.zeros(keys.height, dtype=np.int64)
            np.add.at(total, g // span, e - s)
            np.add.at(covered, g // span, iv.covered_in(cs, ce, s, e))
            for k, (kind, c, n) in enumerate(keys.select("kind", "collective", "ops").iter_rows()):
                rows.append({"rank": r.rank, "kind": kind, "collective": c, "ops": n, "comm_ms": int(total[k]) / 1e6,
                             "exposed_ms": int(total[k] - covered[k]) / 1e6})
    return pl.DataFrame(rows) if rows else pl.DataFrame(schema={"rank": pl.Int64, "kind": pl.String,
                                                                "collective": pl.String, "ops": pl.Int64,
                                                                "comm_ms": pl.Float64, "exposed_ms": pl.Float64})


def event_census(t) -> pl.DataFrame | None:
    """One rank's event census (a :class:`RankTrace`): events and total duration (ms) per (phase type, Kineto
    category); None for a trace without events."""
    ev = t.events
    # counting on the categorical codes with numpy: a group_by over millions of rows costs ~10× more
    ph = ev["ph"].to_physical().to_numpy().astype(np.int64)
    cat = ev["cat"].to_physical().to_numpy().astype(np.int64)
    width = int(cat.max()) + 1 if cat.size else 1
    key = ph * width + cat
    if key.size == 0:
        return None
    if int(key.max()) >= 50_000_000:      # absurd code ranges: fall back to polars
        return (ev.group_by(pl.col("ph").cast(pl.String), pl.col("cat").cast(pl.String))
                .agg(pl.len().cast(pl.Int64).alias("events"), (pl.col("dur_ns").sum() / 1e6).alias("total_ms"))
                .with_columns(pl.lit(t.rank, dtype=pl.Int64).alias("rank")))
    dur = ev["dur_ns"].fill_null(0).to_numpy()
    counts = np.bincount(key)
    ms = np.bincount(key, weights=dur) / 1e6
    present = np.flatnonzero(counts)
    first = np.full(counts.size, -1, dtype=np.int64)
    first[key[::-1]] = np.arange(key.size, dtype=np.int64)[::-1]
    rows = first[present]
    return pl.DataFrame({"rank": np.full(present.size, t.rank, dtype=np.int64),
                         "ph": ev["ph"].gather(rows).cast(pl.String),
                         "cat": ev["cat"].gather(rows).cast(pl.String),
                         "events": counts[present].astype(np.int64), "total_ms": ms[present]})


DOMINANT_SHARE = 0.5     # one step holding at least this share of a window kind's exposed communication dominates it
WAIT_SHARE = 0.25        # ... and is a wait when the ranks started it this share of its exposed time apart (or more)


def dominant_steps(window_metrics: pl.DataFrame, step_skew: pl.DataFrame) -> list[dict[str, Any]]:
    """Window kinds whose exposed communication is mostly one step that is a wait (summed over ranks, ≥
    :data:`DOMINANT_SHARE` of the kind's, with at least three steps of the kind, and the ranks started that step
    at least :data:`WAIT_SHARE` of its exposed time apart: one rank waiting in a collective for another to arrive —
    typical of a first step, not of the steady state): which step, its share, the kind's exposed share of GPU step
    time with and without it, and the start skew."""
    w = window_metrics
    if w is None or not w.height or "exposed_comm_ms" not in w.columns:
        return []
    out = []
    for kind in w["kind"].unique().to_list():
        k = w.filter(pl.col("kind") == kind)
        per = k.group_by("name").agg(pl.col("exposed_comm_ms").sum(), pl.col("gpu_span_ms").sum()).sort(
            "exposed_comm_ms", descending=True)
        total, span = float(per["exposed_comm_ms"].sum()), float(per["gpu_span_ms"].sum())
        if per.height < 3 or total <= 0 or span <= 0:
            continue
        top = per.row(0, named=True)
        share = top["exposed_comm_ms"] / total
        if share < DOMINANT_SHARE:
            continue
        rest_span = span - top["gpu_span_ms"]
        skew = step_skew.filter(pl.col("name") == top["name"]) if step_skew.height else step_skew
        sk = skew.row(0, named=True) if skew.height else {}
        if (sk.get("start_skew_us") or 0) / 1e3 < WAIT_SHARE * top["exposed_comm_ms"]:
            continue                       # a long step, not a rank waiting for another: its cost is real
        out.append({"kind": kind, "step": top["name"], "exposed_ms": top["exposed_comm_ms"], "total_ms": total,
                    "share_pct": 100 * share, "exposed_pct": 100 * total / span,
                    "without_pct": 100 * (total - top["exposed_comm_ms"]) / rest_span if rest_span > 0 else None,
                    "start_skew_us": sk.get("start_skew_us"), "late_rank": sk.get("last_rank"),
                    "first_rank": sk.get("first_rank")})
    return out
