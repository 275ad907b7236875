"""Where two results of one run answer the same question, do they agree within their noise? (docs/metrics.md#crosscheck)

A run measures some things twice: the concurrency search and the quick matrix both measure decode at the same
shape and concurrency (``search_c4`` and ``D2_c4``), Phase 2 replays Phase 1 cases with the collectors on
(``hw-D2_c8`` and ``D2_c8``), Phase 9's baseline with speculation off is a decode run at some concurrency, and the
search and the matrix each say at which concurrency output TPS is highest. Two measurements answer the same
question when they ran the same engine launch, the same input and output lengths and the same concurrency, with
no injected request and no profiler attached.

The check is on output TPS. Its noise, from one run's own records: in a closed loop at concurrency C, output TPS
≈ C × output tokens / mean E2E, so its relative standard error is the CV of the per-request E2E over √n (n
completed requests); with repeats, the larger of that and the repeats' CV over √repeats. Two values agree when
their difference is within ``Z`` = 2 combined standard errors (about 95 %). Requests of one wave share their
batch, so this band is a lower bound of the real noise: a disagreement is worth a look, an agreement is not a
proof. An INVALID side is never compared: its number stays in the table, marked, and the pair says so.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from servelab.core.facts import MIN_SAMPLES, enough, indicative
from servelab.measure.case_record import read_summaries

Z = 2.0                      # combined standard errors within which two values agree (about 95 %)
SOURCE = {"phase1": "Phase 1 matrix", "phase2": "Phase 2 (collectors on)", "phase9": "Phase 9 baseline (speculation off)"}
AS_SERVED = "Phase 9 (attached server as served)"      # Phase 9's one config on an attached target


@dataclass
class Measurement:
    """One case's output TPS with what makes it comparable."""
    case_id: str
    phase: str
    source: str
    input_tokens: int
    output_tokens: int
    concurrency: int
    launch: str                  # the engine launch settings, as JSON ("target" where the case ran the target's own)
    output_tps: float | None
    rel_se: float | None         # relative standard error of output_tps
    n: int
    verdict: str
    reasons: list[str]

    @property
    def se(self) -> float | None:
        return None if self.output_tps is None or self.rel_se is None else self.output_tps * self.rel_se

    @property
    def question(self) -> str:
        return f"output TPS of {self.input_tokens}→{self.output_tokens} tokens at C={self.concurrency}"

    def shown(self) -> str:
        """``63.6 ± 2.1 tok/s (D2_c8, n=31)`` — or the case marked INVALID."""
        if self.output_tps is None:
            return f"{self.case_id}: no output TPS"
        se = self.se
        band = f" ± {se:.3g}" if se is not None and se > 0 else ""
        mark = "" if self.verdict == "VALID" else ", INVALID"
        return f"{_fmt(self.output_tps)}{band} tok/s ({self.case_id}, n={self.n}{mark})"


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else (f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}")


def _metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's metrics in its own definition (whatever the definitions are called)."""
    m = summary.get("metrics") or {}
    d = summary.get("definition")
    if d in m and isinstance(m[d], dict):
        return m[d]
    return next((v for v in m.values() if isinstance(v, dict)), {})


def rel_se(summary: dict[str, Any]) -> float | None:
    """Relative standard error of a case's output TPS (module docstring): CV(E2E) / √n, or the repeats' CV / √k
    where larger."""
    s = _metrics(summary)
    n = s.get("completed") or 0
    mean, std = s.get("mean_e2el_ms"), s.get("std_e2el_ms")
    out = None
    if n and mean and std is not None and mean > 0:
        out = (std / mean) / math.sqrt(n)
    cv = ((summary.get("details") or {}).get("cv") or {}).get("output_throughput") or {}
    reps = summary.get("repeats")
    k = len(reps) if isinstance(reps, (list, tuple)) else int(reps or 1)
    if cv.get("cv_pct") is not None and k >= 2:
        out = max(out or 0.0, cv["cv_pct"] / 100 / math.sqrt(k))
    return out


