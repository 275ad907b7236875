"""Figures of the kernel deep-dive: the kernels on the critical path per window, and the roofline."""
from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from servelab.analyse.kernels.roofline import GPU_PEAKS, _peak


def roofline_figure(roof: pd.DataFrame, gpu: str = "H200", kind: str = "spec") -> go.Figure:
    """Log-log roofline: the DRAM slope and one flat roof per precision present (``kind`` ceilings solid, the
    measured-here ceilings dashed), kernels as points coloured by precision (names on hover)."""
    bw = _peak(gpu, "dram_bytes_per_s", kind)
    fig = go.Figure()
    pts = roof.dropna(subset=["intensity_flop_per_byte", "achieved_tflops"])
    pts = pts[(pts["intensity_flop_per_byte"] > 0) & (pts["achieved_tflops"] > 0)]
    lo = max(min([0.1] + pts["intensity_flop_per_byte"].tolist()) / 2, 1e-3)
    hi = max([1e4] + (pts["intensity_flop_per_byte"] * 4).tolist())
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#9d755d")
    precs = sorted(set(pts["precision"])) or ["bf16_tensor"]
    for i, prec in enumerate(precs):
        color = palette[i % len(palette)]
        for k, dash in ((kind, "solid"),) + ((("measured", "dash"),) if kind != "measured" else ()):
            peak = next((p.value for p in GPU_PEAKS if p.gpu == gpu and p.quantity == prec and p.kind == k), math.nan)
            mbw = next((p.value for p in GPU_PEAKS if p.gpu == gpu and p.quantity == "dram_bytes_per_s" and p.kind == k), bw)
            if math.isnan(peak):
                continue
            fig.add_trace(go.Scatter(x=xs, y=np.minimum(peak, mbw * xs) / 1e12, mode="lines",
                                     line=dict(color=color, dash=dash), name=f"{k} roof {prec}: {peak / 1e12:.0f} "
                                     f"TFLOP/s, {mbw / 1e12:.1f} TB/s"))
        part = pts[pts["precision"] == prec]
        if len(part):
            fig.add_trace(go.Scatter(x=part["intensity_flop_per_byte"], y=part["achieved_tflops"], mode="markers",
                                     marker=dict(size=10, color=color, line=dict(width=1, color="black")),
                                     name=f"kernels ({prec})", text=[html.escape(str(f)) for f in part["function"]],  # void k<4>
                                     customdata=np.stack([part["pct_of_roof"], part["bound"]], axis=-1),
                                     hovertemplate="%{text}<br>AI %{x:.2f} flop/B<br>%{y:.2f} TFLOP/s<br>"
                                                   "%{customdata[0]:.0f}% of roof, %{customdata[1]}-bound<extra></extra>"))
    fig.update_xaxes(type="log", title="arithmetic intensity (flop per DRAM byte)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s")
    fig.update_layout(title=f"Roofline on {gpu} ({kind} ceilings solid, measured here dashed)", height=520)
    return fig


def top_kernels_figure(ranked: pd.DataFrame, n: int = 10) -> go.Figure:
    """One panel per window: its ``n`` largest kernels by critical-path ms, largest on top, coloured by their
    suspect. The ``unannotated`` window (kernels outside every step) is left out when step windows exist."""
    df = ranked
    if set(df["window"]) - {"unannotated"}:
        df = df[df["window"] != "unannotated"]
    windows = list(dict.fromkeys(df.sort_values("window")["window"]))
    fig = make_subplots(rows=max(len(windows), 1), cols=1, subplot_titles=[f"window: {w}" for w in windows] or [""],
                        vertical_spacing=0.16 if len(windows) > 1 else 0.1)
    palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d", "#ff9da6",
               "#bab0ac", "#8c564b", "#17becf")
    colors = {s: palette[i % len(palette)] for i, s in enumerate(sorted(set(df["suspect"])))}
    shown: set[str] = set()
    for i, w in enumerate(windows, start=1):
        part = df[df["window"] == w].nlargest(n, "critical_ms").iloc[::-1]
        labels = [f"#{r} {f[:70]}" for r, f in zip(part["rank"], part["function"])]
        for suspect, sub in part.groupby("suspect", sort=False):
            idx = [labels[j] for j, s in enumerate(part["suspect"]) if s == suspect]
            fig.add_trace(go.Bar(y=idx, x=sub["critical_ms"], orientation="h", name=suspect, legendgroup=suspect,
                                 marker_color=colors[suspect], showlegend=suspect not in shown,
                                 customdata=np.stack([sub["count"], sub["mean_dur_us"], sub["share_pct"]], axis=-1),
                                 hovertemplate="%{y}<br>%{x:.2f} ms, %{customdata[0]} launches, %{customdata[1]:.1f} µs "
                                               "mean, %{customdata[2]:.1f}% of window<extra></extra>"), row=i, col=1)
            shown.add(suspect)
        fig.update_yaxes(categoryorder="array", categoryarray=labels, row=i, col=1)
        fig.update_xaxes(title_text="ms in the captured window", row=i, col=1)
    fig.update_layout(height=max(360, (22 * n + 90) * max(len(windows), 1)), barmode="stack",
                      title="Kernels on the critical path, per window")
    return fig
