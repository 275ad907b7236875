"""Exploration in JupyterLab: pick a run, a case, a capture, a rank or a time window with widgets; the same
compute and figure functions as the rendered pages draw the result.

    from servelab.explore import explorer
    explorer()            # in a notebook cell

The explorer opens drawn: on the run's first VALID case (in the order the cases ran) and on its first capture
that analyses. Every control redraws what it governs, and a one-line note under each half says what is shown, or
why it cannot be — errors included, in the cell's output (never only in JupyterLab's log console). It writes
nothing into the run or the checkout: parsed traces are cached under ``cache_root()/traces`` (``SERVELAB_CACHE``).

Compute here, draw with the phases' figure functions; nothing printed. ``case_view``, ``timeline_view``,
``case_choices``, ``capture_folders`` and ``list_runs`` are plain functions the widgets call, usable (and
tested) without a browser.
"""
from __future__ import annotations

import html
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go

from servelab.measure import request_metrics as mx
from servelab.core.paths import cache_root, outputs_root, samples_root
from servelab.analyse.trace import figures
from servelab.analyse.trace.analysis import analyse
from servelab.core.params import ParamError, did_you_mean
from servelab.core.run import read_manifest
from servelab.measure.case_record import read_summaries, read_summary
from servelab.measure.records import read_records
from servelab.report.ledger import ledger
from servelab.report.tables import table_html

SAMPLE_CAPTURE = ("h200x2", "traces")     # the bundled capture under data/samples every run can show


def trace_cache_dir() -> Path:
    """Where the explorer caches parsed traces: the user cache, never beside the traces (a run folder or the
    checkout's ``data/samples`` stays as it was)."""
    return cache_root() / "traces"


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


def _phase_number(phase: Any) -> int:
    text = str(phase)
    return int(text[5:]) if text.startswith("phase") and text[5:].isdigit() else 99


CHOICE_COLUMNS = ["case_id", "phase", "verdict", "reason", "requests", "started"]


def case_choices(run_dir: Path) -> pd.DataFrame:
    """The run's measured cases in the order they ran (phase, then start time): ``case_id``, ``phase``,
    ``verdict``, ``reason`` (the first), ``requests`` (measured). A summary that breaks the case schema is left
    out here (:func:`case_table` lists it with its problem)."""
    rows = [{"case_id": s["case_id"], "phase": s["phase"], "verdict": s["verdict"]["status"],
             "reason": "; ".join(s["verdict"]["reasons"][:1]), "requests": (s.get("counts") or {}).get("measured"),
             "started": str(s.get("started") or "")}
            for s in read_summaries(run_dir, errors=[])
            if (run_dir / "cases" / s["case_id"] / "summary.json").is_file()]
    df = pd.DataFrame(rows, columns=CHOICE_COLUMNS)
    df["_order"] = [_phase_number(p) for p in df["phase"]]
    return df.sort_values(["_order", "started", "case_id"], ignore_index=True).drop(columns="_order")


def first_valid_case(choices: pd.DataFrame) -> tuple[str | None, str]:
    """The case the explorer opens on — the first VALID one, else the first — and a one-line note saying why."""
    if choices.empty:
        return None, "this run has no measured case (no cases/*/summary.json): Phases 1, 2, 7, 8 and 9 measure them"
    valid = choices[choices["verdict"] == "VALID"]
    if not valid.empty:
        return str(valid.iloc[0]["case_id"]), ""
    first = choices.iloc[0]
    return str(first["case_id"]), (f"no VALID case in this run: showing {first['case_id']} "
                                   f"({first['verdict']}: {first['reason'] or 'no reason given'}), not a result")


def case_view(run_dir: Path, case_id: str, definition: str = mx.VLLM_BENCH) -> tuple[pd.DataFrame, Any]:
    """One case: its percentile table (both definitions) and the per-request TTFT/E2E scatter over time."""
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


