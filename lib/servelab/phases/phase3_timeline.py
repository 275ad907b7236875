"""What the Phase 3 notebook calls: analyse a capture folder (or the recorded sample), show each table,
and write every table into the phase folder (``trace_*.csv`` / ``.json``) for tests and reports."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import polars as pl

from servelab.core.paths import cache_root, samples_root
from servelab.analyse.trace.actions import evidence_actions
from servelab.analyse.trace.analysis import CaptureAnalysis, analyse, write_tables
from servelab.analyse.trace.questions import ten_questions

SAMPLE_DIR = ("h200x2", "traces")
SAMPLE_TEXT = ("2 x NVIDIA H200 (NVLink), TP=2 torch-profiler traces of a random-weight 8-layer transformer, recorded "
               "2026-11-29: prefill_step_i (4096 tokens), decode_eager_step_i, decode_graph_step_i (CUDA graph), "
               "mixed_decode_step_i with one mixed_prefill_chunk_8192 injected; files data/samples/h200x2/traces/")


def sample_dir() -> Path:
    return samples_root().joinpath(*SAMPLE_DIR)


@dataclass
class Phase3:
    """The analysis plus the two verdict tables, as shown on the page."""
    analysis: CaptureAnalysis
    questions: pl.DataFrame
    actions: pl.DataFrame
    files: dict[str, str]


def run_analysis(ctx: Any, trace_dir: str = "", window_regex: str = "", top_n: int = 10, min_gap_us: float = 0.0,
                 profile_id: str = "") -> Phase3:
    """Analyse ``trace_dir`` (empty: the recorded H200 sample, and ``ctx.from_samples`` is set), answer the
    ten questions, apply the evidence → action table and write every table into ``ctx.phase_dir``."""
    if not trace_dir:
        folder, ctx.from_samples = sample_dir(), True
        cache_dir = cache_root() / "traces"      # never write caches into the repository's data/samples
    else:
        folder, cache_dir = Path(trace_dir).expanduser(), None
    a = analyse(folder, window_regex=window_regex or None, top_n=int(top_n), min_gap_us=float(min_gap_us),
                profile_id=profile_id or None, cache_dir=cache_dir)
    q = ten_questions(a)
    act = evidence_actions(a)
    files = write_tables(a, ctx.phase_dir, {"questions": q, "actions": act})
    return Phase3(a, q, act, files)


def _pd(df: pl.DataFrame, round_to: int = 3) -> pd.DataFrame:
    if df is None or df.height == 0:
        return pd.DataFrame()
    out = df.to_pandas()
    num = out.select_dtypes("float").columns
    out[num] = out[num].round(round_to)
    return out




def ranks_table(p: Phase3) -> pd.DataFrame:
    """One row per rank trace: file, role, global rank, TP/DP/PP/EP, node, events, kernels, load time."""
    cols = ["file", "role", "rank", "world_size", "tp", "dp", "pp", "ep", "stage", "node", "engine", "source", "events",
            "kernels", "gpu", "load_s", "from_cache"]
    r = p.analysis.ranks
    return _pd(r.select([c for c in cols if c in r.columns]))


def windows_table(p: Phase3) -> pd.DataFrame:
    """Per (rank, window kind): steps, median step, GPU time, busy %, comm %, exposed comm %, host-bound idle %,
    graph share (all columns in trace_summary.csv)."""
    s = p.analysis.summary
    if s.height == 0:
        return pd.DataFrame()
    return _pd(s.select("rank", "kind", "windows", "median_step_ms", "gpu_span_ms", "busy_pct", "comm_pct",
                        "exposed_comm_pct", "overlap_pct", "idle_ms", "host_bound_idle_pct", "gaps", "graph_op_pct"))


def breakdown_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.breakdown)


def top_kernels_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.top_kernels.drop("name"))


def overlap_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.overlap_table())


def gaps_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.gap_summary)


def graph_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.graph)


def alignment_table(p: Phase3) -> pd.DataFrame:
    """Clock offsets per rank with the alignment notes, the skew per step and the slow-rank verdict."""
    a = p.analysis
    t = _pd(a.alignment.table)
    notes = "; ".join(a.alignment.notes)
    slow = a.slow_rank.get("evidence", "")
    caption = f"alignment ok: {a.alignment.alignment_ok}. {notes}. Slow rank: {a.slow_rank.get('slow_rank')} — {slow}"
    if not len(t):
        return pd.DataFrame({"note": [caption]})
    t.attrs["caption"] = caption            # drawn above the table by the page's table display (escaped)
    return t


def skew_table(p: Phase3, worst: int = 15) -> pd.DataFrame:
    """Steps with the largest end-time skew across ranks (µs), which rank finished last; every step is in
    trace_step_skew.csv."""
    s = p.analysis.step_skew
    if s.height == 0:
        return pd.DataFrame({"note": ["fewer than two ranks share a step window"]})
    return _pd(s.sort("end_skew_us", descending=True).head(worst)
               .select("window", "name", "kind", "ranks", "end_skew_us", "start_skew_us", "last_rank", "first_rank"))


def collective_skew_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.collective_skew)


def pp_table(p: Phase3) -> pd.DataFrame:
    """PP stage busy / bubble / both-stages-busy; empty when the ranks carry no PP identity."""
    a = p.analysis
    both = pl.concat([a.pp, a.pp_compute], how="diagonal_relaxed") if a.pp.height else a.pp
    if both.height == 0:
        return pd.DataFrame({"note": ["no PP identity in the trace file names (…-PP-<n>…): a single pipeline stage"]})
    return _pd(both)


def nccl_table(p: Phase3) -> pd.DataFrame:
    """One row per (collective, kernel, dtype, size, group); all columns in trace_nccl_forensics.csv."""
    n = p.analysis.nccl
    if n.height == 0:
        return pd.DataFrame({"note": ["no communication kernels in this capture"]})
    return _pd(n.select("collective", "subclass", "dtype", "msg_mib", "group_size", "count", "ranks", "kinds",
                        "in_graph_pct", "total_ms", "p50_us", "p95_us", "min_us", "busbw_p50_gbps", "busbw_best_gbps",
                        "name_algo", "name_proto"))


def interference_table(p: Phase3) -> pd.DataFrame:
    """Decode steps that followed prefill work, worst first (the evidence of Q10)."""
    it = p.analysis.interference
    if it.height == 0:
        return pd.DataFrame({"note": ["no decode steps in this capture"]})
    return _pd(it.sort("delay_ms", descending=True).head(10)
               .select("rank", "window", "name", "interval_ms", "baseline_ms", "delay_ms", "prefill_span_ms",
                       "prefill_between_ms", "prefill_windows", "queued_ms"))


def questions_table(p: Phase3) -> pd.DataFrame:
    """The ten questions with their answers, evidence and sources: a plain table, every cell escaped and shown in
    full by the page's table display (trace file and kernel names are data, never markup)."""
    return _pd(p.questions.select("id", "question_en", "question", "answerable", "answer", "evidence", "source"))


