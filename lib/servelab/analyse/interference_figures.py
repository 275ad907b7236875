"""Phase 7's figures: background token gaps around each long prefill, the windows, the sweep's trade-off (the
computation is :mod:`servelab.analyse.interference`)."""
from __future__ import annotations

import html
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from servelab.analyse.interference import WINDOWS, InterferenceResult

def timeline_figure(res: InterferenceResult, title: str = ""):
    """Every background token gap over time; injections shaded (send → last chunk); the queue gauge below."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28], vertical_spacing=0.06,
                        subplot_titles=("background token gaps (ms)", "engine queue (running / waiting)"))
    tl = res.timeline
    fig.add_trace(go.Scattergl(x=tl["t_s"], y=tl["gap_ms"], mode="markers", name="token gap",
                               marker=dict(size=4, color="#2980b9", opacity=0.6)), row=1, col=1)
    w = res.windows
    for _, r in w.iterrows():
        color = {"before": "#2ecc71", "during": "#f1c40f", "after": "#95a5a6"}[r["window"]]
        fig.add_vrect(x0=r["start_s"], x1=max(r["end_s"], r["start_s"] + 1e-4), fillcolor=color,
                      opacity=0.35 if r["window"] == "during" else 0.15, line_width=0, row=1, col=1)
    for k, g in w[w["window"] == "during"].groupby("injection"):
        fig.add_annotation(x=float(g["start_s"].iloc[0]), y=1, yref="y domain", text=f"inject {k}", showarrow=False,
                           xanchor="left", row=1, col=1)
    for metric, g in res.queue.groupby("metric"):
        fig.add_trace(go.Scatter(x=g["t_s"], y=g["value"], mode="lines", name=str(metric), line_shape="hv"),
                      row=2, col=1)
    fig.update_xaxes(title_text="time since the background started (s)", row=2, col=1)
    fig.update_layout(title=title or f"{res.spec.case_id}: background token gaps around each long prefill "
                      "(green before, yellow during, grey after)", template="plotly_white", height=560)
    return fig


def windows_figure(res: Any):
    """P95 token gap per window (before / during / after) for every value of the knob, averaged over injections
    (``res``: a Phase 7 result — its ``sweep`` points and ``knob``)."""
    fig = go.Figure()
    for p in res.sweep:
        if p.result is None:
            continue
        w = p.result.windows[p.result.windows["valid"]]
        m = w.groupby("window")["p95_tpot_ms"].mean().reindex(list(WINDOWS))
        fig.add_trace(go.Bar(x=list(WINDOWS), y=m.to_numpy(), name=p.label))
    fig.update_layout(barmode="group", title=f"P95 background token gap per window, by {res.knob} "
                      "(mean over valid injections)", yaxis_title="P95 token gap (ms)", template="plotly_white")
    return fig


def tradeoff_figure(table: pd.DataFrame):
    """The trade each value makes: P95 TPOT increase during injection (x) vs long-request TTFT (y)."""
    fig = go.Figure()
    ok = table[table["valid"].fillna(False).astype(bool)] if not table.empty else table
    if ok.empty:
        return fig.update_layout(title="no valid value")
    ok = ok[ok["rank"].notna()]
    fig.add_trace(go.Scatter(x=ok["p95_tpot_increase_ms"], y=ok["long_request_ttft_ms"], mode="markers+text",
                             text=[f"#{int(r)} {html.escape(str(v))}" for r, v in zip(ok["rank"], ok["value"])],
                             textposition="top center",
                             marker=dict(size=12, color="#8e44ad"),
                             error_x=dict(type="data", symmetric=False,
                                          array=(ok["increase_max_ms"] - ok["p95_tpot_increase_ms"]).to_numpy(),
                                          arrayminus=(ok["p95_tpot_increase_ms"] - ok["increase_min_ms"]).to_numpy())))
    fig.update_layout(title="Decode damage vs long-request TTFT per value (rank 1 = least damage to the decode SLO; "
                      "bars: min–max over injections)",
                      xaxis_title="P95 TPOT increase during injection (ms, during − before)",
                      yaxis_title="long-request TTFT (ms)", template="plotly_white")
    return fig
