"""Phase 8's figures: the hit-rate points against their targets, TTFT and throughput per accepted point, KV usage over time
(the computation is :mod:`servelab.analyse.prefix_cache`)."""
from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

def hit_rate_figure(matrix: pd.DataFrame):
    """Achieved vs target hit rate, both sources, the tolerance band; REJECTED points as red ✕."""
    fig = go.Figure()
    if matrix.empty:
        return fig.update_layout(title="no hit-rate points")
    xs = np.linspace(0, 0.9, 10)
    tol = float(matrix["tolerance_pp"].max()) / 100
    fig.add_trace(go.Scatter(x=np.concatenate([xs, xs[::-1]]) * 100,
                             y=np.concatenate([xs + tol, (xs - tol)[::-1]]) * 100, fill="toself",
                             fillcolor="rgba(39,174,96,0.15)", line=dict(width=0),
                             name=f"accept band ±{tol * 100:.2f} pp",
                             hoverinfo="skip"))
    for src, sym in (("counter_hit_rate", "circle"), ("usage_hit_rate", "diamond")):
        for verdict, color in (("ACCEPTED", "#27ae60"), ("REJECTED", "#c0392b")):
            g = matrix[(matrix["verdict"] == verdict) & matrix[src].notna()]
            if g.empty:
                continue
            fig.add_trace(go.Scatter(
                x=g["target_rate"] * 100, y=g[src].astype(float) * 100, mode="markers",
                name=f"{'server counters' if src.startswith('counter') else 'per-request usage'} — {verdict}",
                marker=dict(symbol=sym if verdict == "ACCEPTED" else "x-open", size=12, color=color),
                hovertext=[f"{html.escape(str(c))}: {html.escape(str(v))}<br>{html.escape(str(r))}"  # plotly reads tags
                           for c, v, r in zip(g["case_id"], g["verdict"], g["reasons"])],
                hoverinfo="text"))
    fig.update_layout(title="Prefix-cache hit rate: achieved vs target (REJECTED points are never results)",
                      xaxis_title="target hit rate (%)", yaxis_title="achieved hit rate (%)", template="plotly_white")
    return fig


def ttft_figure(matrix: pd.DataFrame):
    """P50/P95 TTFT and input TPS per hit rate, accepted points only (rejected ones named in the title)."""
    ok = matrix[matrix["verdict"] == "ACCEPTED"].sort_values("target_rate")
    bad = matrix[matrix["verdict"] != "ACCEPTED"]["case_id"].tolist()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "input throughput (tok/s)"))
    x = [f"{round(r * 100)}%" for r in ok["target_rate"]]
    fig.add_trace(go.Bar(x=x, y=ok["p50_ttft_ms"], name="P50 TTFT"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=ok["p95_ttft_ms"], name="P95 TTFT"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=ok["input_throughput"], name="input TPS"), row=1, col=2)
    title = "TTFT and throughput per achieved hit rate (accepted points)"
    if bad:
        title += f" — not shown (REJECTED): {', '.join(bad)}"
    fig.update_layout(title=title, barmode="group", template="plotly_white")
    return fig


def kv_figure(kv: pd.DataFrame):
    """KV usage over time (fraction of capacity), one line per metric; points laid end to end."""
    fig = go.Figure()
    if kv.empty:
        return fig.update_layout(title="KV usage: not exposed by this engine")
    for metric, g in kv.groupby("metric", sort=False):
        fig.add_trace(go.Scatter(x=g["t_s"], y=g["value"] * 100, mode="lines+markers", name=metric,
                                 marker=dict(size=3), hovertext=[html.escape(str(p)) for p in g["point"]],
                                 hoverinfo="text+y"))
    for point, g in kv.groupby("point", sort=False):
        fig.add_vline(x=float(g["t_s"].min()), line_dash="dot", line_color="#95a5a6",
                      annotation_text=str(point), annotation_position="top left")
    fig.update_layout(title=f"KV usage over time — {kv['source'].iloc[0]}", xaxis_title="time (s, points end to end)",
                      yaxis_title="% of KV capacity", template="plotly_white")
    return fig
