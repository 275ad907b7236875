"""Figures of the topology model: memory per GPU by layout against the budget, communication per step."""
from __future__ import annotations

from typing import Sequence

import pandas as pd
import plotly.graph_objects as go


def memory_figure(feas: pd.DataFrame) -> go.Figure:
    """Stacked bars per layout (worst stage): non-expert weights, expert weights, KV demand, against the budget."""
    fig = go.Figure()
    for col, name in (("weights_nonexpert_gib", "weights: non-expert"), ("weights_expert_gib", "weights: experts"),
                      ("kv_demand_gib", "KV cache demand")):
        fig.add_trace(go.Bar(x=feas["layout"], y=feas[col], name=name,
                             hovertemplate="%{x}<br>" + name + ": %{y:.1f} GiB<extra></extra>"))
    if not feas.empty:
        fig.add_trace(go.Scatter(x=feas["layout"], y=feas["budget_gib"], mode="lines+markers", name="budget "
                                 "(GPU memory × mem_fraction)", line=dict(dash="dash", color="black")))
    fig.update_layout(barmode="stack", title="Memory per GPU by layout (worst pipeline stage)",
                      yaxis_title="GiB per GPU", height=440)
    for _, r in feas.iterrows():
        if r["verdict"] != "fits":
            fig.add_annotation(x=r["layout"], y=r["need_gib"], text="does not fit" if "fit" in r["verdict"] else "invalid",
                               showarrow=False, yshift=12, font=dict(color="#c0392b"))
    return fig


def comm_figure(tables: Sequence[pd.DataFrame]) -> go.Figure:
    """Bytes per step by collective and layout: what one GPU sends, and what leaves a node (cross-node)."""
    df = pd.concat([t for t in tables if not t.empty], ignore_index=True) if tables else pd.DataFrame()
    fig = go.Figure()
    if df.empty:
        return fig
    palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d")
    for i, (coll, part) in enumerate(df.groupby("collective", sort=False)):
        color = palette[i % len(palette)]
        fig.add_trace(go.Bar(x=part["layout"], y=part["gpu_send_bytes_per_step"] / 2**20, name=coll,
                             offsetgroup="gpu", legendgroup=coll, marker_color=color,
                             hovertemplate="%{x}<br>" + coll + "<br>%{y:.2f} MiB sent per GPU<extra></extra>"))
        fig.add_trace(go.Bar(x=part["layout"], y=part["node_egress_bytes_per_step"] / 2**20, name=coll,
                             offsetgroup="node", legendgroup=coll, showlegend=False, marker_color=color,
                             marker_pattern_shape="/",
                             hovertemplate="%{x}<br>" + coll + "<br>%{y:.2f} MiB leaving a node<extra></extra>"))
    fig.update_layout(barmode="stack", title="Communication per step by layout: left bar = sent per GPU, "
                      "hatched = cross-node per node", yaxis_title="MiB per step", height=460)
    return fig
