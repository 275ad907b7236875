"""The milestones M1–M4 (``docs/method.md#milestones``) as a checklist computed from what a run holds.

Each milestone is met only when every check passes; a check that has no data says so ("not measured"),
and cases that were planned but not executed are listed, never silently missing. Measured cases are read
only from their case summaries (``cases/*/summary.json``, :mod:`servelab.measure.case_record`); A/B results from
the ``ab_comparison.csv`` / ``ab_differences.csv`` / ``ab_correctness.csv`` / ``ab_questions.csv`` a phase writes;
Phase 3 windows from ``trace_windows.csv`` and its stage view from ``trace_stages.csv``; Phase 4's layouts from its
``feasibility.csv``, ``measured.csv`` and ``verdicts.csv``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.core.run import read_manifest
from servelab.deploy.targets import load_target
from servelab.measure.matrix import quick_matrix
from servelab.measure.case_record import read_summaries
from servelab.report.ledger import current_evidence
from servelab.measure.matrix import SCALES
from servelab.measure.abtest import load_run
from servelab.measure.case_record import summary_paths
from servelab.measure.correctness import correctness_verdict
from servelab.core.facts import read_facts

M1_CV_BOUND_PCT = 3.0          # docs/method.md#milestones: key TPS coefficient of variation within 3 %
M1_REPEATS = 3


@dataclass
class Check:
    check: str
    status: str          # pass | fail | not measured
    detail: str
    tables: list[str] = field(default_factory=list)    # what it was read from, relative to the run folder


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


MATRIX_KINDS = ("prefill", "decode", "mixed")
# the throughput a point is about: prompt tokens for prefill points, generated tokens otherwise
KEY_TPS = {"prefill": "input_throughput", "decode": "output_throughput", "mixed": "output_throughput"}


def _phase1_points(run_dir: Path, errors: list[str]) -> dict[str, dict[str, Any]]:
    """Phase 1 matrix points from the case summaries, by the case they repeat: kind, key TPS per repeat, verdicts."""
    points: dict[str, dict[str, Any]] = {}
    for s in read_summaries(run_dir, "phase1", errors):
        if s["kind"] not in MATRIX_KINDS:
            continue
        p = points.setdefault(s["repeat_of"], {"kind": s["kind"], "key": KEY_TPS[s["kind"]], "values": [],
                                               "invalid": []})
        for r in s["repeats"]:
            p["values"].append((r["metrics"].get(s["definition"]) or {}).get(p["key"]))
        if s["verdict"]["status"] != "VALID":
            p["invalid"].append(f"{s['case_id']}: {'; '.join(s['verdict']['reasons'][:2])}")
    return points


def _planned_points(run_dir: Path) -> list[str] | None:
    """The quick matrix of the run's target (None when the target cannot be loaded here)."""
    try:
        return [c.case_id for c in quick_matrix(load_target(str(read_manifest(run_dir).get("target", ""))))]
    except Exception:
        return None


def cv_pct(values: list[float]) -> float | None:
    """Sample CV (ddof 1) in % of repeat values; None with fewer than two or a zero mean."""
    v = [float(x) for x in values if x is not None and not math.isnan(float(x))]
    if len(v) < 2:
        return None
    mean = sum(v) / len(v)
    if not mean:
        return None
    var = sum((x - mean) ** 2 for x in v) / (len(v) - 1)
    return 100.0 * math.sqrt(var) / mean


