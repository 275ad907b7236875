"""Figures for the Phase 3 page (plotly; each function takes frames / the analysis and returns a Figure).

The timeline draws one row per (rank, stream) with GPU ops coloured by kernel class. Big traces are
downsampled per row: ops of one class closer than ``span / max_segments`` merge into one segment, so a
row never carries more than about ``max_segments`` segments per class whatever the trace size.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl

from servelab.analyse.trace import intervals as iv
from servelab.analyse.trace.analysis import CaptureAnalysis
from servelab.analyse.trace.taxonomy import CLASSES

CLASS_COLORS = {
    "gemm": "#4C78A8", "attention": "#F58518", "moe": "#B279A2", "communication": "#E45756",
    "norm_rope": "#72B7B2", "quant": "#EECA3B", "memory": "#9D755D", "other": "#BAB0AC",
}
KIND_COLORS = {"prefill": "rgba(245,133,24,0.12)", "decode": "rgba(76,120,168,0.12)",
               "mixed": "rgba(178,121,162,0.14)", "draft": "rgba(114,183,178,0.14)",
               "other": "rgba(150,150,150,0.10)", "all": "rgba(150,150,150,0.06)"}


def _row_segments(s: np.ndarray, e: np.ndarray, cls: np.ndarray, t0: int, t1: int, max_segments: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Segments (start, end, class) to draw for one row. Exact ops when there are at most ``max_segments``;
    otherwise [t0, t1] is cut into ``max_segments`` bins, each bin gets the class with the most busy time
    in it (exact per-class interval unions), bins less than half busy stay empty (idle shows), and
    neighbouring bins of one class merge. Returns (start, end, class, bin width ns; 0 = exact)."""
    if s.size <= max_segments:
        return s, e, cls, 0
    width = max(-(-(t1 - t0) // max_segments), 1)
    edges = t0 + width * np.arange(max_segments + 1, dtype=np.int64)
    classes = np.unique(cls)
    busy = np.zeros((classes.size, max_segments), dtype=np.int64)
    for i, c in enumerate(classes):
        m = cls == c
        us, ue = iv.union(s[m], e[m])
        busy[i] = np.diff(iv.covered_before(us, ue, edges))
    total = busy.sum(axis=0)
    dom = np.argmax(busy, axis=0)
    shown = total * 2 >= width
    seg_cls = np.where(shown, dom, -1)
    change = np.r_[True, seg_cls[1:] != seg_cls[:-1]]
    starts = np.flatnonzero(change)
    ends = np.r_[starts[1:], max_segments]
    keep = seg_cls[starts] >= 0
    starts, ends = starts[keep], ends[keep]
    return edges[starts], edges[ends], classes[seg_cls[starts]], width


def timeline(a: CaptureAnalysis, max_segments: int = 600, t0_ms: float | None = None,
             t1_ms: float | None = None, show_windows: bool = True) -> go.Figure:
    """Per-rank GPU timeline: rows = rank · stream, bars = ops by class (aligned clocks), step windows shaded.

    ``t0_ms``/``t1_ms`` zoom into a time range (ms from the first op). A row with more than
    ``max_segments`` ops is drawn binned: each of ``max_segments`` bins shows its dominant class (see
    :func:`_row_segments`); zoom in to see single kernels."""
    off = a.alignment.offsets_ns
    parts = []
    for r in a.rops:
        o = r.ops.select("rank", "stream", "cls", "ts_ns", "end_ns")
        parts.append(o.with_columns(pl.col("ts_ns") - off.get(r.rank, 0), pl.col("end_ns") - off.get(r.rank, 0)))
    ops = pl.concat(parts, how="vertical_relaxed") if parts else pl.DataFrame()
    fig = go.Figure()
    if ops.height == 0:
        fig.update_layout(title="GPU timeline: no GPU ops in this capture")
        return fig
    base = int(ops["ts_ns"].min())
    ops = ops.with_columns(((pl.col("ts_ns") - base)).alias("s"), ((pl.col("end_ns") - base)).alias("e"))
    if t0_ms is not None:
        ops = ops.filter(pl.col("e") >= int(t0_ms * 1e6))
    if t1_ms is not None:
        ops = ops.filter(pl.col("s") <= int(t1_ms * 1e6))
    if ops.height == 0:
        fig.update_layout(title="GPU timeline: no ops in the chosen range")
        return fig
    lo = int(t0_ms * 1e6) if t0_ms is not None else int(ops["s"].min())
    hi = int(t1_ms * 1e6) if t1_ms is not None else int(ops["e"].max())
    rows = ops.select("rank", "stream").unique().sort("rank", "stream")
    labels = [f"rank {rk} · stream {st}" for rk, st in rows.iter_rows()]
    ypos = {key: i for i, key in enumerate(rows.iter_rows())}
    by_cls: dict[str, tuple[list, list]] = {}
    widths = []
    for (rk, st), g in ops.group_by("rank", "stream"):
        s, e, c, wdt = _row_segments(g["s"].to_numpy(), g["e"].to_numpy(), g["cls"].to_numpy().astype(str), lo, hi,
                                     max_segments)
        widths.append(wdt)
        y = ypos[(rk, st)]
        for cl in np.unique(c):
            m = c == cl
            xs, ys = by_cls.setdefault(str(cl), ([], []))
            xs.append(np.column_stack([s[m] / 1e6, e[m] / 1e6, np.full(m.sum(), np.nan)]).ravel())
            ys.append(np.column_stack([np.full(m.sum(), y), np.full(m.sum(), y), np.full(m.sum(), np.nan)]).ravel())
    n_seg = 0
    for cls in [c for c in CLASSES if c in by_cls] + sorted(set(by_cls) - set(CLASSES)):
        xs, ys = by_cls[cls]
        x = np.concatenate(xs)
        n_seg += x.size // 3
        fig.add_trace(go.Scatter(x=x, y=np.concatenate(ys), mode="lines", name=cls,
                                 line={"color": CLASS_COLORS.get(cls, "#666"), "width": 14},
                                 hovertemplate=f"{cls}<br>%{{x:.3f}} ms<extra></extra>"))
    if show_windows and a.windows.height:
        w = a.windows.filter(pl.col("gpu_start_ns").is_not_null())
        shapes = []
        for r in w.iter_rows(named=True):
            s = (r["gpu_start_ns"] - off.get(r["rank"], 0) - base) / 1e6
            e = (r["gpu_end_ns"] - off.get(r["rank"], 0) - base) / 1e6
            if t0_ms is not None and e < t0_ms or t1_ms is not None and s > t1_ms:
                continue
            ys_rank = [ypos[k] for k in ypos if k[0] == r["rank"]]
            if not ys_rank:
                continue
            shapes.append({"type": "rect", "xref": "x", "yref": "y", "x0": s, "x1": e,
                           "y0": min(ys_rank) - 0.45, "y1": max(ys_rank) + 0.45, "line": {"width": 0},
                           "fillcolor": KIND_COLORS.get(r["kind"], KIND_COLORS["other"]), "layer": "below"})
        if len(shapes) <= 2000:
            fig.update_layout(shapes=shapes)
    binned = max(widths) if widths else 0
    how = f"binned to {binned / 1e3:.1f} µs, dominant class per bin" if binned else "every op drawn"
    fig.update_layout(
        title={"text": f"GPU timeline by kernel class — {len(a.rops)} ranks, clocks aligned, {how}; "
                       f"shaded = step windows", "font": {"size": 14}},
        xaxis_title="time since first GPU op (ms)",
        yaxis={"tickmode": "array", "tickvals": list(range(len(labels))), "ticktext": labels,
               "autorange": "reversed"},
        template="plotly_white", height=max(280, 150 + 46 * len(labels)),
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0}, margin={"l": 140, "t": 90})
    return fig


def breakdown_bar(breakdown: pl.DataFrame) -> go.Figure:
    """Stacked horizontal bars: share of GPU op time by kernel class per window kind."""
    fig = go.Figure()
    if breakdown.height == 0:
        return fig.update_layout(title="Kernel breakdown: no data")
    kinds = list(dict.fromkeys(breakdown["kind"].to_list()))
    for cls in [c for c in CLASSES if c in set(breakdown["cls"].to_list())]:
        sub = breakdown.filter(pl.col("cls") == cls)
        m = {k: (v, t) for k, v, t in sub.select("kind", "share_pct", "total_ms").iter_rows()}
        fig.add_trace(go.Bar(y=kinds, x=[m.get(k, (0, 0))[0] for k in kinds], name=cls, orientation="h",
                             marker_color=CLASS_COLORS.get(cls), customdata=[m.get(k, (0, 0))[1] for k in kinds],
                             hovertemplate=f"{cls}: %{{x:.1f}}%% (%{{customdata:.2f}} ms)<extra></extra>"))
    fig.update_layout(barmode="stack", title="GPU op time by kernel class per window kind (all ranks)",
                      template="plotly_white",
                      xaxis_title="share of the kind's GPU op time (%)", height=120 + 50 * len(kinds),
                      legend={"orientation": "h", "y": -0.3})
    return fig


def top_kernels_bar(top: pl.DataFrame, kind: str | None = None) -> go.Figure:
    """Top kernels of one window kind (default: the first kind present) as horizontal bars (ms)."""
    if top.height == 0:
        return go.Figure().update_layout(title="Top kernels: no data")
    kind = kind or top["kind"][0]
    t = top.filter(pl.col("kind") == kind).sort("total_ms")
    fig = go.Figure(go.Bar(y=t["kernel"].to_list(), x=t["total_ms"].to_list(), orientation="h",
                           marker_color=[CLASS_COLORS.get(c, "#666") for c in t["cls"].to_list()],
                           hovertemplate="%{y}<br>%{x:.2f} ms<extra></extra>"))
    return fig.update_layout(title=f"Top kernels — {kind} (total ms, all ranks)", xaxis_title="ms",
                             template="plotly_white",
                             height=120 + 28 * t.height, margin={"l": 320})


def exposed_comm_bar(window_metrics: pl.DataFrame, rank: int | None = None) -> go.Figure:
    """Per step window: communication time split into overlapped and exposed (ms), one rank."""
    if window_metrics.height == 0:
        return go.Figure().update_layout(title="Exposed communication: no data")
    rank = window_metrics["rank"].min() if rank is None else rank
    w = window_metrics.filter(pl.col("rank") == rank).sort("window")
    x = [f"{i}: {n}" for i, n in zip(w["window"].to_list(), w["name"].to_list())]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=w["exposed_comm_ms"].to_list(), name="exposed comm", marker_color="#E45756"))
    fig.add_trace(go.Bar(x=x, y=(w["comm_ms"] - w["exposed_comm_ms"]).to_list(), name="overlapped comm",
                         marker_color="#F4A5A5"))
    fig.add_trace(go.Scatter(x=x, y=w["gpu_span_ms"].to_list(), name="step GPU span", mode="markers",
                             marker={"color": "#333", "symbol": "line-ew-open", "size": 12}))
    return fig.update_layout(barmode="stack", title=f"Communication per step window (rank {rank})", yaxis_title="ms",
                             template="plotly_white",
                             xaxis={"tickangle": -60}, height=420,
                             legend={"orientation": "h", "y": 1.1})


