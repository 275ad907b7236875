"""Phase 9's figures: net gain per concurrency and per-position acceptance (the computation is
:mod:`servelab.analyse.speculative`)."""
from __future__ import annotations


import pandas as pd
import plotly.graph_objects as go

def gain_figure(gain: pd.DataFrame):
    """Net output-TPS gain per concurrency for each config, acceptance written on the bars."""
    fig = go.Figure()
    if gain.empty:
        return fig.update_layout(title="no speculative config measured against the baseline")
    for config, g in gain.groupby("config", sort=False):
        fig.add_trace(go.Bar(x=[f"C={c}" for c in g["concurrency"]], y=g["net_gain_pct"], name=str(config),
                             text=["not comparable (invalid)" if v == "invalid"
                                   else f"acc {a:.0%}, len {l:.2f}" if a is not None and not pd.isna(a) else "no drafts"
                                   for a, l, v in zip(g["acceptance_rate"], g["mean_accept_length"], g["verdict"])],
                             textposition="outside"))
    fig.add_hline(y=0, line_color="#7f8c8d")
    fig.update_layout(barmode="group", title="Net output-throughput gain vs speculation off, per concurrency "
                      "(acceptance alone says nothing about it)", yaxis_title="Δ output TPS (%)",
                      template="plotly_white")
    return fig


def per_position_figure(per_pos: pd.DataFrame):
    """Acceptance per draft position (Δaccepted_pos / Δdrafts) per config and concurrency."""
    fig = go.Figure()
    if per_pos.empty:
        return fig.update_layout(title="per-position acceptance: not exposed or no drafts")
    m = per_pos.groupby(["config", "concurrency", "position"], sort=False)["acceptance"].mean().reset_index()
    for (config, c), g in m.groupby(["config", "concurrency"], sort=False):
        fig.add_trace(go.Scatter(x=g["position"], y=g["acceptance"], mode="lines+markers", name=f"{config} C={c}"))
    fig.update_layout(title="Per-position acceptance (counter deltas over the measurement window)",
                      xaxis_title="draft position", yaxis_title="accepted / verification steps",
                      yaxis_range=[0, 1.05], template="plotly_white")
    return fig