def _launch(run_dir: Path) -> str:
    m = _read_json(run_dir / "manifest.json")
    return json.dumps((m.get("launch") or {}).get("settings") or {}, sort_keys=True)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def _records_shape(case_dir: Path) -> tuple[int, int] | None:
    """(input, output) tokens every measured request of a case asked for, or None when they differ."""
    shapes = set()
    try:
        with open(case_dir / "requests.jsonl") as f:
            for line in f:
                r = json.loads(line)
                if r.get("role", "measure") == "measure":
                    shapes.add((r.get("expected_input_tokens"), r.get("requested_output_tokens")))
    except (OSError, ValueError):
        return None
    if len(shapes) != 1:
        return None
    i, o = next(iter(shapes))
    return (int(i), int(o)) if i is not None and o is not None else None


def measurements(run_dir: str | Path) -> list[Measurement]:
    """Every case of the run that is a plain closed-loop measurement at one shape and concurrency: Phase 1's
    matrix and search points (not M1), Phase 2's replays, Phase 9's baseline with speculation off."""
    run_dir = Path(run_dir)
    target_launch = _launch(run_dir)
    out = []
    for s in read_summaries(run_dir, errors=[]):
        cdir = Path(s["_path"]).parent
        meta = _read_json(cdir / "meta.json")
        if meta.get("profiler_attached") or (s.get("details") or {}).get("profiler_attached"):
            continue
        phase, kind = s.get("phase"), s.get("kind")
        case = (s.get("details") or {}).get("case") or meta.get("case") or {}
        if phase in ("phase1", "phase2") and kind in ("decode", "prefill", "search") and case:
            if case.get("inject_input_tokens") or case.get("scenario") == "M1":
                continue
            shape = (int(case["input_tokens"]), int(case["output_tokens"]))
            conc, launch = int(case["concurrency"]), target_launch
            source = "Phase 1 search" if kind == "search" else SOURCE[phase]
        elif phase == "phase9" and kind == "speculative" and (config := (s.get("details") or {}).get("config")
                                                               or {}).get("draft") is None and meta.get("concurrency"):
            got = _records_shape(cdir)
            if got is None:
                continue
            shape, conc = got, int(meta["concurrency"])
            launch = json.dumps(meta.get("launch") or {}, sort_keys=True)
            source = AS_SERVED if config.get("as_served") else SOURCE[phase]
        else:
            continue
        m = _metrics(s)
        tps = m.get("output_throughput")
        verdict = (s.get("verdict") or {}).get("status", "INVALID")
        out.append(Measurement(s["case_id"], phase, source, shape[0], shape[1], conc, launch,
                               None if tps is None else float(tps), rel_se(s), int(m.get("completed") or 0),
                               verdict, list((s.get("verdict") or {}).get("reasons") or [])))
    return out


def compare(a: Measurement, b: Measurement, z: float = Z) -> dict[str, Any]:
    """One pair: both values with their noise, Δ in % of ``a``, the band, and agree / disagree / not compared."""
    row = {"question": a.question, "a": a.shown(), "b": b.shown(), "a_case": a.case_id, "b_case": b.case_id,
           "delta_pct": None, "band_pct": None}
    bad = [x for x in (a, b) if x.verdict != "VALID" or x.output_tps is None]
    few = [x for x in (a, b) if not enough("throughput", x.n)]
    if few and not bad:          # the sample-size rule (core.facts): no standard error, no verdict below it
        row.update(verdict="not compared", why=", ".join(f"{x.case_id} {indicative(x.n)}" for x in few)
                   + f": fewer than {MIN_SAMPLES['throughput']} requests decide no agreement")
        return row
    if bad:
        row.update(verdict="not compared", why=", ".join(f"{x.case_id} is INVALID" if x.verdict != "VALID"
                                                          else f"{x.case_id} has no output TPS" for x in bad)
                   + ": its number is not a result")
        return row
    delta = b.output_tps - a.output_tps
    se = math.sqrt((a.se or 0.0) ** 2 + (b.se or 0.0) ** 2)
    row["delta_pct"] = 100 * delta / a.output_tps if a.output_tps else None
    row["band_pct"] = 100 * z * se / a.output_tps if a.output_tps else None
    if se == 0:
        row.update(verdict="not compared", why="no noise estimate (a side has fewer than two requests)")
    elif abs(delta) <= z * se:
        row.update(verdict="agree", why=f"within ±{z:g} combined standard errors")
    else:
        row.update(verdict="disagree", why=f"{abs(delta) / se:.1f} combined standard errors apart (> {z:g})")
    return row