def gaps_bar(gap_summary: pl.DataFrame) -> go.Figure:
    """GPU idle time inside steps by window kind and gap category (ms, all ranks)."""
    if gap_summary.height == 0:
        return go.Figure().update_layout(title="GPU gaps: none")
    g = (gap_summary.group_by("position", "kind", "category").agg(pl.col("total_ms").sum(), pl.col("gaps").sum())
         .with_columns((pl.col("position") + " · " + pl.col("kind")).alias("where")).sort("where"))
    colors = {"host_bound": "#E45756", "other": "#4C78A8", "unknown": "#BAB0AC"}
    fig = go.Figure()
    for cat in ("host_bound", "other", "unknown"):
        sub = g.filter(pl.col("category") == cat)
        if sub.height:
            fig.add_trace(go.Bar(x=sub["where"].to_list(), y=sub["total_ms"].to_list(), name=cat,
                                 marker_color=colors[cat], customdata=sub["gaps"].to_list(),
                                 hovertemplate="%{x}<br>%{y:.2f} ms in %{customdata} gaps<extra></extra>"))
    return fig.update_layout(barmode="stack", title="GPU idle gaps by position and cause (all ranks)",
                             template="plotly_white",
                             yaxis_title="idle ms", height=380)


STAGE_COLORS = ("#4C78A8", "#E45756", "#54A24B", "#F58518", "#B279A2", "#72B7B2", "#9D755D", "#EECA3B")