def m1(run_dir: Path) -> Milestone:
    """M1 trusted baseline: every quick-matrix point measured with 3 repeats, key TPS CV across the repeats ≤ 3 %,
    every point VALID, all traceable. Read from Phase 1's case summaries (``cases/*/summary.json``)."""
    ms = Milestone("M1", "trusted baseline (可信 Baseline)")
    errors: list[str] = []
    points = _phase1_points(run_dir, errors)
    cv_check = f"key TPS CV across repeats ≤ {M1_CV_BOUND_PCT}%"
    if errors:
        ms.checks.append(Check("case summaries follow the case schema", "fail", "; ".join(errors[:3])))
    if not points:
        ms.checks.append(Check(f"{M1_REPEATS} repeats per matrix point", "not measured",
                               "no Phase 1 case summaries (cases/*/summary.json)"))
        ms.checks.append(Check(cv_check, "not measured", "no Phase 1 case summaries"))
    else:
        n = {cid: sum(v is not None for v in p["values"]) for cid, p in points.items()}
        short = {c: k for c, k in n.items() if k < M1_REPEATS}
        ms.checks.append(Check(f"{M1_REPEATS} repeats per matrix point", "pass" if not short else "fail",
                               f"all {len(n)} points have ≥ {M1_REPEATS}" if not short else
                               f"fewer than {M1_REPEATS}: " + ", ".join(f"{c} ({k})" for c, k in short.items())))
        cvs = {cid: cv_pct(p["values"]) for cid, p in points.items()}
        measured = {c: v for c, v in cvs.items() if v is not None}
        over = {c: v for c, v in measured.items() if v > M1_CV_BOUND_PCT}
        detail = "; ".join(f"{c} {v:.2f}% ({points[c]['key']}, n={n[c]})" for c, v in measured.items())
        ms.checks.append(Check(cv_check, "not measured" if not measured else ("fail" if over else "pass"),
                               "no point with ≥ 2 repeats" if not measured else
                               (f"over {M1_CV_BOUND_PCT}%: " if over else "") + detail))
        invalid = [x for p in points.values() for x in p["invalid"]]
        ms.checks.append(Check("every matrix point VALID", "fail" if invalid else "pass",
                               "; ".join(invalid[:6]) + (" …" if len(invalid) > 6 else "") if invalid
                               else f"{len(points)} points VALID"))
        planned = _planned_points(run_dir)
        if planned is not None:
            missing = [c for c in planned if c not in points]
            ms.checks.append(Check("every quick-matrix point measured", "not measured" if missing else "pass",
                                   "not measured: " + ", ".join(missing) if missing else f"{len(planned)} points"))
    m = read_manifest(run_dir)
    p0 = m.get("phases", {}).get("phase0", {}).get("status")
    cmds = (run_dir / "commands.jsonl").exists()
    ms.checks.append(Check("environment, commands and logs traceable",
                           "pass" if p0 == "success" and cmds else ("not measured" if p0 is None else "fail"),
                           f"phase0 {p0 or 'not run'}; commands.jsonl {'present' if cmds else 'missing'}"))
    not_exec = [c for e in m.get("phases", {}).values() for c in e.get("not_executed", [])]
    if not_exec:
        ms.checks.append(Check("every planned case executed", "fail", "not executed: " + ", ".join(map(str, not_exec))))
    matrix = [t for t in ("phase1/matrix.csv", "summary.csv") if (run_dir / t).is_file()]
    for c in ms.checks:
        if c.check == "environment, commands and logs traceable":
            c.tables = [t for t in ("phase0/report.html", "commands.jsonl") if (run_dir / t).is_file()]
        elif c.status != "not measured" and c.check != "every planned case executed":
            c.tables = matrix
    return ms


def m2(run_dir: Path) -> Milestone:
    """M2 bottleneck report: prefill, decode and mixed windows analysed in a capture of this target (Phase 3's
    ``trace_windows.csv``); top 1–3 bottlenecks with evidence (the ledger)."""
    ms = Milestone("M2", "bottleneck report (瓶颈报告)")
    p = run_dir / "phase3" / "trace_windows.csv"
    kinds: dict[str, int] = {}
    if p.is_file():
        try:
            w = pd.read_csv(p)
            if "kind" in w.columns:
                key = ["rank", "window"] if {"rank", "window"} <= set(w.columns) else None
                kinds = (w.drop_duplicates(key) if key else w)["kind"].value_counts().to_dict()
        except (pd.errors.EmptyDataError, pd.errors.ParserError):
            pass
    sample = bool(read_manifest(run_dir).get("phases", {}).get("phase3", {}).get("from_samples"))
    for k in ("prefill", "decode", "mixed"):
        if not kinds.get(k):
            status, detail = "not measured", ("phase 3 not run" if not p.is_file()
                                              else "no such window in phase3/trace_windows.csv")
        elif sample:
            status, detail = "not measured", (f"{kinds[k]} {k} windows, but only in the recorded sample Phase 3 "
                                              "read — not a capture of this target")
        else:
            status, detail = "pass", f"{kinds[k]} {k} windows in phase3/trace_windows.csv"
        ms.checks.append(Check(f"{k} profile analysed", status, detail,
                               ["phase3/trace_windows.csv"] if p.is_file() else []))
    # evidence from recorded sample data is never a bottleneck of this target (it is recorded inconclusive anyway)
    ev = [e for e in current_evidence(run_dir) if e.verdict == "supported" and not e.from_samples]
    ms.checks.append(Check("1–3 bottlenecks with trace/counter/log evidence", "pass" if ev else "not measured",
                           "; ".join(f"{e.hypothesis} ({e.phase}): {e.summary}" for e in ev[:3])
                           or "no supported hypothesis yet", list(dict.fromkeys(t for e in ev[:3] for t in e.tables))))
    return ms


