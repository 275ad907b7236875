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
from plotly.subplots import make_subplots

from servelab.measure import request_metrics as mx

INVALID_MARKER = dict(symbol="x-open", size=11, color="#c0392b")


def _hover(df: pd.DataFrame, cols: list[str]) -> list[str]:
    out = []
    for _, r in df.iterrows():
        parts = [f"{html.escape(str(c))}: {html.escape(str(r.get(c)))}" for c in cols if c in r]
        out.append("<br>".join(parts))
    return out


def latency_throughput(frame: pd.DataFrame, latency: str = "p95_tpot_ms", definition: str = mx.VLLM_BENCH) -> go.Figure:
    """Output TPS (x) vs a latency percentile (y) per scenario, points labelled by concurrency."""
    fig = go.Figure()
    if frame.empty or "scenario" not in frame:         # e.g. the engine crashed before the first case
        fig.update_layout(title="Latency vs throughput (no case measured)", template="plotly_white")
        return fig
    df = frame[frame["definition"] == definition] if "definition" in frame else frame
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


def slo_frontier(frontier: pd.DataFrame, slo: dict[str, Any] | None = None, definition: str = mx.VLLM_BENCH) -> go.Figure:
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


def percentile_bars(frame: pd.DataFrame, metric: str = "ttft", definition: str = mx.VLLM_BENCH) -> go.Figure:
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
    fig.update_layout(barmode="group", title=f"{metric.upper()} percentiles per case ({_named(definition)} definition, "
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
    fig.update_layout(title=f"M1 ITL timeline ({_named(m1.get('definition', mx.VLLM_BENCH))} definition: one point per "
                            "chunk gap)",
                      xaxis_title="time since the measurement window started (s)", yaxis_title="ITL (ms)",
                      template="plotly_white")
    return fig


def _named(definition: str) -> str:
    """``vllm`` → ``vllm (vllm bench serve)``: a definition is a benchmark's rules, not the engine."""
    return f"{definition} ({mx.Definition(definition).tool})" if definition in mx.DEFINITIONS else str(definition)


def definitions_compared(summaries: dict[str, dict[str, Any]], case_id: str = "") -> go.Figure:
    """The same case under both definitions: mean/P50/P99 of TTFT, TPOT, ITL, E2E side by side."""
    keys = [f"{st}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for st in ("mean", "p50", "p99")]
    fig = go.Figure()
    for d, s in summaries.items():
        fig.add_trace(go.Bar(x=keys, y=[s.get(k) for k in keys], name=_named(d)))
    fig.update_layout(barmode="group", title=f"{case_id}: the same requests under both metric definitions", yaxis_title="ms",
                      template="plotly_white")
    return fig


RUN_COLORS = {"control": "#2980b9", "treatment": "#c0392b"}
REQUEST_SERIES = ("running", "waiting", "running (log)", "queued (log)", "slots in use (log)", "retracted",
                  "retracted (log)")


def serverside_timeline(m1: dict[str, Any], sides: dict[str, Any], title: str = "") -> go.Figure:
    """M1's client ITL timeline over the engine's own view of the same windows (one shared time axis):
    row 1 the client's ITL per chunk gap; row 2 running/queued requests (``/metrics`` gauges as steps with a marker
    per scrape, scheduler log values as points); row 3 KV-cache usage or the engine's other gauges; row 4 one
    marker per scheduler log line (hover: the line). ``sides``: run (control | treatment) → its ``ServerSide``."""
    band = (m1["inject_start_s"], max(m1["inject_end_s"], m1["inject_start_s"] + 1e-3))
    return client_over_server(m1["timeline"], sides, [band], title or "M1: client ITL over the engine's own series "
                              "and scheduler lines (yellow: the injected prefill)")


def client_over_server(timeline: pd.DataFrame, sides: dict[str, Any], bands: list[tuple[float, float]],
                       title: str, y_title: str = "client: ITL per chunk gap (ms)",
                       x_title: str = "time since the measurement window started (s)", client_name: str = "ITL"
                       ) -> go.Figure:
    """A client latency timeline (``t_s``, ``itl_ms``, ``run``) over each run's ``ServerSide`` (same ``t_s`` origin),
    the shaded ``bands`` (injected prefills) on every row. Rows as in :func:`serverside_timeline`."""
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.04, row_heights=[0.4, 0.22, 0.18, 0.2],
                        subplot_titles=(y_title, "engine: requests running / queued",
                                        "engine: KV usage, prefill tokens per batch, other gauges",
                                        "engine: scheduler log lines"))
    palette = ["#2980b9", "#c0392b", "#27ae60", "#8e44ad"]
    colors = {run: RUN_COLORS.get(run, palette[i % len(palette)]) for i, run in enumerate(sides)}
    for run in timeline["run"].unique():
        g = timeline[timeline["run"] == run]
        fig.add_trace(go.Scattergl(x=g["t_s"], y=g["itl_ms"], mode="markers", name=f"{run}: {client_name}",
                                   legendgroup=str(run), marker=dict(size=4, color=colors.get(run, "#2980b9"),
                                                                     opacity=0.6)), row=1, col=1)
    dashes = ["solid", "dot", "dash", "dashdot", "longdash"]
    for run, side in sides.items():
        color = colors[run]
        s = side.series
        for i, (metric, g) in enumerate(s.groupby("metric", sort=True) if not s.empty else []):
            g = g.sort_values("t_s")
            row = 2 if metric in REQUEST_SERIES else 3
            fig.add_trace(go.Scatter(x=g["t_s"], y=g["value"], name=f"{run}: {metric}", legendgroup=run,
                                     mode="markers" if (g["source"] == "log").all() else
                                     "lines+markers" if (g["source"] == "metrics").all() else "lines",
                                     line=dict(shape="hv", color=color, dash=dashes[i % len(dashes)]),
                                     marker=dict(color=color, symbol="diamond", size=6)), row=row, col=1)
        ln = side.lines
        if ln is not None and not ln.empty and "t_s" in ln:
            placed = ln.dropna(subset=["t_s"])
            fig.add_trace(go.Scatter(x=placed["t_s"], y=[f"{run}: {e}" for e in placed["event"]], mode="markers",
                                     name=f"{run}: log lines", legendgroup=run, showlegend=False,
                                     marker=dict(symbol="line-ns-open", size=12, color=color),
                                     hovertext=[html.escape(str(x))[:300] for x in placed["line"]], hoverinfo="text"),
                          row=4, col=1)
    for x0, x1 in bands:
        for row in (1, 2, 3, 4):
            fig.add_vrect(x0=x0, x1=max(x1, x0 + 1e-3), fillcolor="#f1c40f", opacity=0.25, line_width=0, row=row,
                          col=1)
    clock = next((s.clock for s in sides.values() if s is not None), "")
    fig.update_layout(title=title, template="plotly_white", height=900, legend=dict(groupclick="toggleitem"))
    fig.update_xaxes(title_text=x_title, row=4, col=1)
    if clock:
        fig.add_annotation(text=html.escape(clock.split(";")[0])[:200], xref="paper", yref="paper", x=0, y=-0.08,
                           showarrow=False, font=dict(size=10, color="#555"), xanchor="left")
    return fig


# ---------------------------------------------------------------- Phase 1's page (a part that did not run says so)

def search_frontier_figure(search: Any, definition: str = mx.VLLM_BENCH) -> go.Figure:
    """The concurrency search's SLO frontier (:func:`slo_frontier`); an empty one when the search did not run."""
    if search is None:
        return slo_frontier(pd.DataFrame(), None, definition)
    return slo_frontier(search.frontier(), search.slo, definition)


def m1_itl_figure(m1: dict[str, Any] | None) -> go.Figure:
    """M1's ITL timeline (:func:`itl_timeline`), or a titled empty figure when M1 did not run."""
    if m1 is None:
        return go.Figure().update_layout(title="M1 did not run: no ITL timeline")
    return itl_timeline(m1)


def m1_serverside_figure(m1: dict[str, Any] | None, sides: dict[str, Any]) -> go.Figure:
    """The M1 ITL timeline over the engine's running / queued / KV series and its scheduler lines
    (:func:`serverside_timeline`), or a titled empty figure when M1 did not run."""
    if m1 is None:
        return go.Figure().update_layout(title="M1 did not run: no server-side timeline")
    return serverside_timeline(m1, sides)
