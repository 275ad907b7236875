"""Every captured scenario of a Phase 3 run analysed on its own, then side by side (``docs/method.md#capture-scenarios``).

Phase 3 captures up to four scenarios in one engine start (decode control, mixed treatment, long prefill, prefix
hit), each in its own profiled case. :func:`analyse_scenarios` analyses each case's trace folder like any capture
(:func:`servelab.analyse.trace.analysis.analyse`), answers its ten questions (Q10 also from the case's one clock),
and writes its tables under ``<phase>/scenarios/<scenario>/`` (``trace_*.csv``, ``.json``). :func:`compare_table`
puts them side by side (step time, exposed communication %, gap %, top kernels), :func:`compare_findings` says what
the injected prefill changes against the decode control, what decode spends that prefill does not and what a
prefix hit saves, and :func:`split_q1` answers Q1 from the prefill capture (prefill) and the decode capture
(decode). Every answer row names the capture it comes from (column ``capture``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from servelab.analyse.trace.analysis import CaptureAnalysis, analyse, write_tables
from servelab.analyse.trace.experts import capture_expert_counts, expert_imbalance
from servelab.analyse.trace.questions import QUESTIONS, q10, ten_questions
from servelab.analyse.trace.stalls import OneClock, clock_shift, one_clock
from servelab.measure.records import read_records

OUTSIDE = "outside steps"      # metrics.top_kernels' kind for ops outside every step window
ORDER = ("long_prefill", "decode_control", "prefix_hit", "mixed_treatment")   # the page's order
MAIN_KIND = {"long_prefill": "prefill", "decode_control": "decode", "prefix_hit": "prefill", "mixed_treatment": "decode"}


@dataclass
class ScenarioView:
    """One captured scenario, analysed: its name, profiled case (folder name), the benchmark case it is bound to,
    its trace folder, the analysis, its ten answers, its one clock (None without client records) and the files
    written; ``error`` when it could not be analysed."""
    scenario: str
    case_id: str
    bound_case_id: str
    folder: Path
    analysis: CaptureAnalysis | None = None
    questions: pl.DataFrame = field(default_factory=pl.DataFrame)
    clock: OneClock | None = None
    files: dict[str, str] = field(default_factory=dict)
    error: str = ""

    @property
    def label(self) -> str:
        return f"{self.scenario} ({self.case_id})"


def case_clock(folder: Path, a: CaptureAnalysis) -> OneClock | None:
    """The one clock of a profiled case: when ``folder`` is a case's ``profiles/`` folder and the case kept its
    client records (``requests.jsonl`` with every chunk's arrival), join them with the trace's steps. None
    otherwise (a bare trace folder, the recorded sample)."""
    req = Path(folder).parent / "requests.jsonl"
    if Path(folder).name != "profiles" or not req.is_file():
        return None
    return one_clock(read_records(req), a.windows, shift=clock_shift(Path(folder).parent, _rank_nodes(a)))


def _rank_nodes(a: CaptureAnalysis) -> dict[int, str]:
    """Each trace rank's node (its sub-folder under ``profiles/``), as the loader identified it."""
    r = a.ranks
    if r is None or r.height == 0 or "node" not in r.columns:
        return {}
    return {int(k): str(n) for k, n in zip(r["rank"], r["node"]) if k is not None}


def answer_capture(a: CaptureAnalysis, folder: Path, capture: str) -> tuple[pl.DataFrame, OneClock | None,
                                                                              dict[str, pl.DataFrame]]:
    """The ten answers of one analysed capture (Q10 from its one clock when the case kept client records; a CPU
    trace has no kernels for the GPU-side answer), each row naming ``capture``; its one clock; and the extra
    tables to write beside the analysis (questions, expert imbalance, placement, stalls, TTFT split, steps)."""
    clock = case_clock(folder, a)
    experts = capture_expert_counts(folder)       # the engine's expert counts recorded with this capture (MoE)
    q = ten_questions(a, experts)
    if clock is not None:
        row = pl.DataFrame([asdict(q10(a, clock))]).with_columns(
            pl.lit(q.filter(pl.col("id") == "Q10")["question_en"][0]).alias("question_en")).select(q.columns)
        q = pl.concat([q.filter(pl.col("id") != "Q10"), row])
    q = q.with_columns(pl.lit(capture).alias("capture"))
    extra: dict[str, pl.DataFrame] = {"questions": q}
    if experts is not None:
        extra["expert_imbalance"] = expert_imbalance(experts)
    if a.placement.height:
        extra["placement"] = a.placement
    if clock is not None:
        extra.update({"stalls": clock.stalls, "ttft_split": clock.ttft, "engine_steps": clock.steps})
    return q, clock, extra


def analyse_scenarios(caps: list[dict[str, Any]], out_dir: Path, analysed: dict[Path, CaptureAnalysis] | None = None,
                      **kw: Any) -> list[ScenarioView]:
    """Analyse every captured scenario: ``caps`` rows with ``scenario``, ``case_id``, ``bound_case_id`` and
    ``folder`` (the case's ``profiles/``); ``analysed`` maps a folder already analysed (the page's main capture)
    to its analysis, reused. Tables go to ``out_dir/<scenario>/``. A scenario whose trace cannot be read keeps its
    error (shown on the page), the others are analysed. ``kw``: :func:`analyse`'s window_regex, top_n, min_gap_us,
    profile_id."""
    views = []
    for c in sorted(caps, key=lambda c: ORDER.index(c["scenario"]) if c["scenario"] in ORDER else len(ORDER)):
        v = ScenarioView(c["scenario"], c["case_id"], c.get("bound_case_id", ""), Path(c["folder"]))
        try:
            a = (analysed or {}).get(v.folder) or analyse(v.folder, **kw)
        except (OSError, ValueError) as exc:
            v.error = f"{type(exc).__name__}: {exc}"
            views.append(v)
            continue
        v.analysis = a
        v.questions, v.clock, extra = answer_capture(a, v.folder, v.label)
        v.files = write_tables(a, Path(out_dir) / v.scenario, extra)
        views.append(v)
    return views


def _view(views: list[ScenarioView], name: str) -> ScenarioView | None:
    return next((v for v in views if v.scenario == name and v.analysis is not None), None)


def _top(a: CaptureAnalysis, kind: str | None, n: int = 3) -> pl.DataFrame:
    """The ``n`` kernels with most time (of one window kind, or over every step window: ops outside the steps, an
    idle engine's waits among them, are not a step's), summed over ranks."""
    t = a.top_kernels
    if t.height == 0:
        return t
    t = t.filter(pl.col("kind") == kind) if kind is not None else t.filter(pl.col("kind") != OUTSIDE)
    return (t.group_by("kernel", "cls").agg(pl.col("total_ms").sum()).sort("total_ms", descending=True).head(n))


def _totals(a: CaptureAnalysis, kind: str | None = None) -> dict[str, Any]:
    """Sums over ranks of one window kind (all kinds: None): steps, median step (ms), span, exposed comm, idle."""
    w = a.window_metrics
    if w.height and kind is not None:
        w = w.filter(pl.col("kind") == kind)
    if w.height == 0:
        return {"steps": 0, "median_step_ms": None, "exposed_comm_pct": None, "gap_pct": None,
                "host_bound_pct": None, "comm_pct": None, "graph_op_pct": None}
    span = float(w["gpu_span_ms"].sum())

    def pct(col: str) -> float | None:
        return round(100 * float(w[col].sum()) / span, 2) if span else None
    ops = int(w["ops"].sum())
    return {"steps": int(w.select(pl.struct("rank", "window").n_unique()).item()) // max(w["rank"].n_unique(), 1),
            "median_step_ms": round(float(w["gpu_span_ms"].median()), 3), "exposed_comm_pct": pct("exposed_comm_ms"),
            "gap_pct": pct("idle_ms"), "host_bound_pct": pct("host_bound_idle_ms"), "comm_pct": pct("comm_ms"),
            "graph_op_pct": round(100 * int(w["graph_ops"].sum()) / ops, 1) if ops else None}


def compare_table(views: list[ScenarioView]) -> pl.DataFrame:
    """One row per scenario, side by side: its case, ranks, steps per window kind, and over all its steps the
    median step time (ms), exposed communication and GPU idle (gap) as % of step time, host-bound idle %,
    CUDA-graph share and the top 3 kernels (time summed over ranks)."""
    rows = []
    for v in views:
        if v.analysis is None:
            rows.append({"scenario": v.scenario, "case": v.case_id, "bound_case": v.bound_case_id,
                         "note": f"not analysed: {v.error}"})
            continue
        a = v.analysis
        w = a.window_metrics
        kinds = (w.group_by("kind").agg(pl.col("window").n_unique()).sort("kind") if w.height else w)
        t = _totals(a)
        rows.append({"scenario": v.scenario, "case": v.case_id, "bound_case": v.bound_case_id, "ranks": len(a.rops),
                     "steps_by_kind": ", ".join(f"{k} {n}" for k, n in kinds.iter_rows()) if w.height else "-",
                     "median_step_ms": t["median_step_ms"], "exposed_comm_pct": t["exposed_comm_pct"],
                     "gap_pct": t["gap_pct"], "host_bound_idle_pct": t["host_bound_pct"],
                     "graph_op_pct": t["graph_op_pct"],
                     "top3_kernels": "; ".join(f"{r['kernel']} ({r['total_ms']:.2f} ms)"
                                               for r in _top(a, None).iter_rows(named=True)) or "-",
                     "note": ""})
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def _shares(a: CaptureAnalysis, kind: str) -> dict[str, float]:
    b = a.breakdown.filter(pl.col("kind") == kind) if a.breakdown.height else a.breakdown
    tot = float(b["total_ms"].sum()) if b.height else 0.0
    if not tot:
        return {}
    return {c: 100 * float(m) / tot for c, m in b.group_by("cls").agg(pl.col("total_ms").sum()).iter_rows()}


def compare_findings(views: list[ScenarioView]) -> list[str]:
    """What the scenarios say against each other, from their tables: the injected prefill against the decode
    control (decode step time, worst decode interval), what decode spends that prefill does not (kernel-class
    shares, exposed communication, gaps), what a prefix hit saves (prefill step time per token)."""
    out = []
    ctl, mix = _view(views, "decode_control"), _view(views, "mixed_treatment")
    pre, hit = _view(views, "long_prefill"), _view(views, "prefix_hit")
    if ctl and mix:
        c, m = _totals(ctl.analysis, "decode"), _totals(mix.analysis, "decode")
        it = mix.analysis.interference
        worst = (f"; its worst decode interval after prefill work is {float(it['interval_ms'].max()):.2f} ms against a "
                 f"steady {float(it['baseline_ms'].drop_nulls().median()):.2f} ms (Q10)"
                 if it.height and it["baseline_ms"].drop_nulls().len() else "")
        if c["median_step_ms"] is not None and m["median_step_ms"] is not None:
            out.append(f"Injected prefill vs decode control: the mixed capture's decode steps take {m['median_step_ms']:.2f} "
                       f"ms at the median ({m['steps']} steps) against {c['median_step_ms']:.2f} ms in the control "
                       f"({c['steps']} steps), {m['median_step_ms'] / c['median_step_ms']:.2f}×; exposed communication "
                       f"{_pct(m['exposed_comm_pct'])} vs {_pct(c['exposed_comm_pct'])}, gaps {_pct(m['gap_pct'])} vs "
                       f"{_pct(c['gap_pct'])} of step time{worst}.")
    if ctl and pre:
        d, p = _shares(ctl.analysis, "decode"), _shares(pre.analysis, "prefill")
        if d and p:
            more = sorted(((d.get(k, 0) - p.get(k, 0), k) for k in set(d) | set(p)), reverse=True)
            items = ", ".join(f"{k} {d.get(k, 0):.1f}% vs {p.get(k, 0):.1f}%" for diff, k in more[:3] if diff > 0)
            dt, pt = _totals(ctl.analysis, "decode"), _totals(pre.analysis, "prefill")
            out.append(f"What decode spends that prefill does not (share of device op time, decode control vs long "
                       f"prefill): {items or 'no class takes a larger share in decode'}; exposed communication "
                       f"{_pct(dt['exposed_comm_pct'])} vs {_pct(pt['exposed_comm_pct'])}, gaps {_pct(dt['gap_pct'])} vs "
                       f"{_pct(pt['gap_pct'])} of step time.")
    if hit and pre:
        h, p = _per_token(hit.analysis), _per_token(pre.analysis)
        if h and p:
            out.append(f"What a prefix hit saves: its prefill steps compute {h[1]:,.0f} tokens (the steps' own token "
                       f"counts) in {h[0]:.2f} ms, {1e3 * h[0] / h[1]:.3f} µs/token, against {p[1]:,.0f} tokens in "
                       f"{p[0]:.2f} ms, {1e3 * p[0] / p[1]:.3f} µs/token, for the long prefill (rank "
                       f"{hit.analysis.window_metrics['rank'].min()} of each).")
        elif _totals(hit.analysis, "prefill")["steps"] and _totals(pre.analysis, "prefill")["steps"]:
            hm, pm = _totals(hit.analysis, "prefill"), _totals(pre.analysis, "prefill")
            out.append(f"What a prefix hit saves: its prefill steps take {hm['median_step_ms']:.2f} ms at the median "
                       f"against {pm['median_step_ms']:.2f} ms for the long prefill (the trace names no token count).")
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _per_token(a: CaptureAnalysis) -> tuple[float, float] | None:
    """(ms, tokens) of the prefill steps of one rank (the first), where the step names carry a token count."""
    w = a.window_metrics
    if w.height == 0:
        return None
    w = w.filter((pl.col("kind") == "prefill") & pl.col("toks").is_not_null() & (pl.col("rank") == w["rank"].min()))
    toks = float(w["toks"].sum()) if w.height else 0.0
    return (float(w["gpu_span_ms"].sum()), toks) if toks > 0 else None


def split_q1(views: list[ScenarioView]) -> dict[str, Any] | None:
    """Q1 answered as the method asks: prefill's top kernels from the long-prefill capture, decode's from the
    decode control (None unless both were analysed and hold windows of their kind)."""
    pre, ctl = _view(views, "long_prefill"), _view(views, "decode_control")
    if pre is None or ctl is None:
        return None
    parts, ev = [], []
    for kind, v in (("prefill", pre), ("decode", ctl)):
        t = _top(v.analysis, kind)
        if t.height == 0:
            return None
        tot = float(v.analysis.breakdown.filter(pl.col("kind") == kind)["total_ms"].sum()) or 1.0
        parts.append(f"{kind} (from {v.label}): " + "; ".join(
            f"{r['kernel']} ({r['cls']}, {100 * r['total_ms'] / tot:.1f}%, {r['total_ms']:.2f} ms)"
            for r in t.iter_rows(named=True)))
        ev.append(f"{v.scenario}: top_kernels of its {kind} windows, summed over {len(v.analysis.rops)} ranks "
                  f"(scenarios/{v.scenario}/trace_top_kernels.csv)")
    return {"id": "Q1", "question": QUESTIONS[0][1], "question_en": QUESTIONS[0][2], "answerable": True,
            "answer": " | ".join(parts), "evidence": "; ".join(ev),
            "source": f"{pre.folder} · {ctl.folder}", "capture": f"{pre.label} + {ctl.label}"}