# ---------------------------------------------------------------- M3: the topology sequence

def _csv(path: Path) -> pd.DataFrame | None:
    """A phase's table, or None when it is absent or unreadable."""
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, OSError):
        return None


def _decode_concurrencies(run_dir: Path) -> tuple[int, ...]:
    """The D2 concurrencies of the run's scale (cluster: 16, 32, 64 — the method's C=16/32/64; local: 4, 8, 16)."""
    scale = "cluster"
    try:
        scale = getattr(load_target(str(read_manifest(run_dir).get("target", ""))), "scale", "cluster")
    except Exception:
        pass
    return tuple(SCALES.get(scale, SCALES["cluster"])["D2_c"])


def _record_nodes(runs: list[str], run_dir: Path) -> int | None:
    """How many nodes the measured layouts' engines ran on (the most of any), from their manifests' launch plans:
    Phase 4's own layout records (``phase4/layouts/*``) or the runs it was given."""
    records = _records(run_dir, "phase4")
    counts = []
    for r in runs:
        try:
            m = load_run(records.get(r) or r).manifest
        except (FileNotFoundError, OSError, ValueError):
            continue
        plans = (m.get("launch") or {}).get("plans") or []
        counts.append(len({p.get("node") for p in plans}) or len(m.get("hosts") or {}) or 1)
    return max(counts) if counts else None


RAIL_METRICS = ("rdma_tx_gbps", "rdma_vport_tx_gbps")     # what crosses nodes: the RDMA rails' transmit rate


def _rail_traffic(run_dir: Path, run_id: str) -> tuple[float, str] | None:
    """The measured rail traffic of one layout's run: Phase 2's mean RDMA transmit rate per node (Gbit/s, head and
    workers averaged) over its decode cases (all its cases when it has none), from that run's
    ``phase2/telemetry_summary.csv``; None when the run has none."""
    try:
        rd = _records(run_dir, "phase4").get(run_id) or load_run(run_id).run_dir
    except (FileNotFoundError, OSError, ValueError):
        return None
    t = _csv(Path(rd) / "phase2" / "telemetry_summary.csv")
    if t is None or not {"case", "metric"} <= set(t.columns):
        return None
    for metric in RAIL_METRICS:
        r = t[t["metric"] == metric]
        vals = r[[c for c in ("head_mean", "worker_mean") if c in r.columns]].apply(pd.to_numeric, errors="coerce")
        r = r.assign(v=vals.mean(axis=1)).dropna(subset=["v"])
        dec = r[r["case"].astype(str).str.contains("D2")]
        r = dec if not dec.empty else r
        if not r.empty:
            return float(r["v"].mean()), f"{metric} over {', '.join(r['case'].astype(str))}"
    return None