def actions_table(p: Phase3) -> pd.DataFrame:
    """The evidence → next A/B table (plain, escaped by the page's table display)."""
    return _pd(p.actions)


def headline(p: Phase3) -> dict[str, Any]:
    """A few key numbers for the manifest."""
    a = p.analysis
    out: dict[str, Any] = {"ranks": len(a.rops), "from_trace_dir": str(a.capture.trace_dir)}
    for k in ("prefill", "decode", "mixed", "all"):
        s = a.summary.filter(pl.col("kind") == k) if a.summary.height else a.summary
        if s.height:
            span = s["gpu_span_ms"].sum()
            out[f"{k}_exposed_comm_pct"] = round(100 * s["exposed_comm_ms"].sum() / span, 2) if span else None
            out[f"{k}_busy_pct"] = round(100 * s["busy_ms"].sum() / span, 2) if span else None
    if a.step_skew.height:
        out["step_end_skew_p50_us"] = round(float(a.step_skew["end_skew_us"].median()), 2)
    out["slow_rank"] = a.slow_rank.get("slow_rank")
    out["questions_answered"] = int(p.questions["answerable"].sum())
    out["actions_triggered"] = int((p.actions["status"] == "triggered").sum())
    return out


def live_capture(ctx: Any, capture: bool, trace_dir: str) -> tuple[str, pd.DataFrame]:
    """Capture on the target's engine when it can write traces (vLLM, SGLang) and no ``trace_dir`` was given.

    Returns the folder to analyse ("" = the recorded sample) and a table of what was captured, or why not.
    """
    from servelab.measure.live_capture import can_capture, capture_live
    if trace_dir:
        return trace_dir, pd.DataFrame([{"capture": "not run", "reason": f"analysing the given trace_dir {trace_dir}"}])
    if not capture:
        return "", pd.DataFrame([{"capture": "not run", "reason": "capture=False"}])
    if not can_capture(ctx.target):
        return "", pd.DataFrame([{"capture": "not run",
                                  "reason": f"the {ctx.target.engine} engine has no torch profiler endpoint; "
                                            f"use a vLLM or SGLang target (e.g. local-vllm) for a live capture"}])
    folder, res = capture_live(ctx)
    rows = [{"capture": res.meta.get("scenario", {}).get("name", "decode_control") if isinstance(res.meta.get("scenario"), dict)
             else "decode_control", "node": f.node, "file": f.name, "kind": f.kind, "bytes": f.size_bytes,
             "complete": res.wait.complete} for f in res.files]
    return str(folder), pd.DataFrame(rows)


def _short(text: str, limit: int = 400) -> str:
    """An answer cut for one line: per window kind only its first item when the kinds are ``|``-separated, then at
    most ``limit`` characters, cut at a ``;`` (or a space)."""
    text = " ".join(str(text).split())
    if len(text) > limit and " | " in text:
        text = " | ".join(part.split("; ")[0] for part in text.split(" | "))
    if len(text) <= limit:
        return text
    cut = text.rfind("; ", 0, limit)
    cut = cut if cut > limit // 2 else text.rfind(" ", 0, limit)
    return text[:cut].rstrip(";, ") + " …"


def findings(p: Phase3, from_samples: bool | None = None) -> list[str]:
    """What Phase 3 found, for the page's findings box: one line per timeline question with its answer (the
    questions table), then the evidence → next A/B rows that triggered."""
    a = p.analysis
    if from_samples is None:
        from_samples = Path(a.capture.trace_dir).resolve() == sample_dir().resolve()
    src = "from recorded sample data (2 × H200 traces)" if from_samples else f"from the capture in {a.capture.trace_dir}"
    out = [f"{len(a.rops)} rank(s) analysed {src}; {int(p.questions['answerable'].sum())} of {p.questions.height} "
           f"questions answerable."]
    for r in p.questions.iter_rows(named=True):
        why = "" if r["answerable"] else f" ({str(r['evidence']).split(' — ')[0]})"
        out.append(f"{r['id']} {r['question_en']} {_short(r['answer'])}{why}")
    act = p.actions.filter(pl.col("status") == "triggered") if p.actions.height else p.actions
    if act.height:
        out.append("Next A/B, triggered by the evidence: " + "; ".join(
            f"{r['metric']} {r['measured']} (threshold {r['threshold']}) → {r['next_ab']}"
            for r in act.iter_rows(named=True)) + ".")
    else:
        out.append("No evidence → next A/B rule triggered on this capture.")
    return out