def capture_folders(run_dir: Path) -> list[tuple[Path, str]]:
    """The captures a run can show, in this order: the trace folders of its profiled cases, the capture Phase 3
    analysed (``phase3/trace_analysis.json``), the bundled sample — each with where it comes from."""
    sample = samples_root().joinpath(*SAMPLE_CAPTURE).resolve()
    found: dict[Path, str] = {}
    for f in sorted({p.parent.parent for p in (run_dir / "cases").glob("*/profiles/*/*.trace.json.gz")}):
        found.setdefault(f.resolve(), "profiled case of this run" + _scenario_of(f.parent))
    p3 = phase3_capture(run_dir)
    if p3 is not None:
        found.setdefault(p3, "recorded sample (data/samples)" if p3 == sample else "Phase 3's trace_dir")
    if sample.is_dir():
        found.setdefault(sample, "recorded sample (data/samples)")
    return list(found.items())


def _scenario_of(case_dir: Path) -> str:
    """`` (scenario <name>)`` for a Phase 3 profiled case (its ``meta.json``), "" otherwise: the explorer's list of
    captures names each captured scenario, so one can switch between them."""
    try:
        name = json.loads((case_dir / "meta.json").read_text()).get("scenario")
    except (OSError, json.JSONDecodeError, AttributeError):
        return ""
    return f" (scenario {name})" if isinstance(name, str) and name else ""


def phase3_capture(run_dir: Path) -> Path | None:
    """The folder Phase 3 analysed in this run (``phase3/trace_analysis.json``), or None."""
    analysed = run_dir / "phase3" / "trace_analysis.json"
    try:
        info = json.loads(analysed.read_text()) if analysed.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return None
    return Path(info["trace_dir"]).expanduser().resolve() if info.get("trace_dir") else None


def trace_folders(run_dir: Path) -> list[Path]:
    """The capture folders of :func:`capture_folders` (the bundled sample last)."""
    return [f for f, _ in capture_folders(run_dir)]


def capture_label(folder: Path, run_dir: Path) -> str:
    """How the explorer names a capture: relative to the run, to ``data/samples``, or its full path."""
    for base, prefix in ((run_dir.resolve(), ""), (samples_root().resolve(), "sample: ")):
        if base in folder.parents:
            return prefix + str(folder.relative_to(base))
    return str(folder)


def capture_analysis(folder: Path) -> Any:
    """The Phase 3 analysis of a capture folder; parsed traces cached under :func:`trace_cache_dir`."""
    return analyse(folder, cache_dir=trace_cache_dir())


def span_ms(a: Any) -> float | None:
    """First GPU op to last op end of an analysed capture (ranks' clocks aligned), in ms; None without ops —
    the span the timeline's window percentages refer to (:func:`servelab.analyse.trace.figures.timeline`)."""
    off = a.alignment.offsets_ns
    starts = [int(r.ops["ts_ns"].min()) - off.get(r.rank, 0) for r in a.rops if r.ops.height]
    ends = [int(r.ops["end_ns"].max()) - off.get(r.rank, 0) for r in a.rops if r.ops.height]
    return (max(ends) - min(starts)) / 1e6 if starts else None


def timeline_view(a: Any, rank: int | None = None, window_pct: tuple[float, float] = (0.0, 100.0)
                  ) -> tuple[Any, str]:
    """The Phase 3 per-rank timeline of analysed capture ``a`` — all ranks or one, zoomed to ``window_pct``
    (from, to: percent of the shown ranks' span) — and its readout (``"24.5 – 52.0 % of 3.10 ms: 0.76 – 1.61
    ms"``). A rank the capture lacks or an empty window raises ``ValueError`` saying what to pick instead."""
    if rank is not None:
        ranks = sorted(r.rank for r in a.rops)
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in this capture: pick one of {', '.join(map(str, ranks))} or all")
        a = replace(a, rops=[r for r in a.rops if r.rank == rank])
    lo, hi = (float(v) for v in window_pct)
    if not 0.0 <= lo <= hi <= 100.0:
        raise ValueError(f"window {lo:g} – {hi:g} %: it must lie within 0 – 100 %, from ≤ to")
    if hi == lo:
        raise ValueError(f"the window {lo:.1f} – {hi:.1f} % is empty: widen it")
    span = span_ms(a)
    if span is None:
        return figures.timeline(a), "no GPU ops in this capture: nothing to window"
    t0, t1 = span * lo / 100, span * hi / 100
    if (lo, hi) == (0.0, 100.0):
        fig = figures.timeline(a)
    else:
        fig = figures.timeline(a, t0_ms=t0, t1_ms=t1)
        fig.update_xaxes(range=[t0, t1])
    return fig, f"{lo:.1f} – {hi:.1f} % of {span:.2f} ms: {t0:.2f} – {t1:.2f} ms"