def m3(run_dir: Path) -> Milestone:
    """M3 parallel topology A/B, the method's test order for a pipeline layout answered from what Phase 4 measured
    (``phase4/feasibility.csv``, ``measured.csv``, ``verdicts.csv``) and Phase 3's per-stage view
    (``phase3/trace_stages.csv``): the memory model, the baseline kept, a load-and-serve smoke test per layout, C=1
    decode latency, throughput at the scale's decode concurrencies (C=16/32/64 on the cluster), whether cross-node
    traffic drops, and whether the pipeline's stages are balanced."""
    ms = Milestone("M3", "parallel topology A/B (并行拓扑 A/B)")
    p4 = run_dir / "phase4"
    feas = _csv(p4 / "feasibility.csv")
    ms.checks.append(Check("layouts' memory feasibility assessed", "pass" if feas is not None else "not measured",
                           (f"{len(feas)} layouts: " + ", ".join(f"{r.layout} {r.verdict}" for r in feas.itertuples())
                            if feas is not None and {"layout", "verdict"} <= set(feas.columns) else
                            "feasibility.csv" if feas is not None else "phase 4 not run"),
                           ["phase4/feasibility.csv"] if feas is not None else []))
    meas, verd = _csv(p4 / "measured.csv"), _csv(p4 / "verdicts.csv")
    read = [f"phase4/{n}" for n in ("measured.csv", "verdicts.csv") if (p4 / n).is_file()]
    none = "no layout measured end to end (Phase 4 with measure_layouts or runs)"
    if meas is None or verd is None or meas.empty or not {"layout", "case_id"} <= set(meas.columns):
        for c in ("baseline layout kept and measured", "smoke test: each layout loads and serves",
                  "C=1 decode latency per layout", "decode throughput at C=" + "/".join(map(str, _decode_concurrencies(
                      run_dir))) + " per layout", "cross-node traffic per layout", "pipeline stages balanced"):
            ms.checks.append(Check(c, "not measured", none, read))
        return ms
    layouts = list(dict.fromkeys(meas["layout"].astype(str)))
    base = verd[verd["verdict"] == "baseline"] if "verdict" in verd.columns else verd.iloc[0:0]
    if base.empty:
        ms.checks.append(Check("baseline layout kept and measured", "fail", "verdicts.csv names no baseline", read))
    else:
        b = str(base.iloc[0]["layout"])
        note = "" if b == "TP16" else " (the reference cluster's baseline is TP16; this run's first layout is the reference)"
        others = "; ".join(f"{r.layout}: {r.verdict}" for r in verd[verd["verdict"] != "baseline"].itertuples())
        ms.checks.append(Check("baseline layout kept and measured", "pass",
                               f"baseline {b}{note}; {others or 'no other layout'}", read))
    ok_col = "all_valid" if "all_valid" in meas.columns else None

    def served(g: pd.DataFrame) -> bool:
        tps = pd.to_numeric(g.get("output_tps"), errors="coerce") if "output_tps" in g.columns else pd.Series([])
        valid = g[ok_col].astype(str).str.lower().eq("true") if ok_col else pd.Series(True, index=g.index)
        return bool(((tps > 0) & valid).any())
    smoke = {lay: served(meas[meas["layout"] == lay]) for lay in layouts}
    failed = [k for k, v in smoke.items() if not v]
    ms.checks.append(Check("smoke test: each layout loads and serves", "fail" if failed else "pass",
                           ("no VALID case served on: " + ", ".join(failed)) if failed else
                           f"{len(layouts)} layouts served VALID cases: " + ", ".join(layouts), read))

    def per_layout(case: str, col: str, unit: str, fmt: str) -> tuple[list[str], list[str]]:
        have, missing = [], []
        for lay in layouts:
            r = meas[(meas["layout"] == lay) & (meas["case_id"] == case)]
            v = pd.to_numeric(r[col], errors="coerce").dropna() if col in r.columns else pd.Series([], dtype=float)
            (have.append(f"{lay} {v.iloc[0]:{fmt}} {unit}") if len(v) else missing.append(lay))
        return have, missing
    have, missing = per_layout("D1", "p95_tpot_ms", "ms", ".2f")
    ms.checks.append(Check("C=1 decode latency per layout", "not measured" if missing else "pass",
                           (f"D1 not measured on {', '.join(missing)}" + (f" (measured: {'; '.join(have)})" if have
                                                                          else "")) if missing else
                           "D1 P95 TPOT: " + "; ".join(have), read))
    cs = _decode_concurrencies(run_dir)
    title = "decode throughput at C=" + "/".join(map(str, cs)) + " per layout"
    parts, gaps = [], []
    for c in cs:
        have, missing = per_layout(f"D2_c{c}", "output_tps", "tok/s", ",.1f")
        parts += [f"C={c}: " + ", ".join(have)] if have else []
        gaps += [f"D2_c{c} on {', '.join(missing)}"] if missing else []
    ms.checks.append(Check(title, "not measured" if gaps else "pass",
                           ("not measured: " + "; ".join(gaps) + " — measure them in Phase 4 (measure_cases)"
                            + (f"; measured {'; '.join(parts)}" if parts else "")) if gaps else "; ".join(parts), read))
    run_ids = dict(zip(verd["layout"].astype(str), verd["run_id"].astype(str))) if "run_id" in verd.columns else {}
    nodes = _record_nodes(list(run_ids.values()), run_dir)
    rails = {lay: _rail_traffic(run_dir, rid) for lay, rid in run_ids.items()}
    comm = _csv(p4 / "comm_summary.csv")
    model = ("; modelled per decode step for the cluster: " + ", ".join(
        f"{r.layout} {r.cross_node_mib_per_step:,.2f} MiB" for r in comm.itertuples()) + " (a lower bound, not a "
        "measurement)") if comm is not None and {"layout", "cross_node_mib_per_step"} <= set(comm.columns) else ""
    if rails and all(rails.values()):
        ms.checks.append(Check("cross-node traffic per layout", "pass", "measured rail traffic per node (Phase 2 of "
                               "each layout's run): " + "; ".join(f"{lay} {v[0]:,.2f} Gbit/s ({v[1]})"
                                                                 for lay, v in rails.items()) + model, read))
    elif nodes == 1:
        ms.checks.append(Check("cross-node traffic per layout", "pass",
                               f"the measured layouts ran on one node: no traffic crosses nodes in any of them{model}",
                               read + (["phase4/comm_summary.csv"] if model else [])))
    else:
        ms.checks.append(Check("cross-node traffic per layout", "not measured",
                               ("the layouts ran on " + (f"{nodes} nodes" if nodes else "nodes this run cannot tell")
                                + ", and not every layout's run has Phase 2 rail counters (without: "
                                + ", ".join(k for k, v in rails.items() if not v) + "): run Phase 2 on each "
                                "layout's run to see whether cross-node traffic drops" + model),
                               read))
    pp = [lay for lay in layouts if "PP" in lay.upper()]
    stages = _csv(run_dir / "phase3" / "trace_stages.csv")
    p3 = read_manifest(run_dir).get("phases", {}).get("phase3", {})
    if not pp:
        ms.checks.append(Check("pipeline stages balanced", "not measured",
                               "no pipeline layout (PP ≥ 2) measured: the stage balance of TP8+PP2 is untested", read))
    elif stages is None or stages.empty or p3.get("from_samples"):
        why = ("Phase 3 read recorded sample data" if p3.get("from_samples") else
               "Phase 3 has no per-stage view (phase3/trace_stages.csv) in this run")
        ms.checks.append(Check("pipeline stages balanced", "not measured",
                               f"{why}: capture the {pp[0]} layout in Phase 3 (its launch settings, e.g. "
                               "-p pp_size=2) — its per-stage view decides it", read))
    else:
        info = {}
        try:
            info = json.loads((run_dir / "phase3" / "trace_analysis.json").read_text()).get("slow_rank") or {}
        except (OSError, ValueError):
            pass
        slow = info.get("slow_stage")
        verdicts = ", ".join(dict.fromkeys(stages["verdict"].astype(str))) if "verdict" in stages.columns else ""
        ms.checks.append(Check("pipeline stages balanced", "pass",
                               (f"answered: stage {slow} holds the pipeline back — {info.get('stage_evidence', '')}"
                                if slow is not None else f"answered: balanced ({verdicts or 'no stage holds it back'})"),
                               ["phase3/trace_stages.csv"]))
    return ms


