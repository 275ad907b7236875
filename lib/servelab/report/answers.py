"""The run's answers, recorded once as facts (:mod:`servelab.core.facts`) by the phase that computes them.

- **One answer per question** where two measurements answer it: the maximum output TPS and the concurrency it was
  reached at (the quick matrix's decode cases and the concurrency search), and the maximum concurrency under the SLO
  (the search's answer against every VALID matrix case of the search's shape that meets the same SLO). Where they
  agree the fact names its source; where they do not, its value is ``unsettled: A vs B`` with both.
- **Correctness of each A/B** (``<phase>/ab_correctness.csv``, greedy outputs of B against A): one fact per B,
  which the milestones read (M4 cannot pass beside a regression).
- **Every headline number** a phase closes with (:func:`record_headline`, called by ``finish_phase``): a value the
  phase gave as a :class:`~servelab.core.facts.Fact` (with its source, sample count and kind) is recorded as it is;
  a key the phase already recorded in this attempt (Phase 1's answers) is that fact; any other value becomes the
  fact ``<phase>/<key>`` with the unit its key names. The manifest keeps which fact each headline key is, and the
  findings box and the run index show the fact (:func:`stated_headline`); ``servelab check`` reports a headline
  number with no fact behind it.
"""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.facts import Fact, make, read_facts, write_facts
from servelab.measure import request_metrics as mx
from servelab.measure.case_record import read_summaries
from servelab.measure.correctness import correctness_verdict
from servelab.report import crosscheck
from servelab.report.findings import split_unit

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


def _plain(v: Any) -> Any:
    """A headline value as JSON holds it (numpy scalars as Python numbers)."""
    return v.item() if hasattr(v, "item") and not isinstance(v, (str, bytes)) else v


def _not_before(when: str, since: str) -> bool:
    try:
        return not since or dt.datetime.fromisoformat(when) >= dt.datetime.fromisoformat(since)
    except (TypeError, ValueError):
        return False


def record_headline(run_dir: Path, phase: str, headline: dict[str, Any], since: str = "",
                    origin: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """Record every number of ``phase``'s headline as a fact, with the facts the phase wrote in this attempt (at or
    after ``since``); facts of an earlier attempt of the phase are replaced. Returns the headline as pages show it
    (each key's fact stated) and each key's fact name. ``origin`` says where the phase's numbers come from (the source
    of a plain value's fact)."""
    mine = [f for f in read_facts(run_dir) if f.phase == phase and _not_before(f.recorded, since)]
    by_name = {f.name: f for f in mine}
    new: list[Fact] = []
    shown: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key, value in headline.items():
        if isinstance(value, Fact):
            f = value
        elif key in by_name:
            f = by_name[key]
        else:
            f = make(f"{phase}/{key}", _plain(value), unit=split_unit(str(key))[1], source=origin or phase,
                     phase=phase)
        if f.name not in by_name or isinstance(value, Fact):
            new.append(f)
            by_name[f.name] = f
        shown[key], names[key] = f.stated(), f.name
    keep = [f for f in mine if f.name not in {x.name for x in new}]
    write_facts(run_dir, phase, keep + new)
    return shown, names


def stated_headline(run_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """A phase's headline read from its facts (the manifest entry names each key's fact); a key without one keeps
    the manifest's value (a run of an older servelab, which the check reports)."""
    names = entry.get("headline_facts") or {}
    got = {f.name: f for f in read_facts(run_dir)} if names else {}
    return {k: got[names[k]].stated() if names.get(k) in got else v for k, v in (entry.get("headline") or {}).items()}