def trace_view(folder: Path, rank: int | None = None, t0_ms: float | None = None, t1_ms: float | None = None) -> Any:
    """The Phase 3 per-rank timeline of a capture, optionally one rank and a zoomed time range (ms)."""
    a = capture_analysis(folder)
    if rank is not None:
        a = replace(a, rops=[r for r in a.rops if r.rank == rank])
    return figures.timeline(a, t0_ms=t0_ms, t1_ms=t1_ms)


# ---------------------------------------------------------------- the widgets

def one_line(exc: BaseException | str, limit: int = 300) -> str:
    """An error (or any text) as one line: its type and first line, cut to ``limit`` characters."""
    if isinstance(exc, BaseException):
        first = (str(exc).strip().splitlines() or [""])[0]
        text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    else:
        text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def note_html(text: str, kind: str = "info") -> str:
    """A note line of the explorer (escaped): ``info`` grey, ``warn`` amber, ``error`` red."""
    color = {"info": "#333", "warn": "#8a5300", "error": "#b00020"}[kind]
    return (f'<div class="servelab-note servelab-note-{kind}" style="color:{color};white-space:normal;'
            f'line-height:1.4">{html.escape(text)}</div>')


def mime_table(df: pd.DataFrame) -> dict[str, Any]:
    """A display_data output of a table, drawn as on the phase pages."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": table_html(df), "text/plain": f"table: {len(df)} rows × {len(df.columns)} columns"}}


def figure_mime(fig: Any) -> dict[str, Any]:
    """A display_data output of a plotly figure (JupyterLab's plotly renderer draws it)."""
    spec = json.loads(fig.to_json())
    title = (fig.layout.title.text or "figure") if fig.layout.title else "figure"
    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": {"data": spec.get("data", []), "layout": spec.get("layout", {}),
                                                         "config": {"displaylogo": False, "responsive": True}},
                     "text/plain": f"figure: {title}"}}