# ---------------------------------------------------------------- M4: the first optimisation loop

M4_GAIN_PCT = 10.0             # docs/method.md#milestones: ≥ 10 % more throughput under the SLOs, or clearly lower tails
THROUGHPUT_METRICS = ("request_goodput", "output_tps")


def _ab_tables(run_dir: Path) -> list[tuple[str, pd.DataFrame, pd.DataFrame]]:
    """``(phase, differences, comparison)`` of every A/B a phase wrote (``<phase>/ab_differences.csv`` +
    ``ab_comparison.csv``: :func:`servelab.measure.abtest.ab_compare` over the phase's launch-variant records,
    whose cases come from their summaries). The deliberately confounded demonstration is not among them."""
    out = []
    for cmp_path in sorted(run_dir.glob("*/ab_comparison.csv")):
        diff_path = cmp_path.with_name("ab_differences.csv")
        try:
            cmp = pd.read_csv(cmp_path)
            diff = pd.read_csv(diff_path) if diff_path.is_file() else pd.DataFrame(columns=["key", "status"])
        except (pd.errors.EmptyDataError, pd.errors.ParserError):
            continue
        out.append((cmp_path.parent.name, diff, cmp))
    return out


def _records(run_dir: Path, phase: str) -> dict[str, Path]:
    """The run-like records under a phase folder, by run id (the A/B's labels)."""
    out: dict[str, Path] = {}
    for m in sorted((run_dir / phase).glob("**/manifest.json")):
        try:
            rid = json.loads(m.read_text()).get("run_id")
        except (OSError, ValueError):
            continue
        if rid:
            out[str(rid)] = m.parent
    return out


