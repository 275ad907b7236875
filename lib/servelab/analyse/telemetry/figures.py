"""Phase 2 figures: time series per node and metric, with each case's measurement window shaded."""
from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from servelab.analyse.telemetry.load import CaseTelemetry
from servelab.analyse.telemetry.windows import CaseWindow

PALETTE = ["rgba(46,109,164,0.12)", "rgba(181,137,0,0.14)", "rgba(192,57,43,0.12)", "rgba(39,174,96,0.12)"]


def timeseries_figure(samples: pd.DataFrame, windows: list[CaseWindow], metrics: list[str],
                      max_devices: int = 8, title: str = "Telemetry per node (case windows shaded)") -> go.Figure:
    """One row per metric; one trace per node/device (at most ``max_devices`` per node, busiest first);
    x is UTC wall time (naive: plotly.js does not read zone offsets); every case window is a shaded band labelled
    with its case id. Metrics with no
    sample get an empty row that says so, never a line at 0."""
    metrics = list(metrics)
    present = set(samples["metric"]) if not samples.empty else set()
    titles = [html.escape(m if m in present else f"{m} — no samples (collector absent or not configured)")
              for m in metrics]
    fig = make_subplots(rows=len(metrics), cols=1, shared_xaxes=True, vertical_spacing=0.05, subplot_titles=titles)
    for i, metric in enumerate(metrics, start=1):
        part = samples[samples.metric == metric]
        if part.empty:
            continue
        for node, g in part.groupby("node"):
            order = g.groupby("device")["value"].mean().sort_values(ascending=False).index[:max_devices]
            for dev in order:
                d = g[g.device == dev].sort_values("ts_ns")
                name = html.escape(f"{node}/{dev}")
                fig.add_trace(go.Scatter(x=pd.to_datetime(d.ts_ns, unit="ns"), y=d.value, mode="lines",
                                         name=name, legendgroup=name, showlegend=True,
                                         hovertemplate="%{x}<br>%{y:.2f}<extra>" + name + " " + html.escape(metric)
                                                       + "</extra>"), row=i, col=1)
    for k, w in enumerate(windows):
        fig.add_vrect(x0=pd.Timestamp(w.start_ns, unit="ns"), x1=pd.Timestamp(w.end_ns, unit="ns"),
                      fillcolor=PALETTE[k % len(PALETTE)], line_width=0, layer="below",
                      annotation_text=html.escape(w.case_id), annotation_position="top left", row="all", col=1)
    fig.update_layout(title=html.escape(title), height=max(320, 210 * len(metrics)), hovermode="x unified")
    fig.update_xaxes(showticklabels=True)
    fig.update_xaxes(title_text="UTC", row=len(metrics), col=1)
    return fig


def sample_figure(cases: list[CaseTelemetry]) -> go.Figure:
    """The recorded 2 × H200 nvidia-smi capture Phase 2 shows beside this target's telemetry: GPU and memory
    utilisation, power, SM clock and memory used, each case's window shaded."""
    return timeseries_figure(cases[0].samples, [c.window for c in cases],
                             ["util_gpu_pct", "util_mem_pct", "power_w", "sm_clock_mhz", "mem_used_mib"],
                             title="Recorded 2 x H200 nvidia-smi capture (200 ms samples, workload windows shaded)")