def explorer(root: Path | None = None, run_id: str | None = None) -> Any:
    """The JupyterLab explorer: run → case (percentile table and per-request figure), and capture → rank and time
    window (the per-rank timeline). ``run_id``: the run selected first (default the newest).

    Opens drawn on the run's first VALID case and first capture that analyses. Each control redraws what it
    governs; the note under each half says what is shown or, in one line, why it cannot be (errors too)."""
    root = Path(root) if root else outputs_root()
    run_ids = list(list_runs(root)["run_id"])
    wide, long_, short = {"description_width": "80px"}, widgets.Layout(width="560px"), widgets.Layout(width="220px")
    run_dd = widgets.Dropdown(options=run_ids, description="run", style=wide, layout=long_,
                        value=run_id if run_id in run_ids else (run_ids[0] if run_ids else None))
    case_dd = widgets.Dropdown(options=[], description="case", style=wide, layout=long_)
    def_dd = widgets.Dropdown(options=[mx.VLLM_BENCH.value, mx.SGLANG_BENCH.value], value=mx.VLLM_BENCH.value,
                        description="definition", style=wide, layout=short)
    trace_dd = widgets.Dropdown(options=[], description="capture", style=wide, layout=long_)
    rank_dd = widgets.Dropdown(options=[("all ranks", -1)], value=-1, description="rank", style=wide, layout=short)
    window = widgets.FloatRangeSlider(value=(0.0, 100.0), min=0.0, max=100.0, step=0.5, description="window %",
                                readout=False, continuous_update=False, style=wide, layout=long_)
    run_note, case_note, trace_note, readout = widgets.HTML(), widgets.HTML(), widgets.HTML(), widgets.HTML()
    out_case, out_trace = widgets.Output(), widgets.Output()
    # class names: what a person sees is found by them in the browser (tests/test_explore_live.py)
    for name, widget in (("run", run_dd), ("case", case_dd), ("definition", def_dd), ("capture", trace_dd),
                         ("rank", rank_dd), ("window", window), ("readout", readout), ("run-note", run_note),
                         ("case-note", case_note), ("trace-note", trace_note), ("case-out", out_case),
                         ("trace-out", out_trace)):
        widget.add_class(f"servelab-{name}")
    state: dict[str, Any] = {"analysis": None, "cases": pd.DataFrame(columns=CHOICE_COLUMNS), "quiet": False,
                             "why_no_capture": ""}

    def run_dir() -> Path:
        return root / str(run_dd.value)

    def guarded(note: Any, what: str, out: Any):
        """The handler, except that while the explorer sets its own controls it does nothing, and any error
        clears what it would have drawn and says why in ``note``, in one line."""
        def wrap(fn):
            def handler(change: Any = None) -> None:
                if state["quiet"]:
                    return
                try:
                    fn(change)
                except Exception as exc:                 # shown in the cell, never only in the log console
                    out.outputs = ()
                    note.value = note_html(f"{what}: {one_line(exc)}", "error")
            return handler
        return wrap

    def quietly(fn) -> None:
        state["quiet"] = True
        try:
            fn()
        finally:
            state["quiet"] = False

    @guarded(case_note, "could not draw the case", out_case)
    def draw_case(_: Any = None) -> None:
        out_case.outputs = ()
        choices = state["cases"]
        if case_dd.value is None:
            case_note.value = note_html(first_valid_case(choices)[1] if choices.empty else "pick a case", "warn")
            return
        row = choices.set_index("case_id").loc[case_dd.value]
        table, fig = case_view(run_dir(), case_dd.value, def_dd.value)
        out_case.outputs = (mime_table(table), figure_mime(fig))
        text = f"{case_dd.value} · {row['phase']} · {row['verdict']}"
        if row["verdict"] != "VALID":
            none = "" if (choices["verdict"] == "VALID").any() else "no VALID case in this run; "
            text = f"{none}{text} ({row['reason'] or 'no reason given'}): not a result"
        case_note.value = note_html(f"{text} · {row['requests']} measured requests · {def_dd.value} definition",
                                    "info" if row["verdict"] == "VALID" else "warn")

    @guarded(trace_note, "could not draw the timeline", out_trace)
    def draw_trace(_: Any = None) -> None:
        out_trace.outputs = ()
        lo, hi = window.value
        readout.value = note_html(f"{lo:.1f} – {hi:.1f} %")
        a = state["analysis"]
        if a is None:
            trace_note.value = note_html(state["why_no_capture"] or "pick a capture first", "warn")
            return
        rank = None if rank_dd.value in (None, -1) else int(rank_dd.value)
        fig, text = timeline_view(a, rank, (lo, hi))
        out_trace.outputs = (figure_mime(fig),)
        readout.value = note_html(text)
        trace_note.value = note_html(f"{trace_dd.label} · {'all ranks' if rank is None else f'rank {rank}'} "
                                     f"of {len(a.rops)} · parsed traces cached under {trace_cache_dir()}")

    def analyse_selected() -> None:
        """Analyse the selected capture and reset rank and window to all (raises what the analysis raises)."""
        state["analysis"] = None
        a = capture_analysis(Path(trace_dd.value))
        ranks = sorted(r.rank for r in a.rops)

        def reset() -> None:
            rank_dd.options = [("all ranks", -1)] + [(f"rank {r}", r) for r in ranks]
            rank_dd.value = -1
            window.value = (0.0, 100.0)
        quietly(reset)
        state["analysis"] = a

    @guarded(trace_note, "could not read the capture", out_trace)
    def pick_capture(_: Any = None) -> None:
        state["analysis"] = None
        out_trace.outputs = ()
        if trace_dd.value is not None:
            analyse_selected()
        draw_trace()

    @guarded(run_note, "could not read the run", out_case)
    def pick_run(_: Any = None) -> None:
        state["analysis"], state["why_no_capture"] = None, ""
        out_case.outputs = out_trace.outputs = ()
        if run_dd.value is None:
            state["cases"] = pd.DataFrame(columns=CHOICE_COLUMNS)
            quietly(lambda: (setattr(case_dd, "options", []), setattr(trace_dd, "options", [])))
            for c in (run_dd, case_dd, def_dd, trace_dd, rank_dd, window):
                c.disabled = True
            run_note.value = note_html(f"no run under {root}: run a phase first (servelab run phase1 --target local)",
                                       "warn")
            case_note.value = trace_note.value = ""
            return
        rdir = run_dir()
        choices = state["cases"] = case_choices(rdir)
        folders = capture_folders(rdir)
        p3 = phase3_capture(rdir)

        def fill() -> None:
            case_dd.options = [(f"{r.case_id} · {r.phase} · {r.verdict}", r.case_id) for r in choices.itertuples()]
            case_dd.value = first_valid_case(choices)[0]
            trace_dd.options = [(("Phase 3's capture — " if f == p3 else "") + capture_label(f, rdir), str(f))
                                for f, _ in folders]
            trace_dd.value = str(folders[0][0]) if folders else None
        quietly(fill)
        case_dd.disabled = def_dd.disabled = choices.empty
        trace_dd.disabled = rank_dd.disabled = window.disabled = not folders
        valid = int((choices["verdict"] == "VALID").sum())
        run_note.value = note_html(f"{run_dd.value}: {plural(len(choices), 'measured case')} ({valid} VALID), "
                                   f"{plural(len(folders), 'capture')}")
        draw_case()
        if not folders:
            state["why_no_capture"] = ("no capture to show: this run profiled no case, Phase 3 did not run here, "
                                       "and the bundled sample (data/samples) is absent")
            draw_trace()
            return
        skipped = []
        for i in range(len(folders)):        # the first capture that analyses
            quietly(lambda i=i: setattr(trace_dd, "index", i))
            try:
                analyse_selected()
                break
            except Exception as exc:
                skipped.append(f"{trace_dd.label} ({one_line(exc, 160)})")
        if state["analysis"] is None:
            state["why_no_capture"] = "no capture of this run analyses: " + "; ".join(skipped)
        draw_trace()
        if skipped and state["analysis"] is not None:
            trace_note.value = note_html(f"{trace_dd.label}: the first capture that analyses; skipped "
                                         f"{'; '.join(skipped)}", "warn")

    run_dd.observe(pick_run, "value")
    case_dd.observe(draw_case, "value")
    def_dd.observe(draw_case, "value")
    trace_dd.observe(pick_capture, "value")
    rank_dd.observe(draw_trace, "value")
    window.observe(draw_trace, "value")
    pick_run()
    return widgets.VBox([widgets.HTML("<b>servelab explorer</b>"), run_dd, run_note,
                   widgets.HBox([case_dd, def_dd]), case_note, out_case,
                   widgets.HBox([trace_dd, rank_dd]), widgets.HBox([window, readout]), trace_note, out_trace])


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
    analysed = run_dir / "phase3" / "trace_analysis.json"
    try:
        info = json.loads(analysed.read_text()) if analysed.is_file() else {}
    except (OSError, json.JSONDecodeError):
        info = {}
    p3_dir = phase3_capture(run_dir)
    folders = dict(capture_folders(run_dir))
    rows = []
    for folder, source in folders.items():
        files = sorted(folder.rglob("*.json.gz")) + sorted(folder.rglob("*.json"))
        files = [f for f in files if ".servelab_cache" not in f.parts]
        p3 = folder == p3_dir
        rows.append({"capture": capture_label(folder, run_dir), "source": source + (" · analysed by Phase 3" if p3 else ""),
                     "trace_files": len(files), "ranks": info.get("ranks") if p3 else None,
                     "size_mib": round(sum(f.stat().st_size for f in files) / 2**20, 2),
                     "slow_rank": (info.get("slow_rank") or {}).get("slow_rank") if p3 else None})
    table = pd.DataFrame(rows, columns=["capture", "source", "trace_files", "ranks", "size_mib", "slow_rank"])
    return table.astype({"ranks": "Int64", "slow_rank": "Int64"})     # counts and ids as integers, "—" where none


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
