"""Phase 3's "Every captured scenario" section: the scenarios side by side, then one block per scenario with its
case, step windows, top kernels per window kind, exposed and overlapped communication, gaps, CUDA-graph coverage
and its ten answers. The compute is ``analyse.trace.scenarios``'s; this module only lays the tables out (every
cell escaped by ``report.tables.table_html``)."""
from __future__ import annotations

import html
from typing import Any

import pandas as pd
import polars as pl
from IPython.display import HTML

from servelab.analyse.trace.scenarios import compare_findings, compare_table
from servelab.analyse.trace.stalls import stall_summary
from servelab.report.banner import banner
from servelab.report.tables import table_html


def _pd(df: pl.DataFrame | None, cols: list[str] | None = None) -> pd.DataFrame:
    if df is None or df.height == 0:
        return pd.DataFrame({"note": ["none in this capture"]})
    if cols is not None:
        df = df.select([c for c in cols if c in df.columns])
    out = df.to_pandas()
    num = out.select_dtypes("float").columns
    out[num] = out[num].round(3)
    return out


def scenarios_table(p: Any) -> pd.DataFrame:
    """The captured scenarios side by side (``scenarios/trace_scenario_compare.csv``); a note without a live
    capture."""
    if not p.scenarios:
        return pd.DataFrame({"note": ["no live capture in this run (trace_dir given, capture off, or an engine "
                                      "without a profiler): the page analyses one capture"]})
    t = _pd(compare_table(p.scenarios))
    t.attrs["caption"] = " ".join(compare_findings(p.scenarios))
    return t


def _block(v: Any) -> str:
    a = v.analysis
    head = (f'<h3 id="scenario-{html.escape(v.scenario)}">{html.escape(v.scenario)} — case '
            f'{html.escape(v.case_id)}</h3><p>Bound to benchmark case <code>{html.escape(v.bound_case_id or "-")}'
            f'</code>; traces in <code>{html.escape(str(v.folder))}</code>; tables in '
            f'<code>scenarios/{html.escape(v.scenario)}/</code>.</p>')
    if a is None:
        return head + f"<p><b>Not analysed</b>: {html.escape(v.error)}</p>"
    parts = [head]
    if v.clock is not None and v.clock.clock.get("joined", True):
        st = stall_summary(v.clock)
        p99 = "-" if st["p99_itl_ms"] is None else f"{st['p99_itl_ms']:.2f} ms"
        parts.append(f"<p>One clock: {v.clock.steps.height} engine steps and {v.clock.gaps.height} client inter-chunk "
                     f"gaps joined; {st['stalls']} stalls above the steady-state P99 ITL ({html.escape(p99)}), "
                     f"{st['prefill_stalls']} of them overlapping a prefill step (<code>scenarios/"
                     f"{html.escape(v.scenario)}/trace_stalls.csv</code>).</p>")
    steps = _pd(a.summary, ["rank", "kind", "windows", "median_step_ms", "gpu_span_ms", "busy_pct", "comm_pct",
                            "exposed_comm_pct", "overlap_pct", "idle_ms", "host_bound_idle_pct", "gaps",
                            "graph_op_pct"])
    top = (a.top_kernels.sort("kind", "total_ms", descending=[False, True]).group_by("kind", maintain_order=True)
           .head(5) if a.top_kernels.height else a.top_kernels)
    for title, t in (("Step windows by kind, exposed and overlapped communication, gaps", steps),
                     ("Top kernels per window kind (5 each)", _pd(top, ["kind", "kernel", "cls", "count", "total_ms",
                                                                         "share_pct", "ranks"])),
                     ("GPU idle gaps", _pd(a.gap_summary)),
                     ("CUDA-graph coverage", _pd(a.graph)),
                     ("The ten questions, from this capture", _pd(v.questions, ["id", "question_en", "answerable",
                                                                                 "answer", "evidence"]))):
        parts.append(f"<h4>{html.escape(title)}</h4>" + table_html(t))
    return "".join(parts)


def capture_point_note(at: Any, run_id: str) -> Any:
    """Where the live capture of run ``run_id`` was taken: the Phase 1 case ``capture_at`` named (``at``, a
    ``CapturePoint``), linked to that run's Phase 1 page (None without ``capture_at``)."""
    if at is None:
        return None
    href = ("../phase1/report.html" if at.run_id == run_id else f"../../{at.run_id}/phase1/report.html")
    return HTML('<div class="servelab-banner servelab-banner-info" style="background:#e8f1fb;border-left:6px solid '
                '#2e6da4;padding:10px 14px;margin:8px 0;font-family:sans-serif"><b style="color:#2e6da4">Captured at '
                f'a Phase 1 point</b><br>{html.escape(at.describe())} — the decode control and the mixed treatment '
                f'ran its lengths and concurrency; see <a href="{html.escape(href)}">the Phase 1 page of run '
                f'{html.escape(at.run_id)}</a> (case <code>{html.escape(at.case_id)}</code> in its matrix / '
                'search tables).</div>')


def scenario_sections(p: Any) -> Any:
    """One block per captured scenario (HTML), in the order long prefill, decode control, prefix hit, mixed."""
    if not p.scenarios:
        return banner("No live capture in this run: there is one capture, analysed in the sections below.", "info",
                      "One capture")
    return HTML("".join(_block(v) for v in p.scenarios))


def subset_findings(subset: pl.DataFrame) -> list[str]:
    """The findings' line on a rank subset (``max_capture_gb``): how many rank files were analysed, and each one
    left out with why; nothing without a budget."""
    if subset is None or subset.height == 0 or subset["kept"].all():
        return []
    out = subset.filter(~pl.col("kept"))
    return [f"Rank subset: {subset.height - out.height} of {subset.height} rank files analysed "
            f"({subset['size_mb'].sum() / 1e3:.3f} GB in all); LEFT OUT: {', '.join(out['file'])} — "
            f"{out['why'][0]} (see The ranks of the capture)."]


def subset_table(p: Any) -> pd.DataFrame:
    """Every rank file with kept / left out and why (``trace_rank_subset.csv``), when ``max_capture_gb`` is set."""
    s = p.analysis.rank_subset
    if s.height == 0:
        return pd.DataFrame({"note": ["max_capture_gb not set: every rank file analysed"]})
    t = _pd(s)
    t.attrs["caption"] = (f"{int(s['kept'].sum())} of {s.height} rank files analysed, {s.height - int(s['kept'].sum())} "
                          "left out (representative ranks and every rank with cross-node traffic are kept)")
    return t
