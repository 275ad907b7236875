"""Phase 5 figures: busbw and time vs message size, with the model's message sizes on top."""
from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go


def _size_label(b: float) -> str:
    for unit, f in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if b >= f:
            return f"{b / f:g}{unit}"
    return f"{b:g}"


def busbw_figure(curves: pd.DataFrame, overlay: pd.DataFrame | None = None, placement: str = "out-of-place",
                 y: str = "busbw_gbps", title: str = "nccl-tests bus bandwidth vs message size") -> go.Figure:
    """One line per collective (and label) from ``perf_log.runs_frame``; ``overlay`` rows from
    ``msgsize.place_on_curves`` are drawn as markers on their collective's curve (sizes outside the
    measured range as vertical dotted lines at the bottom)."""
    fig = go.Figure()
    c = curves[curves.placement == placement] if not curves.empty else curves
    for (coll, label), g in c.groupby(["collective", "label"], sort=False) if not c.empty else []:
        g = g.sort_values("size_bytes")
        name = f"{coll}" + (f" · {label}" if c["label"].nunique() > 1 else "")
        fig.add_trace(go.Scatter(x=g.size_bytes, y=g[y], mode="lines+markers", name=html.escape(name),
                                 hovertemplate="%{x:,} B<br>%{y:.2f}<extra>" + html.escape(name) + "</extra>"))
    if overlay is not None and not overlay.empty:
        yv = "busbw_gbps" if y == "busbw_gbps" else "time_us"
        inside = overlay[overlay.in_measured_range]
        if not inside.empty:
            text = [html.escape(f"{r.scenario}: {r.collective} {_size_label(r.msg_bytes)}B ×{r.calls_per_step}/step")
                    for r in inside.itertuples()]
            fig.add_trace(go.Scatter(x=inside.msg_bytes, y=inside[yv], mode="markers", name="model messages",
                                     marker=dict(symbol="diamond", size=12, line=dict(width=1, color="black")),
                                     text=text, hovertemplate="%{text}<br>%{y:.2f}<extra></extra>"))
        for r in overlay[~overlay.in_measured_range].itertuples():
            fig.add_vline(x=r.msg_bytes, line_dash="dot", line_color="gray",
                          annotation_text=html.escape(f"{r.scenario} {r.collective} (not measured)"),
                          annotation_position="bottom right")
    sizes = sorted(set(c.size_bytes)) if not c.empty else []
    if sizes:
        lo, hi = int(np.floor(np.log2(sizes[0]))), int(np.ceil(np.log2(sizes[-1])))
        ticks = [2 ** k for k in range(lo, hi + 1, 2 if hi - lo > 12 else 1)]
        fig.update_xaxes(tickvals=ticks, ticktext=[_size_label(t) for t in ticks])
    fig.update_xaxes(type="log", title="message size (bytes, nccl-tests 'size')")
    fig.update_yaxes(title="bus bandwidth (GB/s)" if y == "busbw_gbps" else "time (µs)",
                     type="log" if y == "time_us" else "linear")
    fig.update_layout(title=html.escape(title), legend_title="collective", height=480)
    return fig


def sweep_figure(table: pd.DataFrame, msgs: pd.DataFrame | None = None,
                 title: str = "Δ time per call vs the baseline, per setting") -> go.Figure:
    """From ``sweep.sweep_table``: Δ time % against the baseline vs message size, one line per setting (and
    collective, scope, node when more than one); filled markers where the change is beyond noise, open where it is
    within it; the model's message sizes as dotted vertical lines."""
    fig = go.Figure()
    t = table[table.setting != "baseline"] if not table.empty else table
    keys = ["scope", "node", "collective"]
    many = not t.empty and t[keys].drop_duplicates().shape[0] > 1
    for (scope, node, coll, setting), g in t.groupby([*keys, "setting"], sort=False) if not t.empty else []:
        g = g.sort_values("size_bytes")
        name = setting + (f" · {coll} · {scope} {node}" if many else "")
        beyond = g.verdict.isin(["faster", "slower"])
        fig.add_trace(go.Scatter(
            x=g.size_bytes, y=g.delta_time_pct, mode="lines+markers", name=html.escape(name),
            marker=dict(symbol=["circle" if b else "circle-open" for b in beyond], size=9),
            text=[html.escape(str(v)) for v in g.verdict],
            hovertemplate="%{x:,} B<br>Δ %{y:+.1f} %<br>%{text}<extra>" + html.escape(name) + "</extra>"))
    fig.add_hline(y=0, line_color="black", line_width=1)
    if msgs is not None and not msgs.empty:
        for r in msgs.drop_duplicates(["collective", "msg_bytes"]).itertuples():
            fig.add_vline(x=r.msg_bytes, line_dash="dot", line_color="gray",
                          annotation_text=html.escape(f"{r.scenario} {r.collective}"), annotation_position="top left")
    sizes = sorted(set(t.size_bytes)) if not t.empty else []
    if sizes:
        lo, hi = int(np.floor(np.log2(sizes[0]))), int(np.ceil(np.log2(sizes[-1])))
        ticks = [2 ** k for k in range(lo, hi + 1, 2 if hi - lo > 12 else 1)]
        fig.update_xaxes(tickvals=ticks, ticktext=[_size_label(t) for t in ticks])
    fig.update_xaxes(type="log", title="message size (bytes, nccl-tests 'size')")
    fig.update_yaxes(title="Δ time per call vs baseline (%; below 0 = faster)")
    fig.update_layout(title=html.escape(title), legend_title="setting", height=460)
    return fig
