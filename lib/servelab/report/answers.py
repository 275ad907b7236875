"""The run's answers, recorded once as facts (:mod:`servelab.core.facts`) by the phase that computes them.

- **One answer per question** where two measurements answer it: the maximum output TPS and the concurrency it was
  reached at (the quick matrix's decode cases and the concurrency search), and the maximum concurrency under the SLO
  (the search's answer against every VALID matrix case of the search's shape that meets the same SLO). Where they
  agree the fact names its source; where they do not, its value is ``unsettled: A vs B`` with both.
- **Correctness of each A/B** (``<phase>/ab_correctness.csv``, greedy outputs of B against A): one fact per B,
  which the milestones read (M4 cannot pass beside a regression).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.facts import Fact, make, write_facts
from servelab.measure import request_metrics as mx
from servelab.measure.case_record import read_summaries
from servelab.measure.correctness import correctness_verdict
from servelab.report import crosscheck

MAX_TPS, MAX_TPS_C, MAX_UNDER_SLO_C = "max_output_tps", "max_tps_concurrency", "max_under_slo_concurrency"


def _read_json(p: Path) -> dict[str, Any]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _tps_facts(m: crosscheck.Measurement, note: str = "") -> list[Fact]:
    src = f"{m.source} {m.case_id}"
    return [make(MAX_TPS, round(float(m.output_tps), 2), unit="tok/s", source=src, samples=m.n, kind="throughput",
                 phase="phase1", note=note),
            make(MAX_TPS_C, int(m.concurrency), source=src, samples=m.n, kind="throughput", phase="phase1",
                 note=note)]


def max_tps_facts(run_dir: Path, ms: list[crosscheck.Measurement] | None = None) -> list[Fact]:
    """The maximum output TPS and its concurrency: one answer with its source, or ``unsettled: A vs B``."""
    ms = crosscheck.measurements(run_dir) if ms is None else ms
    q = crosscheck.max_tps_question(run_dir, ms)
    if q is None or q["verdict"] == "not compared":
        got = q["search"] or q["matrix"] if q is not None else None
        if got is None:
            mat = [m for m in ms if m.source == "Phase 1 matrix" and m.case_id.startswith("D2") and "@a" not in
                   m.case_id and m.verdict == "VALID" and m.output_tps is not None]
            got = max(mat, key=lambda m: m.output_tps) if mat else None
        return _tps_facts(got) if got is not None else []
    s, m = q["search"], q["matrix"]
    if q["verdict"] == "agree":
        best = m if (m.n, m.output_tps) >= (s.n, s.output_tps) else s
        return _tps_facts(best, note=f"the other measurement agrees: {q['why']}")
    text = f"unsettled: search {s.shown()} at C={s.concurrency} vs matrix {m.shown()} at C={m.concurrency}"
    return [make(MAX_TPS, text, unit="tok/s", source="Phase 1 search vs matrix", phase="phase1", kind="verdict",
                 note=q["why"]),
            make(MAX_TPS_C, text, source="Phase 1 search vs matrix", phase="phase1", kind="verdict", note=q["why"])]


def _meets(summary: dict[str, Any], slo: dict[str, Any], p: int) -> bool:
    metrics = (summary.get("metrics") or {}).get(summary.get("definition")) or {}
    for key, metric in (("ttft_ms", "ttft"), ("tpot_ms", "tpot"), ("e2el_ms", "e2el")):
        lim = slo.get(key)
        if lim is None:
            continue
        v = mx.shown_percentile(metrics, metric, p)[1]
        if v is None or v > lim:
            return False
    return True


def max_under_slo_fact(run_dir: Path, ms: list[crosscheck.Measurement] | None = None) -> list[Fact]:
    """The search's maximum concurrency under the SLO, or ``unsettled`` where a VALID matrix case of the search's
    shape meets the same SLO at a higher concurrency."""
    search = _read_json(Path(run_dir) / "phase1" / "search.json")
    slo = {k: v for k, v in (search.get("slo") or {}).items() if v is not None and k.endswith("_ms")}
    if not search or not slo:
        return []
    ms = crosscheck.measurements(run_dir) if ms is None else ms
    pts = [m for m in ms if m.source == "Phase 1 search" and "@a" not in m.case_id]
    if not pts:
        return []
    shape = (pts[0].input_tokens, pts[0].output_tokens)
    ids = {m.case_id for m in ms if m.source == "Phase 1 matrix" and (m.input_tokens, m.output_tokens) == shape
           and m.verdict == "VALID" and "@a" not in m.case_id}
    pct = int(search.get("slo_percentile") or 95)
    conc = {m.case_id: m.concurrency for m in ms}
    met = sorted((conc[s["case_id"]], s["case_id"]) for s in read_summaries(run_dir, errors=[])
                 if s.get("case_id") in ids and _meets(s, slo, pct))
    answer = search.get("max_under_slo_concurrency")
    n = next((m.n for m in pts if m.concurrency == answer), None)
    if met and (answer is None or met[-1][0] > answer):
        c, cid = met[-1]
        text = (f"unsettled: the search answers {answer if answer is not None else 'none'}, but the matrix's {cid} "
                f"meets the same SLO at C={c}")
        return [make(MAX_UNDER_SLO_C, text, source="Phase 1 search vs matrix", phase="phase1", kind="verdict")]
    return [make(MAX_UNDER_SLO_C, answer if answer is not None else "none", source="Phase 1 search",
                 samples=n, kind="throughput" if answer is not None else "verdict", phase="phase1",
                 note=", ".join(f"P{pct} {k.split('_')[0].upper()} ≤ {v:g} ms" for k, v in slo.items()))]


def record_phase1(run_dir: Path) -> list[Fact]:
    """Phase 1's answers (max output TPS and its concurrency, max concurrency under the SLO) written as facts."""
    ms = crosscheck.measurements(run_dir)
    return write_facts(run_dir, "phase1", max_tps_facts(run_dir, ms) + max_under_slo_fact(run_dir, ms))


def correctness_facts(run_dir: Path, phase: str) -> list[Fact]:
    """One fact per B of the phase's A/B: the greedy outputs' verdict against A (``correctness:<phase>/<b>``)."""
    p = Path(run_dir) / phase / "ab_correctness.csv"
    try:
        rows = pd.read_csv(p)
    except (OSError, ValueError, pd.errors.EmptyDataError):
        return []
    if rows.empty or "b_run" not in rows.columns:
        return []
    out = []
    for b, g in rows.groupby(rows["b_run"].astype(str), sort=False):
        verdict, detail = correctness_verdict(g)
        out.append(make(f"correctness:{phase}/{b}", verdict, source=f"{phase}/ab_correctness.csv", samples=len(g),
                        kind="verdict", phase=phase, note=detail))
    return out


def record_correctness(run_dir: Path, phase: str, extra: list[Fact] | None = None) -> list[Fact]:
    """Write the phase's A/B correctness facts (with ``extra`` facts of the same phase)."""
    return write_facts(run_dir, phase, correctness_facts(run_dir, phase) + list(extra or []))