def stage_steps_figure(stage_steps: pl.DataFrame, stages: pl.DataFrame | None = None) -> go.Figure:
    """GPU compute ms per step for every pipeline stage (solid) and its SendRecv ms per step (dotted), over the
    steps of the capture; stretches where one stage holds the pipeline back are shaded and labelled."""
    fig = go.Figure()
    if stage_steps is None or stage_steps.height == 0:
        fig.update_layout(title="Pipeline stages: a single stage in this capture (no per-stage view)", height=200)
        return fig
    for (pipe, st), g in stage_steps.sort("step").group_by("pipeline", "stage", maintain_order=True):
        color = STAGE_COLORS[int(st) % len(STAGE_COLORS)]
        label = f"stage {st}" + (f" ({pipe})" if pipe != "all" else "")
        text = [f"{n} ({k})" for n, k in zip(g["name"].to_list(), g["kind"].to_list())]
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["gpu_ms"].to_list(), mode="lines+markers",
                                 name=f"{label} GPU compute", line={"color": color}, text=text,
                                 hovertemplate="step %{x}: %{y:.3f} ms<br>%{text}<extra>" + label + "</extra>"))
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["sendrecv_ms"].to_list(), mode="lines",
                                 name=f"{label} SendRecv (wait)", line={"color": color, "dash": "dot"},
                                 hovertemplate="step %{x}: %{y:.3f} ms SendRecv<extra>" + label + "</extra>"))
    if stages is not None and stages.height:
        hold = stages.filter(pl.col("role") == "holds back").unique(["pipeline", "stretch"]).sort("first_step")
        for r in hold.iter_rows(named=True):
            fig.add_vrect(x0=r["first_step"] - 0.5, x1=r["last_step"] + 0.5, fillcolor="rgba(228,87,86,0.10)",
                          line_width=0, annotation_text=f"stage {r['stage']} holds back "
                                                        f"(steps {r['first_step']}–{r['last_step']})",
                          annotation_position="top left")
    fig.update_layout(title="GPU compute per step and SendRecv wait, per pipeline stage", xaxis_title="step",
                      yaxis_title="ms per step (log)", yaxis_type="log", height=420,
                      legend={"orientation": "h", "y": -0.2})
    return fig


def scenario_compare_bar(compare: pl.DataFrame) -> go.Figure:
    """The captured scenarios side by side (``analyse.trace.scenarios.compare_table``): exposed communication and
    GPU idle (gap) as % of step time per scenario, the median step time (ms) in each bar's label."""
    fig = go.Figure()
    if compare.height == 0 or "median_step_ms" not in compare.columns:
        return fig.update_layout(title="no captured scenario analysed")
    c = compare.filter(pl.col("median_step_ms").is_not_null())
    names = [f"{s}<br>median step {m:.2f} ms" for s, m in zip(c["scenario"], c["median_step_ms"])]
    for col, label, color in (("exposed_comm_pct", "exposed communication % of step time", "#E45756"),
                              ("gap_pct", "GPU idle (gaps) % of step time", "#BAB0AC")):
        fig.add_bar(x=names, y=c[col].fill_null(0).to_list(), name=label, marker_color=color)
    fig.update_layout(barmode="group", title="Captured scenarios side by side", yaxis_title="% of step time",
                      height=380)
    return fig
