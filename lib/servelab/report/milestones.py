"""The seeds' milestones M1–M4 (§15) as a checklist computed from what a run holds.

Each milestone is met only when every check passes; a check that has no data says so ("not measured"),
and cases that were planned but not executed are listed, never silently missing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.run import read_manifest

M1_CV_BOUND_PCT = 3.0          # seeds §15: key TPS coefficient of variation "尽量不超过 3%"
M1_REPEATS = 3


@dataclass
class Check:
    check: str
    status: str          # pass | fail | not measured
    detail: str


@dataclass
class Milestone:
    id: str
    title: str
    checks: list[Check] = field(default_factory=list)

    @property
    def status(self) -> str:
        states = {c.status for c in self.checks}
        if states == {"pass"}:
            return "met"
        if states == {"not measured"}:
            return "not started"
        return "not met"


def _read_summary(run_dir: Path) -> pd.DataFrame | None:
    p = run_dir / "summary.csv"
    if not p.exists():
        return None
    try:
        return pd.read_csv(p)
    except (pd.errors.EmptyDataError, pd.errors.ParserError):
        return None


def _tps_column(df: pd.DataFrame) -> str | None:
    for c in ("output_throughput", "output_tps", "output_tok_s", "total_token_throughput", "total_throughput"):
        if c in df.columns:
            return c
    return None


def m1(run_dir: Path) -> Milestone:
    """M1 trusted baseline: every quick-matrix point has 3 repeats, key TPS CV ≤ 3 %, all traceable."""
    ms = Milestone("M1", "trusted baseline (可信 Baseline)")
    df = _read_summary(run_dir)
    if df is None or "case_id" not in df.columns:
        ms.checks.append(Check("3 repeats per matrix point", "not measured", "no summary.csv with case_id"))
        ms.checks.append(Check(f"key TPS CV ≤ {M1_CV_BOUND_PCT}%", "not measured", "no summary.csv"))
    else:
        rep_col = "repeat" if "repeat" in df.columns else None
        counts = df.groupby("case_id")[rep_col].nunique() if rep_col else df.groupby("case_id").size()
        short = counts[counts < M1_REPEATS]
        ms.checks.append(Check("3 repeats per matrix point", "pass" if short.empty else "fail",
                               "all points have 3" if short.empty else
                               "fewer than 3: " + ", ".join(f"{c} ({n})" for c, n in short.items())))
        col = _tps_column(df)
        if col is None:
            ms.checks.append(Check(f"key TPS CV ≤ {M1_CV_BOUND_PCT}%", "not measured", "no throughput column"))
        else:
            g = df.groupby("case_id")[col]
            cv = (g.std(ddof=1) / g.mean() * 100).dropna()
            bad = cv[cv > M1_CV_BOUND_PCT]
            ms.checks.append(Check(f"key TPS CV ≤ {M1_CV_BOUND_PCT}% ({col})",
                                   "not measured" if cv.empty else ("pass" if bad.empty else "fail"),
                                   "no case with ≥2 repeats" if cv.empty else
                                   ("max CV %.2f%%" % cv.max() if bad.empty else
                                    "over bound: " + ", ".join(f"{c} {v:.1f}%" for c, v in bad.items()))))
    m = read_manifest(run_dir)
    p0 = m.get("phases", {}).get("phase0", {}).get("status")
    cmds = (run_dir / "commands.jsonl").exists()
    ms.checks.append(Check("environment, commands and logs traceable",
                           "pass" if p0 == "success" and cmds else ("not measured" if p0 is None else "fail"),
                           f"phase0 {p0 or 'not run'}; commands.jsonl {'present' if cmds else 'missing'}"))
    not_exec = [c for e in m.get("phases", {}).values() for c in e.get("not_executed", [])]
    if not_exec:
        ms.checks.append(Check("every planned case executed", "fail", "not executed: " + ", ".join(map(str, not_exec))))
    return ms


def m2(run_dir: Path) -> Milestone:
    """M2 bottleneck report: prefill, decode and mixed profiles; top 1–3 bottlenecks with evidence."""
    ms = Milestone("M2", "bottleneck report (瓶颈报告)")
    p3 = run_dir / "phase3"
    kinds = set()
    for f in p3.glob("*.json"):
        try:
            obj = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            for k in ("window_classes", "scenarios"):
                kinds |= set(obj.get(k, []) or [])
    for k in ("prefill", "decode", "mixed"):
        ms.checks.append(Check(f"{k} profile analysed", "pass" if k in kinds else "not measured",
                               "phase3 has it" if k in kinds else "no such window in the phase 3 outputs"))
    from servelab.report.ledger import read_evidence
    ev = [e for e in read_evidence(run_dir) if e.verdict == "supported"]
    ms.checks.append(Check("1–3 bottlenecks with trace/counter/log evidence", "pass" if ev else "not measured",
                           "; ".join(f"{e.hypothesis}: {e.summary}" for e in ev[:3]) or "no supported hypothesis yet"))
    return ms


def m3(run_dir: Path) -> Milestone:
    """M3 topology A/B: TP16 baseline kept; TP8+PP2 feasibility and performance; attention-DP+EP memory."""
    ms = Milestone("M3", "parallel topology A/B (并行拓扑 A/B)")
    p4 = run_dir / "phase4"
    feas = list(p4.glob("*feasib*.csv"))
    ms.checks.append(Check("layouts' memory feasibility assessed", "pass" if feas else "not measured",
                           feas[0].name if feas else "phase 4 not run"))
    measured = list(p4.glob("*measured*.csv"))
    ms.checks.append(Check("TP16 vs TP8+PP2 measured end to end", "pass" if measured else "not measured",
                           measured[0].name if measured else "no measured comparison"))
    return ms


def m4(run_dir: Path) -> Milestone:
    """M4 first optimisation loop: one change passes the full benchmark, no profiler, SLO throughput up."""
    ms = Milestone("M4", "first optimisation loop (首轮优化闭环)")
    ab = list(run_dir.glob("**/ab_*.json"))
    ms.checks.append(Check("an A/B with one variable passed the full benchmark", "pass" if ab else "not measured",
                           ab[0].name if ab else "no A/B recorded"))
    return ms


def milestones(run_dir: Path) -> list[Milestone]:
    return [m1(run_dir), m2(run_dir), m3(run_dir), m4(run_dir)]


def milestones_frame(run_dir: Path) -> pd.DataFrame:
    rows = []
    for m in milestones(run_dir):
        for c in m.checks:
            rows.append({"milestone": m.id, "title": m.title, "milestone_status": m.status, "check": c.check,
                         "status": c.status, "detail": c.detail})
    return pd.DataFrame(rows)