def _record_of(records: dict[str, Path], label: str) -> Path | None:
    return records.get(label) or records.get(label.split(":", 1)[-1])


def _profiler_free(rec: Path | None) -> tuple[bool | None, str]:
    """(True when the record's engine ran with no profiler and none of its cases was profiled, why not)."""
    if rec is None:
        return None, "its record is not in the phase folder"
    m = read_manifest(rec)
    la = ((m.get("launch") or {}).get("settings") or {})
    on = [k for k in ("profiler_dir", "nvtx_markers") if la.get(k)]
    if on:
        return False, f"launched with {', '.join(on)}"
    for _, path, _ in summary_paths(rec):
        meta = path.parent / "meta.json" if path is not None else None
        if meta is not None and meta.is_file():
            try:
                if json.loads(meta.read_text()).get("profiled"):
                    return False, f"its case {path.parent.name} was profiled"
            except (OSError, ValueError):
                continue
    return True, ""


def _gain(c: pd.DataFrame) -> tuple[str, str]:
    """("gain" | "tails" | "", what) for one B's comparison rows: throughput (goodput where the A/B has it, else output
    TPS) better by ≥ M4_GAIN_PCT outside the noise band with no latency worse, or a P95/P99 latency better by
    ≥ M4_GAIN_PCT with no throughput worse."""
    if c.empty or not {"metric", "verdict", "delta_pct"} <= set(c.columns):
        return "", "no compared metric"
    thr = next((m for m in THROUGHPUT_METRICS if (c["metric"] == m).any()), None)
    lat = c[c["metric"].astype(str).str.match(r"p9[59]_")]
    thr_rows = c[c["metric"] == thr] if thr else c.iloc[0:0]
    worse_lat = lat[lat["verdict"] == "worse"]
    worse_thr = thr_rows[thr_rows["verdict"] == "worse"]
    up = thr_rows[(thr_rows["verdict"] == "better") & (thr_rows["delta_pct"] >= M4_GAIN_PCT)]
    name = "goodput" if thr == "request_goodput" else "output TPS (no goodput: no SLO set)"
    if not up.empty and worse_lat.empty:
        r = up.iloc[0]
        return "gain", f"{r['case_id']} {name} {r['delta_pct']:+.1f} % (band ±{r['noise_band_pct']:.1f} %), no P95 worse"
    down = lat[(lat["verdict"] == "better") & (lat["delta_pct"] <= -M4_GAIN_PCT)]
    if not down.empty and worse_thr.empty:
        r = down.iloc[0]
        return "tails", f"{r['case_id']} {r['metric']} {r['delta_pct']:+.1f} % (band ±{r['noise_band_pct']:.1f} %)"
    best = thr_rows["delta_pct"].max() if not thr_rows.empty else float("nan")
    return "", (f"no ≥ {M4_GAIN_PCT:g} % gain outside the noise band: best {name} Δ {best:+.1f} %" if best == best else
                f"no throughput metric compared ({', '.join(dict.fromkeys(c['metric'].astype(str)))})")


