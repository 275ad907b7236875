"""Phase 1 figures (plotly): latency–throughput curves, SLO frontier, percentile bars, M1 ITL timeline.

Each function takes frames (``MatrixResult.frame``, ``SearchResult.frontier``, ``m1_analysis``) and returns a
``go.Figure``. Invalid points are drawn as open red ✕ markers with their reasons in the hover text — never
as results. Every figure names the metric definition it shows.
"""
from __future__ import annotations

import html
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from servelab.measure import request_metrics as mx

INVALID_MARKER = dict(symbol="x-open", size=11, color="#c0392b")


def _hover(df: pd.DataFrame, cols: list[str]) -> list[str]:
    out = []
    for _, r in df.iterrows():
        parts = [f"{html.escape(str(c))}: {html.escape(str(r.get(c)))}" for c in cols if c in r]
        out.append("<br>".join(parts))
    return out


def latency_throughput(frame: pd.DataFrame, latency: str = "p95_tpot_ms", definition: str = "vllm") -> go.Figure:
    """Output TPS (x) vs a latency percentile (y) per scenario, points labelled by concurrency."""
    df = frame[frame["definition"] == definition] if "definition" in frame else frame
    fig = go.Figure()
    for scen, g in df.groupby("scenario", sort=False):
        g = g.sort_values("concurrency")
        ok = g[g["validity"] == "VALID"]
        bad = g[g["validity"] != "VALID"]
        fig.add_trace(go.Scatter(x=g["output_throughput"], y=g[latency], mode="lines", name=f"{scen}",
                                 line=dict(width=1), showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=ok["output_throughput"], y=ok[latency], mode="markers+text", name=f"{scen}",
                                 text=[f"C={c}" for c in ok["concurrency"]], textposition="top center",
                                 hovertext=_hover(ok, ["case_id", "concurrency", "output_throughput", latency]),
                                 hoverinfo="text"))
        if not bad.empty:
            fig.add_trace(go.Scatter(x=bad["output_throughput"], y=bad[latency], mode="markers",
                                     name=f"{scen} (INVALID)", marker=INVALID_MARKER,
                                     hovertext=_hover(bad, ["case_id", "concurrency", "validity_reasons"]),
                                     hoverinfo="text"))
    fig.update_layout(title=f"Latency vs throughput ({latency}, {definition} definition)",
                      xaxis_title="output throughput (tok/s)", yaxis_title=latency, template="plotly_white")
    return fig


def slo_frontier(frontier: pd.DataFrame, slo: dict[str, Any] | None = None, definition: str = "vllm") -> go.Figure:
    """Throughput vs per-user tok/s (1000/median TPOT) over the search points; SLO-meeting points filled."""
    fig = go.Figure()
    if frontier.empty:
        fig.update_layout(title="SLO frontier (no search points)")
        return fig
    df = frontier.sort_values("concurrency")
    fig.add_trace(go.Scatter(x=df["tok_per_s_per_user"], y=df["output_tps"], mode="lines", showlegend=False,
                             line=dict(color="#95a5a6"), hoverinfo="skip"))
    for label, sel, marker in (
            ("meets SLO", (df["meets_slo"] == True) & (df["validity"] == "VALID"), dict(size=10, color="#27ae60")),  # noqa: E712
            ("misses SLO / no SLO", (df["meets_slo"] != True) & (df["validity"] == "VALID"),  # noqa: E712
             dict(size=10, color="#e67e22")),
            ("INVALID", df["validity"] != "VALID", INVALID_MARKER)):
        g = df[sel]
        if g.empty:
            continue
        fig.add_trace(go.Scatter(x=g["tok_per_s_per_user"], y=g["output_tps"], mode="markers+text", name=label,
                                 marker=marker, text=[f"C={c}" for c in g["concurrency"]],
                                 textposition="top center",
                                 hovertext=_hover(g, ["concurrency", "p95_ttft_ms", "p95_tpot_ms", "status"]),
                                 hoverinfo="text"))
    s = ", ".join(f"{k}={v}" for k, v in (slo or {}).items() if v is not None) or "none"
    fig.update_layout(title=f"SLO frontier: throughput vs per-user speed (SLO {s}; {definition} definition)",
                      xaxis_title="per-user tok/s (1000 / median TPOT)", yaxis_title="output throughput (tok/s)",
                      template="plotly_white")
    return fig


def percentile_bars(frame: pd.DataFrame, metric: str = "ttft", definition: str = "vllm") -> go.Figure:
    """P50 / P95 / P99 of one metric for every case (grouped bars); INVALID cases hatched and named so."""
    df = frame[frame["definition"] == definition] if "definition" in frame else frame
    fig = go.Figure()
    labels = [f"{c}{' (INVALID)' if v != 'VALID' else ''}" for c, v in zip(df["case_id"], df["validity"])]
    pattern = ["x" if v != "VALID" else "" for v in df["validity"]]
    rows = df.to_dict("records")
    for p in (50, 95, 99):
        # each bar is what its label says: the percentile with its count, or the max where too few values hold it
        shown = [mx.shown_percentile(r, metric, p) for r in rows]
        fig.add_trace(go.Bar(x=labels, y=[v for _, v in shown], name=f"P{p}", marker_pattern_shape=pattern,
                             text=[lab for lab, _ in shown], hovertemplate="%{x}: %{y:.3g} ms (%{text})"))
    fig.update_layout(barmode="group", title=f"{metric.upper()} percentiles per case ({definition} definition, "
                      "numpy linear interpolation; a bar labelled 'max of N' had too few values for that percentile)",
                      yaxis_title=f"{metric} (ms)", template="plotly_white")
    return fig


def itl_timeline(m1: dict[str, Any]) -> go.Figure:
    """M1: every background ITL vs time since the window start, control and treatment; injection shaded."""
    tl = m1["timeline"]
    fig = go.Figure()
    for run, color in (("control", "#2980b9"), ("treatment", "#c0392b")):
        g = tl[tl["run"] == run]
        fig.add_trace(go.Scattergl(x=g["t_s"], y=g["itl_ms"], mode="markers", name=run,
                                   marker=dict(size=4, color=color, opacity=0.6)))
    fig.add_vrect(x0=m1["inject_start_s"], x1=max(m1["inject_end_s"], m1["inject_start_s"] + 1e-3),
                  fillcolor="#f1c40f", opacity=0.3, line_width=0, annotation_text="long prefill injected",
                  annotation_position="top left")
    fig.update_layout(title=f"M1 ITL timeline ({m1.get('definition', 'vllm')} definition: one point per chunk gap)",
                      xaxis_title="time since the measurement window started (s)", yaxis_title="ITL (ms)",
                      template="plotly_white")
    return fig


def definitions_compared(summaries: dict[str, dict[str, Any]], case_id: str = "") -> go.Figure:
    """The same case under both definitions: mean/P50/P99 of TTFT, TPOT, ITL, E2E side by side."""
    keys = [f"{st}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for st in ("mean", "p50", "p99")]
    fig = go.Figure()
    for d, s in summaries.items():
        fig.add_trace(go.Bar(x=keys, y=[s.get(k) for k in keys], name=d))
    fig.update_layout(barmode="group", title=f"{case_id}: sglang vs vllm metric definitions", yaxis_title="ms",
                      template="plotly_white")
    return fig