PRIORITY = {"Phase 1 matrix": 0, "Phase 1 search": 1, "Phase 9 baseline (speculation off)": 2, AS_SERVED: 2,
            "Phase 2 (collectors on)": 3}


def same_question(run_dir: str | Path, ms: list[Measurement] | None = None) -> pd.DataFrame:
    """Every pair of measurements that answer the same question, each against the group's reference (the Phase 1
    matrix case where there is one): values with their noise, Δ, band and the verdict. A prefill case (one output
    token) is never paired: the output TPS of one token per request measures no decode and answers no question."""
    ms = measurements(run_dir) if ms is None else ms
    groups: dict[tuple, list[Measurement]] = {}
    for m in ms:
        if "@a" in m.case_id:                   # a later attempt of a case answers its own question again
            continue
        groups.setdefault((m.input_tokens, m.output_tokens, m.concurrency, m.launch), []).append(m)
    rows = []
    for g in groups.values():
        if len({m.source for m in g}) < 2 or g[0].output_tokens <= 1:      # a 1-token output's TPS asks nothing
            continue
        g = sorted(g, key=lambda m: (PRIORITY.get(m.source, 9), m.case_id))
        ref = g[0]
        for other in g[1:]:
            rows.append({**compare(ref, other), "a_source": ref.source, "b_source": other.source})
    return pd.DataFrame(rows, columns=["question", "a_source", "a", "b_source", "b", "delta_pct", "band_pct",
                                       "verdict", "why", "a_case", "b_case"])


def max_tps_question(run_dir: str | Path, ms: list[Measurement] | None = None) -> dict[str, Any] | None:
    """The search's max-TPS concurrency against the quick matrix's decode cases of the same shape: None when the
    run has no search or no such case; else the two answers, each with its value and noise, and the verdict —
    *agree* (same concurrency, or the two best values within their noise), *disagree* (a VALID point of one beats
    the other's answer beyond noise), *not compared* (one side has no VALID point)."""
    run_dir = Path(run_dir)
    search = _read_json(run_dir / "phase1" / "search.json")
    if not search:
        return None
    ms = measurements(run_dir) if ms is None else ms
    pts = [m for m in ms if m.source == "Phase 1 search" and "@a" not in m.case_id]
    if not pts:
        return None
    shape = (pts[0].input_tokens, pts[0].output_tokens)
    mat = [m for m in ms if m.source == "Phase 1 matrix" and (m.input_tokens, m.output_tokens) == shape
           and "@a" not in m.case_id]
    if not mat:
        return None
    def best(xs: list[Measurement]) -> Measurement | None:
        ok = [x for x in xs if x.verdict == "VALID" and x.output_tps is not None]
        return max(ok, key=lambda x: x.output_tps) if ok else None
    s_best, m_best = best(pts), best(mat)
    out: dict[str, Any] = {"question": f"at which concurrency is output TPS of {shape[0]}→{shape[1]} highest",
                           "search": s_best, "matrix": m_best, "stop": search.get("stop_reason"),
                           "stop_detail": search.get("stop_detail")}
    if s_best is None or m_best is None:
        side = "the search" if s_best is None else "the matrix"
        out.update(verdict="not compared", why=f"{side} has no VALID point of this shape")
        return out
    row = compare(s_best, m_best)
    if s_best.concurrency == m_best.concurrency:
        same = row["verdict"] != "disagree"
        out.update(verdict="agree" if same else "disagree",
                   why=f"both answer C={s_best.concurrency}" + ("" if same else
                       f", but their output TPS there disagree ({row['why']}): the concurrency is not settled"))
        return out
    if row["verdict"] == "agree":
        out.update(verdict="agree", why=f"C={s_best.concurrency} (search) and C={m_best.concurrency} (matrix) are "
                                        "within their noise of each other")
    else:
        lo, hi = sorted((s_best, m_best), key=lambda x: x.output_tps)
        out.update(verdict="disagree", why=(f"{hi.source} measured more output TPS at C={hi.concurrency} than "
                                            f"{lo.source}'s best at C={lo.concurrency}, beyond their noise"))
    return out


