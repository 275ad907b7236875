"""Exploration in JupyterLab: pick a run, a case, a rank or a time window with widgets; the same compute
and figure functions as the rendered pages draw the result.

    from servelab.explore import explorer
    explorer()            # in a notebook cell

Compute here, draw with the phases' figure functions; nothing printed. ``case_view``, ``trace_view`` and
``list_runs`` are plain functions the widgets call, usable (and tested) without a browser.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.paths import outputs_root, samples_root, cache_root
from servelab.measure import request_metrics as mx
from servelab.analyse.trace import figures
from servelab.analyse.trace.analysis import analyse
from servelab.analyse.trace.load import load_capture
from servelab.core.params import ParamError, did_you_mean
from servelab.core.run import read_manifest
from servelab.measure.case_record import read_summary, read_summaries
from servelab.measure.records import read_records
from servelab.report.ledger import ledger


def list_runs(root: Path | None = None) -> pd.DataFrame:
    """Runs under ``outputs/`` (newest first): run id, target, created, phases with status."""
    root = root or outputs_root()
    rows = []
    for d in sorted(root.glob("*/manifest.json")) if root.exists() else []:
        try:
            m = json.loads(d.read_text())
        except json.JSONDecodeError:
            continue
        rows.append({"run_id": d.parent.name, "target": m.get("target", ""), "created": m.get("created", ""),
                     "phases": ", ".join(f"{p}:{e.get('status', '')}" for p, e in sorted(m.get("phases", {}).items()))})
    return pd.DataFrame(rows, columns=["run_id", "target", "created", "phases"]).sort_values(
        "created", ascending=False, ignore_index=True)


def list_cases(run_dir: Path) -> list[str]:
    """Case ids that have a summary (measured cases, Phase 1/2/7/8/9)."""
    return sorted(p.parent.name for p in (run_dir / "cases").glob("*/summary.json"))


def case_view(run_dir: Path, case_id: str, definition: str = mx.VLLM_BENCH) -> tuple[pd.DataFrame, Any]:
    """One case: its percentile table (both definitions) and the per-request TTFT/E2E scatter over time."""
    import plotly.graph_objects as go

    cdir = run_dir / "cases" / case_id
    pooled = read_summary(cdir / "summary.json")["metrics"]
    rows = []
    for d, s in pooled.items():
        for metric in ("ttft", "tpot", "itl", "e2e"):
            names = ("e2el", "e2e_latency", "e2e") if metric == "e2e" else (metric,)   # vllm / sglang key names
            row = {"definition": d, "metric": metric}
            name = next((n for n in names if f"mean_{n}_ms" in s), names[0])
            for stat in ("mean", "p50", "p90", "p95", "p99", "max"):
                # a percentile says what it rests on (or is "max of N"): request_metrics.percentile_cell
                row[stat] = (mx.percentile_cell(s, name, float(stat[1:])) if stat.startswith("p")
                             else s.get(f"{stat}_{name}_ms"))
            rows.append(row)
    table = pd.DataFrame(rows)
    recs = [r for r in read_records(cdir / "requests.jsonl") if r.role != "warmup"]
    fig = go.Figure()
    if recs:
        t0 = min(r.send_ns for r in recs)
        per = [mx.request_metrics(r, definition) for r in recs]
        x = [(r.send_ns - t0) / 1e9 for r in recs]
        fig.add_scatter(x=x, y=[p.ttft_ms for p in per], mode="markers", name="TTFT (ms)")
        fig.add_scatter(x=x, y=[p.e2el_ms for p in per], mode="markers", name="E2E (ms)")
    fig.update_layout(title=f"{case_id}: per request, by send time ({definition} definition)",
                      xaxis_title="send time (s from first request)", yaxis_title="ms", height=380)
    return table, fig


def trace_folders(run_dir: Path) -> list[Path]:
    """Folders holding collected traces in a run (profiled cases), plus the bundled sample."""
    found = sorted({p.parent.parent for p in (run_dir / "cases").glob("*/profiles/*/*.trace.json.gz")})
    sample = samples_root() / "h200x2" / "traces"
    return found + ([sample] if sample.exists() else [])


def trace_view(folder: Path, rank: int | None = None, t0_ms: float | None = None, t1_ms: float | None = None) -> Any:
    """The Phase 3 per-rank timeline of a capture, optionally one rank and a zoomed time range."""
    a = analyse(folder, cache_dir=cache_root() / "traces")
    if rank is not None:
        import dataclasses
        a = dataclasses.replace(a, rops=[r for r in a.rops if r.rank == rank])
    return figures.timeline(a, t0_ms=t0_ms, t1_ms=t1_ms)


def explorer(root: Path | None = None, run_id: str | None = None) -> Any:
    """The JupyterLab explorer: run → case table/figure, and capture → rank/time-window timeline (``run_id``:
    the run selected first; default the newest)."""
    import ipywidgets as w
    from IPython.display import display

    runs = list_runs(root)
    options = list(runs["run_id"])
    run_dd = w.Dropdown(options=options, description="run",
                        value=run_id if run_id in options else (options[0] if options else None))
    case_dd = w.Dropdown(options=[], description="case")
    def_dd = w.Dropdown(options=[mx.VLLM_BENCH.value, mx.SGLANG_BENCH.value], description="definition")
    trace_dd = w.Dropdown(options=[], description="capture")
    rank_dd = w.Dropdown(options=[("all", None)], description="rank")
    window = w.FloatRangeSlider(value=(0.0, 100.0), min=0.0, max=100.0, step=0.5, description="window %")
    out_case, out_trace = w.Output(), w.Output()

    def run_dir() -> Path:
        return (root or outputs_root()) / str(run_dd.value)

    def on_run(_: Any = None) -> None:
        if run_dd.value is None:
            return
        case_dd.options = list_cases(run_dir())
        trace_dd.options = [(str(p.relative_to(run_dir())) if run_dir() in p.parents else f"sample: {p.name}", p)
                            for p in trace_folders(run_dir())]

    def on_case(_: Any = None) -> None:
        out_case.clear_output()
        if case_dd.value:
            table, fig = case_view(run_dir(), case_dd.value, def_dd.value)
            with out_case:
                display(table, fig)

    def on_trace(_: Any = None) -> None:
        out_trace.clear_output()
        if trace_dd.value is None:
            return
        cap = load_capture(trace_dd.value)
        ranks = sorted({t.identity.rank for t in cap.ranks})
        rank_dd.options = [("all", None)] + [(str(r), r) for r in ranks]

    def on_draw(_: Any = None) -> None:
        out_trace.clear_output()
        if trace_dd.value is None:
            return
        lo, hi = window.value
        fig = trace_view(trace_dd.value, rank_dd.value)
        if fig.layout.xaxis.range is None and (lo, hi) != (0.0, 100.0):
            xs = [x for tr in fig.data for x in (tr.x or []) if isinstance(x, (int, float))]
            if xs:
                span = max(xs) - min(xs)
                fig.update_xaxes(range=[min(xs) + span * lo / 100, min(xs) + span * hi / 100])
        with out_trace:
            display(fig)

    run_dd.observe(on_run, "value")
    case_dd.observe(on_case, "value")
    def_dd.observe(on_case, "value")
    trace_dd.observe(on_trace, "value")
    draw = w.Button(description="draw timeline")
    draw.on_click(on_draw)
    on_run()
    return w.VBox([w.HTML("<b>servelab explorer</b>"), run_dd,
                   w.HBox([case_dd, def_dd]), out_case,
                   w.HBox([trace_dd, rank_dd]), window, draw, out_trace])


# ---------------------------------------------------------------- static views of one run (notebooks/explore_run.ipynb)

def resolve_run(run_id: str = "", target: str = "", root: Path | None = None) -> Path:
    """``outputs/<run_id>``; with an empty id the newest run (of ``target`` when given). A clear error when
    there is none."""
    root = root or outputs_root()
    runs = list_runs(root)
    if run_id:
        if not (root / run_id / "manifest.json").is_file():
            raise ParamError(f"no run '{run_id}' under {root}{did_you_mean(run_id, set(runs['run_id']))}")
        return root / run_id
    pick = runs[runs["target"] == target] if target else runs
    if pick.empty:
        raise ParamError(f"no run under {root}" + (f" for target '{target}'" if target else "")
                         + " — run a phase first (servelab run phase0 --target local)")
    return root / str(pick.iloc[0]["run_id"])


def run_phases(run_dir: Path) -> pd.DataFrame:
    """One row per phase of the run: status, recorded sample data or not, start / end, its page, the headline."""
    m = read_manifest(run_dir)
    rows = []
    for phase, e in sorted(m.get("phases", {}).items(), key=lambda x: int(x[0][5:]) if x[0][5:].isdigit() else 99):
        head = e.get("headline") or {}
        rows.append({"phase": phase, "status": e.get("status", ""), "from_samples": bool(e.get("from_samples")),
                     "started": e.get("started", ""), "ended": e.get("ended", ""),
                     "page": f"{phase}/report.html" if (run_dir / phase / "report.html").is_file() else "-",
                     "headline": "; ".join(f"{k}: {v}" for k, v in list(head.items())[:6]) or "-"})
    return pd.DataFrame(rows, columns=["phase", "status", "from_samples", "started", "ended", "page", "headline"])


def case_table(run_dir: Path, definition: str = mx.VLLM_BENCH) -> pd.DataFrame:
    """Every measured case of the run from its ``summary.json``: phase, kind, concurrency, repeats, verdict
    (first reason), requests, output TPS and P50/P95 TTFT / TPOT in ``definition``. Summaries that do not
    follow the case schema are listed with their problem."""
    errors: list[str] = []
    rows = []
    for s in read_summaries(run_dir, errors=errors):
        m = s["metrics"].get(definition) or {}
        case = (s.get("details") or {}).get("case") or {}
        rows.append({"case_id": s["case_id"], "phase": s["phase"], "kind": s["kind"],
                     "concurrency": case.get("concurrency"), "repeats": len(s.get("repeats") or []),
                     "verdict": s["verdict"]["status"], "reason": "; ".join(s["verdict"]["reasons"][:1]),
                     "requests": (s.get("counts") or {}).get("measured"), "output_tps": m.get("output_throughput"),
                     "p50_ttft_ms": m.get("p50_ttft_ms"), "p95_ttft_ms": m.get("p95_ttft_ms"),
                     "p50_tpot_ms": m.get("p50_tpot_ms"), "p95_tpot_ms": m.get("p95_tpot_ms"),
                     "completed": m.get("completed"), **{k: m.get(k) for k in ("n_ttft", "n_tpot", "max_ttft_ms",
                                                                              "max_tpot_ms")}})
    rows += [{"case_id": "-", "verdict": "not a case summary", "reason": e} for e in errors]
    cols = ["case_id", "phase", "kind", "concurrency", "repeats", "verdict", "reason", "requests", "output_tps",
            "p50_ttft_ms", "p95_ttft_ms", "p50_tpot_ms", "p95_tpot_ms"]
    extra = ["completed", "n_ttft", "n_tpot", "max_ttft_ms", "max_tpot_ms"]
    # every percentile with its count, or "max of N" where too few values hold it
    shown = mx.labelled_percentiles(pd.DataFrame(rows, columns=cols + extra))
    return shown[cols]


def capture_summary(run_dir: Path) -> pd.DataFrame:
    """The captures this run can show: the trace folders of its profiled cases, the capture Phase 3 analysed
    (``phase3/trace_analysis.json``) and the bundled sample — each with its trace files, ranks and size."""
    sample = samples_root() / "h200x2" / "traces"
    folders: dict[Path, str] = {}
    for f in trace_folders(run_dir):
        folders[f.resolve()] = "recorded sample (data/samples)" if f == sample else "profiled case of this run"
    analysed = run_dir / "phase3" / "trace_analysis.json"
    info = json.loads(analysed.read_text()) if analysed.is_file() else {}
    p3_dir = Path(info["trace_dir"]).expanduser().resolve() if info.get("trace_dir") else None
    if p3_dir is not None:
        folders.setdefault(p3_dir, "given to Phase 3")
    rows = []
    for folder, source in folders.items():
        files = sorted(folder.rglob("*.json.gz")) + sorted(folder.rglob("*.json"))
        files = [f for f in files if ".servelab_cache" not in f.parts]
        where = str(folder.relative_to(run_dir.resolve())) if run_dir.resolve() in folder.parents else str(folder)
        p3 = folder == p3_dir
        rows.append({"capture": where, "source": source + (" · analysed by Phase 3" if p3 else ""),
                     "trace_files": len(files), "ranks": info.get("ranks") if p3 else None,
                     "size_mib": round(sum(f.stat().st_size for f in files) / 2**20, 2),
                     "slow_rank": (info.get("slow_rank") or {}).get("slow_rank") if p3 else None})
    return pd.DataFrame(rows, columns=["capture", "source", "trace_files", "ranks", "size_mib", "slow_rank"])


def ledger_table(run_dir: Path) -> pd.DataFrame:
    """The run's hypotheses ledger: status, and each piece of evidence with its phase and the tables it rests on."""
    rows = []
    for _, r in ledger(run_dir).iterrows():
        evs = r["evidence"] or [{}]
        for e in evs:
            rows.append({"id": r["id"], "hypothesis": r["hypothesis"], "status": r["status"],
                         "phase": e.get("phase", "-"), "verdict": e.get("verdict", "-"),
                         "evidence": e.get("summary", r["decided_by"] and f"decided by: {r['decided_by']}"),
                         "tables": ", ".join(e.get("tables") or []) or "-"})
    return pd.DataFrame(rows, columns=["id", "hypothesis", "status", "phase", "verdict", "evidence", "tables"])
