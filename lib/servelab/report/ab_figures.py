"""Figures of an A/B page (see :mod:`servelab.measure.abtest` for the cell pattern): Δ% with its noise band, and the
repeats themselves, so a reader sees the spread behind every mean."""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from servelab.report.banner import banner

VERDICT_COLORS = {"better": "#2e8b57", "worse": "#c0392b", "within noise": "#7f8c8d", "no repeats": "#b58900",
                  "invalid": "#000000", "no data": "#bdc3c7"}


def delta_figure(comparison: pd.DataFrame) -> go.Figure:
    """One panel per metric: Δ% of B's mean against A's for each case, the grey band ±k·CV around zero,
    bars coloured by verdict (a bar inside the band or with overlapping repeat ranges is *within noise*)."""
    metrics = list(dict.fromkeys(comparison["metric"])) if not comparison.empty else []
    fig = make_subplots(rows=max(len(metrics), 1), cols=1, shared_xaxes=False,
                        subplot_titles=[f"{m} (Δ % vs baseline; higher is {'better' if hib else 'worse'})"
                                        for m, hib in dict(zip(comparison.get("metric", []),
                                                               comparison.get("higher_is_better", []))).items()]
                        or ["no shared cases"])
    shown = set()
    for i, m in enumerate(metrics, start=1):
        g = comparison[comparison["metric"] == m]
        x = [f"{c} · {b}" if "b_run" in g and g["b_run"].nunique() > 1 else str(c)
             for c, b in zip(g["case_id"], g.get("b_run", g["case_id"]))]
        band = g["noise_band_pct"].fillna(0).to_numpy()
        fig.add_trace(go.Bar(x=x, y=band * 2, base=-band, marker_color="rgba(127,140,141,0.25)", name="noise band ±k·CV",
                             showlegend=i == 1, hoverinfo="skip"), row=i, col=1)
        for verdict, part in g.groupby("verdict"):
            px = [xx for xx, v in zip(x, g["verdict"]) if v == verdict]
            fig.add_trace(go.Bar(x=px, y=part["delta_pct"], name=verdict, width=0.4,
                                 marker_color=VERDICT_COLORS.get(verdict, "#34495e"), showlegend=verdict not in shown,
                                 customdata=np.stack([part["a_mean"], part["b_mean"], part["a_cv_pct"], part["b_cv_pct"]],
                                                     axis=-1),
                                 hovertemplate="%{x}<br>Δ %{y:+.2f} %<br>A %{customdata[0]:.4g} (CV %{customdata[2]:.1f} %)"
                                               "<br>B %{customdata[1]:.4g} (CV %{customdata[3]:.1f} %)<extra>" + verdict
                                               + "</extra>"), row=i, col=1)
            shown.add(verdict)
        fig.update_yaxes(title_text="Δ %", zeroline=True, row=i, col=1)
    fig.update_layout(barmode="overlay", height=260 * max(len(metrics), 1) + 80, title="A/B change per case")
    return fig


def repeats_figure(repeats: pd.DataFrame, metric: str = "output_tps") -> go.Figure:
    """Every repeat of every run as a point per case (min–max visible), so means are never read alone."""
    fig = go.Figure()
    if repeats.empty or metric not in repeats.columns:
        fig.update_layout(title=f"no repeats of {metric}")
        return fig
    for run, g in repeats.groupby("run", sort=False):
        fig.add_trace(go.Box(x=g["case_id"].astype(str), y=g[metric], name=str(run), boxpoints="all", jitter=0.3,
                             pointpos=0))
    fig.update_layout(boxmode="group", title=f"{metric}: every repeat per case and run", yaxis_title=metric, height=420)
    return fig


def ab_banner(ab: Any) -> Any:
    """The notice an A/B page opens with (red when confounded, green when only the variable changed), from
    :meth:`servelab.measure.abtest.ABResult.verdict_notice`; ``ab`` None (fewer than two runs ran): a notice that
    says so."""
    if ab is None:
        return banner("Fewer than two configs ran, so nothing is compared.", "info", "No A/B")
    kind, title, text = ab.verdict_notice()
    return banner(text, kind, title)


def ab_delta_figure(ab: Any) -> go.Figure:
    """An A/B's Δ% per case and metric (:func:`delta_figure` of ``ab.comparison``), or a titled empty figure when
    there was no A/B (``ab`` None) or nothing to compare."""
    if ab is None or ab.comparison.empty:
        return go.Figure().update_layout(title="no A/B comparison")
    return delta_figure(ab.comparison)