def findings(run_dir: str | Path, phases: tuple[str, ...] | None = None) -> list[str]:
    """The cross-checks in sentences (for a findings box or the run summary): each disagreement with both numbers,
    the agreements in one sentence. ``phases``: only pairs that involve one of these phases."""
    ms = measurements(run_dir)
    out = []
    q = max_tps_question(run_dir, ms)

    def involve(*ps: str | None) -> bool:
        return phases is None or any(p in phases for p in ps)
    if q is not None and involve("phase1"):
        s, m = q["search"], q["matrix"]
        if q["verdict"] == "disagree":
            out.append(f"Cross-check — max-TPS concurrency: the search answers C={s.concurrency} "
                       f"({s.shown()}, stopped {q['stop']}), the quick matrix C={m.concurrency} ({m.shown()}): they "
                       f"disagree ({q['why']}); neither is the answer until a re-run agrees.")
        elif q["verdict"] == "agree":
            out.append(f"Cross-check — max-TPS concurrency: the search and the quick matrix agree ({q['why']}: "
                       f"{s.shown()} vs {m.shown()}).")
        else:
            out.append(f"Cross-check — max-TPS concurrency: not compared ({q['why']}).")
    pairs = same_question(run_dir, ms)
    by_phase = {m.case_id: m.phase for m in ms}
    agree = []
    for r in pairs.itertuples():
        if not involve(by_phase.get(r.a_case), by_phase.get(r.b_case)):
            continue
        if r.verdict == "disagree":
            out.append(f"Cross-check — {r.question}: {r.a_source} {r.a} vs {r.b_source} {r.b}: they disagree "
                       f"({r.delta_pct:+.0f} %, {r.why}).")
        elif r.verdict == "agree":
            agree.append(f"{r.a_case} vs {r.b_case} ({r.delta_pct:+.0f} %, band ±{r.band_pct:.0f} %)")
        else:
            out.append(f"Cross-check — {r.question}: {r.a_case} vs {r.b_case} not compared ({r.why}).")
    if agree:
        out.append("Cross-check — these measurements of the same question agree within their noise: "
                   + "; ".join(agree) + ".")
    paired = set(pairs["a_case"]) | set(pairs["b_case"])
    alone = [m for m in ms if m.phase == "phase9" and m.case_id not in paired and involve("phase9")]
    if alone:
        what, has = (("points of the attached server as served", "have") if alone[0].source == AS_SERVED
                     else ("baseline", "has"))
        out.append(f"Not cross-checked: Phase 9's {what} (" + "; ".join(f"{m.case_id}: {m.question}" for m in alone)
                   + f") {has} no measurement of the same shape, concurrency and launch elsewhere in this run.")
    return out


def table(run_dir: str | Path) -> pd.DataFrame:
    """The cross-checks as one table (the max-TPS question first), for a page."""
    ms = measurements(run_dir)
    rows = []
    q = max_tps_question(run_dir, ms)
    if q is not None:
        rows.append({"question": q["question"], "a_source": "Phase 1 search",
                     "a": q["search"].shown() if q["search"] else "no VALID point",
                     "b_source": "Phase 1 matrix", "b": q["matrix"].shown() if q["matrix"] else "no VALID point",
                     "delta_pct": None, "band_pct": None, "verdict": q["verdict"], "why": q["why"]})
    pairs = same_question(run_dir, ms).drop(columns=["a_case", "b_case"])
    out = pd.DataFrame(rows + pairs.to_dict("records"))
    if out.empty:
        return pd.DataFrame({"cross-check": ["no two measurements of this run answer the same question"]})
    return out.rename(columns={"a_source": "measured by", "a": "value", "b_source": "and by", "b": "value ",
                               "delta_pct": "difference (%)", "band_pct": "noise band (± %)"})