def _exclusion(run_dir: Path, phase: str) -> str:
    """The user's written answer to the A/B's "Keep it?" (``<phase>/ab_questions.csv``), "" when none."""
    q = _csv(run_dir / phase / "ab_questions.csv")
    if q is None or not {"question", "answer", "source"} <= set(q.columns):
        return ""
    keep = q[q["question"].astype(str).str.startswith("7.") & q["source"].astype(str).str.contains("user")]
    return str(keep.iloc[0]["answer"]) if not keep.empty else ""


def m4(run_dir: Path) -> Milestone:
    """M4 first optimisation loop (``docs/method.md#milestones``): one change A/B-tested with one declared variable,
    every case VALID, reproduced without the profiler, no correctness regression (the greedy outputs of the same
    fixed prompts on A and B, ``<phase>/ab_correctness.csv``), and ≥ 10 % more throughput under the SLOs (goodput
    where the A/B has it) or clearly lower P95/P99 tails — or, where no change gained, a written conclusion that
    excludes the direction (the user's answer to "Keep it?", ``<phase>/ab_questions.csv``). Each check is passed by a
    change that passed the checks before it."""
    ms = Milestone("M4", "first optimisation loop (首轮优化闭环)")
    titles = ("an A/B with one declared variable", "every compared case VALID on both sides",
              "reproduced without the profiler", "no correctness regression (greedy outputs, A vs B)",
              f"≥ {M4_GAIN_PCT:g} % more goodput within the SLO or clearly lower P95 tails — or a written exclusion")
    tables = _ab_tables(run_dir)
    if not tables:
        for c in titles:
            ms.checks.append(Check(c, "not measured", "no A/B recorded (<phase>/ab_comparison.csv)"))
        return ms
    # the A/Bs' correctness as the phases recorded it (core.facts): M4 states the same verdicts, never its own
    recorded = {f.name.split(":", 1)[1]: (str(f.value), f.note) for f in read_facts(run_dir)
                if f.name.startswith("correctness:")}
    regressions = {k: v for k, v in recorded.items() if v[0] == "regression"}
    clean, cands = [], []
    for phase, diff, cmp in tables:
        st = diff["status"] if "status" in diff.columns else pd.Series(dtype=str)
        declared = diff[st == "declared"]["key"].tolist() if "key" in diff.columns else []
        confounds = diff[st == "confound"]["key"].tolist() if "key" in diff.columns else []
        profiled = [k for k in declared + confounds if "profiler" in str(k)]
        if not (declared and not confounds and not profiled):
            continue
        clean.append((phase, declared))
        labels = [c for c in diff.columns if c not in ("key", "category", "status")]
        records = _records(run_dir, phase)
        corr = _csv(run_dir / phase / "ab_correctness.csv")
        a_free, a_why = _profiler_free(_record_of(records, labels[0])) if labels else (None, "no baseline label")
        for b in dict.fromkeys(cmp["b_run"].astype(str) if "b_run" in cmp.columns else ["B"]):
            c = cmp[cmp["b_run"].astype(str) == b] if "b_run" in cmp.columns else cmp
            b_free, b_why = _profiler_free(_record_of(records, b))
            rows = corr[corr["b_run"].astype(str) == b] if corr is not None and "b_run" in corr.columns else None
            kind, what = _gain(c)
            cands.append({"name": f"{phase} {b}", "valid": not (c["verdict"] == "invalid").any(),
                          "free": bool(a_free) and bool(b_free),
                          "free_why": "; ".join(w for w in (f"A {a_why}" if a_why else "", f"B {b_why}" if b_why
                                                            else "") if w),
                          "corr": (recorded[f"{phase}/{b}"] if f"{phase}/{b}" in recorded else
                                   correctness_verdict(rows) if rows is not None else
                                   ("not measured", f"{phase}/ab_correctness.csv absent: the A/B compared no greedy "
                                                    "outputs")),
                          "gain": kind, "what": what, "exclusion": _exclusion(run_dir, phase)})
    ms.checks.append(Check(titles[0], "pass" if clean else "fail",
                           "; ".join(f"{p}: {', '.join(d)}" for p, d in clean) if clean else
                           "every recorded A/B is confounded, profiled or declares no variable"))
    valid = [c for c in cands if c["valid"]]
    ms.checks.append(Check(titles[1], "pass" if valid else ("fail" if cands else "not measured"),
                           ", ".join(c["name"] for c in valid) if valid else
                           "a clean A/B compares an INVALID case" if cands else "no clean A/B"))
    free = [c for c in valid if c["free"]]
    ms.checks.append(Check(titles[2], "pass" if free else ("fail" if valid else "not measured"),
                           ", ".join(c["name"] for c in free) if free else
                           "; ".join(f"{c['name']}: {c['free_why']}" for c in valid) or "no clean, valid A/B"))
    correct = [c for c in free if c["corr"][0] == "no regression"]
    kept = [c for c in correct if c["gain"]]
    excluded = [c for c in free if not c["gain"] and c["exclusion"]]
    # what a change answers does not depend on whether its timings were valid: every clean A/B's verdict is shown
    corr_detail = "; ".join(f"{c['name']}: {c['corr'][0]} — {c['corr'][1]}" for c in cands)
    if regressions:              # a regression recorded anywhere in the run: this check cannot pass beside it
        ms.checks.append(Check(titles[3], "fail", "a correctness regression is recorded — " + "; ".join(
            f"{k}: regression — {v[1]}" for k, v in regressions.items())))
    elif correct:
        ms.checks.append(Check(titles[3], "pass", corr_detail))
    elif excluded:
        ms.checks.append(Check(titles[3], "pass", "not required: the direction is excluded, not kept — " + corr_detail))
    else:
        states = {c["corr"][0] for c in cands}
        ms.checks.append(Check(titles[3], "not measured" if states <= {"not measured"} else "fail",
                               corr_detail or "no clean A/B"))
    if kept:
        ms.checks.append(Check(titles[4], "pass", "; ".join(f"{c['name']}: {c['what']}" for c in kept)))
    elif excluded:
        ms.checks.append(Check(titles[4], "pass", "written exclusion: " + "; ".join(
            f"{c['name']} ({c['what']}): {c['exclusion']}" for c in excluded)))
    else:
        wrong = [c for c in free if c["gain"] and c not in correct]
        if wrong:
            detail = "a gain, but not with the same greedy outputs: " + "; ".join(
                f"{c['name']}: {c['what']} — greedy outputs {c['corr'][0]}" for c in wrong)
        elif free:
            detail = ("; ".join(f"{c['name']}: {c['what']}" for c in (correct or free)) + " — to close the loop "
                      "without a gain, answer 'Keep it?' (ab_keep) with why the bottleneck is not where the change "
                      "aimed")
        else:
            detail = "no change passed the checks above"
        ms.checks.append(Check(titles[4], "fail" if free else "not measured", detail))
    read = [f"{phase}/{name}" for phase, _, _ in tables for name in
            ("ab_differences.csv", "ab_comparison.csv", "ab_correctness.csv", "ab_questions.csv")
            if (run_dir / phase / name).is_file()]
    for c in ms.checks:
        c.tables = read
    return ms


def milestones(run_dir: Path) -> list[Milestone]:
    return [m1(run_dir), m2(run_dir), m3(run_dir), m4(run_dir)]


def milestones_frame(run_dir: Path) -> pd.DataFrame:
    rows = []
    for m in milestones(run_dir):
        for c in m.checks:
            rows.append({"milestone": m.id, "title": m.title, "milestone_status": m.status, "check": c.check,
                         "status": c.status, "detail": c.detail, "tables": ", ".join(c.tables)})
    return pd.DataFrame(rows)
