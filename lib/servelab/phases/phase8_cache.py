"""Phase 8 — memory and caches: KV usage over time, memory breakdown, the prefix-cache hit-rate matrix.

**Prefix-cache hit-rate matrix** (``docs/method.md#hit-rate-matrix``: 0 % pure compute baseline, 20 % low reuse,
50 % shared prefix, 80 % agent/coding). SGLang's ``generated-shared-prefix`` layout with the discipline of SGLang's
``benchmark/prefix_cache_benchmark.py``: each point uses ``groups`` shared prefixes of
``round(rate · ISL)`` random token ids followed by a unique head and random ids (``workload.build_workload``);
the cache is flushed before the point (llama.cpp has no flush endpoint: the engine is restarted), each group's
prefix is pre-warmed once, then every group sends its requests one after another, the groups concurrently (a
group's next request finds its prefix in the slot its previous one used — llama.cpp keeps one prompt per slot).
The achieved hit rate is measured twice over the exact measurement window — server counters and per-request
usage — and a point that misses its target is REJECTED, never a result.

The points are measured by :mod:`servelab.measure.hit_points` (an engine restart or a flush before each, the
case left open); the rates, the rule, each point's row and case summary and KV usage are computed in
:mod:`servelab.analyse.prefix_cache`, the memory breakdown in :mod:`servelab.analyse.memory`, the figures in
:mod:`servelab.analyse.prefix_cache_figures`. This module composes them — each point measured, judged
(:func:`judge_hit_point`: row, case closed with its summary) —, writes the phase tables and holds the page's views
and the H6 ledger entry. What differs per engine (the cache switch of a request, the launch changes this phase
needs) comes from its adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from servelab.analyse import memory as memory_layer
from servelab.analyse.prefix_cache import (TARGET_RATES, PointResult, accepted_results, h6_evidence, hit_point_row,
                                           hit_point_summary, kv_usage_series, matrix_frame)
from servelab.measure import request_metrics as mx
from servelab.measure.case import max_request_tokens
from servelab.measure.hit_points import HitPoint, RawHitPoint, measure_points
from servelab.core.run import write_json_atomic
from servelab.deploy.engines import engine_for
from servelab.core.facts import plain
from servelab.core.params import param, ParamError, PhaseParams
from servelab.measure.launch_variants import with_launch, log_reproduce
from servelab.report.ledger import record_evidence
from servelab.phases.context import PhaseContext

SCALES: dict[str, dict[str, Any]] = {
    "cluster": {"input_tokens": 8192, "output_tokens": 64, "groups": 16, "requests_per_group": 4},
    "local": {"input_tokens": 128, "output_tokens": 4, "groups": 4, "requests_per_group": 2},
}


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 8's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase8 --cell``); ``-p`` and ``params/phase8.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase8"
    rates: list = param([0.0, 0.2, 0.5, 0.8], "target prefix-cache hit rates, one point each [items min 0] [items max 1]")
    input_tokens: int = param(0, "prompt length; 0: the scale's (128 locally, 8192 on a cluster)")
    output_tokens: int = param(0, "output length; 0: the scale's (4 locally, 64 on a cluster)")
    groups: int = param(0, "concurrent streams, one shared prefix each; 0: the scale's (4 locally, 16 on a cluster)")
    requests_per_group: int = param(0, "requests per stream, sent one after another; 0: the scale's (2 locally)")
    bad_point: bool = param(True, "add the 50 % workload sent with cache_prompt false: it must be REJECTED")
    swa_full: bool = param(True, "llama.cpp --swa-full so a sliding-window model can reuse a prefix token by token")
    definition: str = param(mx.VLLM_BENCH, "metric definition of TTFT and throughput: vllm or sglang [one of vllm, sglang]")
    seed: int = param(0, "workload seed")


def judge_hit_point(raw: RawHitPoint) -> PointResult:
    """A measured point (:func:`servelab.measure.hit_points.measure_hit_point`) judged: its matrix row, the case
    closed with its summary (``success``, or ``failed`` where the block recorded an error; ACCEPTED is the summary's
    VALID, REJECTED its INVALID), the point's result."""
    row = hit_point_row(raw)
    raw.case.close(hit_point_summary(raw.point, row, raw.records, raw.run, raw.status, raw.definition), raw.status)
    return PointResult(raw.point, raw.case.dir, row, raw.records, raw.slots, raw.scrape, raw.t0_ns, raw.flush)


# ---------------------------------------------------------------- Phase 8 end to end


@dataclass
class Phase8Result:
    matrix: pd.DataFrame
    kv: pd.DataFrame
    memory: pd.DataFrame
    points: list[PointResult]
    engine: str
    notes: list[str] = field(default_factory=list)

    def findings(self) -> list[str]:
        return findings(self)

    def headline(self) -> dict[str, Any]:
        acc = self.matrix[self.matrix["verdict"] == "ACCEPTED"]
        out: dict[str, Any] = {"points": len(self.matrix), "accepted": len(acc),
                               "rejected": int((self.matrix["verdict"] == "REJECTED").sum())}
        for _, r in self.matrix.iterrows():
            # one line per point: the achieved rate (in %, as the findings and the tables say it) only of an
            # ACCEPTED point; a REJECTED point's number is not a result and stays in the matrix table, marked
            key = f"hit {round(r['target_rate'] * 100)} % target" + (" (bad point)" if r["case_id"].endswith("_bad")
                                                                      else "")
            got = r["counter_hit_rate"]
            if r["verdict"] == "ACCEPTED" and got is not None and not pd.isna(got):
                out[key] = f"{100 * float(got):.1f} % achieved, ACCEPTED"
            else:
                out[key] = f"{r['verdict']}: not a result"
        kv = self.kv[self.kv["metric"].isin(["kv_active", "kv_usage"])]
        out["kv_peak_active_pct"] = round(100 * float(kv["value"].max()), 2) if not kv.empty else None
        return out


def run(ctx: PhaseContext) -> Phase8Result:
    """Phase 8's entry (the phase contract), from the notebook's parameters (``ctx.params``): the hit-rate matrix on
    ``ctx.target`` — a fresh engine (or a flush) per point, plus an optional deliberately bad point (the 50 %
    workload sent with ``cache_prompt: false`` on llama.cpp — the engine reuses nothing, so the achieved rate misses
    and the point must be REJECTED) —, the KV usage over time and the memory breakdown. The run's notes (a clamped
    input, a skipped bad point, the study's launch settings) go to the phase's notes."""
    p = ctx.params
    points, notes = hit_points(ctx, p)
    served, launch_notes = cache_study_target(ctx, p)
    notes += launch_notes
    log_reproduce(ctx, "phase8")
    # every point on an emptied cache (an engine restart or a flush before each), judged as it is measured
    measured = measure_points(ctx, served, points, judge_hit_point, seed=p.seed, definition=p.definition)
    res = Phase8Result(matrix_frame(measured.results), kv_timeline(kv_parts(measured.results, served.engine)),
                       startup_memory(measured.startup_log, served.engine), measured.results, ctx.target.engine, notes)
    write_phase8_tables(ctx.phase_dir, res)
    ctx.notes.extend(res.notes)
    return res


def hit_points(ctx: PhaseContext, p: Params) -> tuple[list[HitPoint], list[str]]:
    """One point per target rate at the parameters' shape (the scale's where they leave 0), the input clamped to
    what a request may hold on the target, and the deliberately bad point where the engine has a per-request cache
    switch; with the notes saying what was clamped or skipped. A rate outside [0, 1) is refused."""
    target = ctx.target
    scale = SCALES[getattr(target, "scale", "local")]
    rates = list(p.rates) if p.rates else list(TARGET_RATES)
    for r in rates:
        if not 0.0 <= float(r) < 1.0:
            raise ParamError(f"hit rates must be in [0, 1): got {r}")
    isl = int(p.input_tokens or scale["input_tokens"])
    osl = int(p.output_tokens or scale["output_tokens"])
    g = int(p.groups or scale["groups"])
    rpg = int(p.requests_per_group or scale["requests_per_group"])
    limit = max_request_tokens(target)
    notes: list[str] = []
    if limit is not None and isl + osl > limit:
        notes.append(f"input clamped from {isl} to {limit - osl}: a request may hold {limit} tokens on this target")
        isl = limit - osl
    points = [HitPoint(float(r), isl, osl, g, rpg) for r in rates]
    if p.bad_point:
        if engine_for(target.engine).request_cache_switch is None:
            notes.append("deliberately bad point skipped: only llama.cpp has a per-request cache switch")
        else:
            # one request per group is enough to show the rule at work (and costs half a point)
            points.append(HitPoint(0.5, isl, osl, g, 1, cache_prompt=False, label="H8_hit50_bad"))
    return points, notes


def cache_study_target(ctx: PhaseContext, p: Params) -> tuple[Any, list[str]]:
    """The target as this phase serves it: with the launch changes the engine's adapter asks for the cache study
    (``swa_full``), or as it runs when attached (not servelab's to set); with the notes saying which."""
    target = ctx.target
    changes, change_notes = engine_for(target.engine).cache_study_launch_changes(target.launch, p.swa_full)
    if changes and target.attached:
        return target, [f"attached server: the study's launch settings "
                        f"({', '.join(f'{k}={v}' for k, v in changes.items())}) are not servelab's to set; measured as "
                        f"the server runs"]
    if changes:
        return with_launch(target, changes, ", ".join(f"{k}={v}" for k, v in changes.items())), list(change_notes)
    return target, []


def kv_parts(results: list[PointResult], engine: str) -> list[pd.DataFrame]:
    """Each point's KV usage series (``analyse.prefix_cache.kv_usage_series``), from its own start."""
    names = engine_for(engine).metric_names
    return [kv_usage_series(r.slots, r.scrape, engine, names, r.t0_ns, r.point.case_id) for r in results]


def startup_memory(log_text: str | None, engine: str) -> pd.DataFrame:
    """The memory breakdown of the first engine's start-up lines (``analyse.memory.memory_breakdown``); an empty
    table when no engine started."""
    return memory_layer.memory_breakdown(log_text, engine_for(engine)) if log_text is not None else pd.DataFrame()


def kv_timeline(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """One KV usage timeline: each point's samples from its own start, laid end to end (half a second apart)."""
    offset = 0.0
    timeline = []
    for part in parts:
        if part.empty:
            continue
        part = part.copy()
        part["t_s"] = part["t_s"] - part["t_s"].min() + offset
        offset = float(part["t_s"].max()) + 0.5
        timeline.append(part)
    return pd.concat(timeline, ignore_index=True) if timeline else pd.DataFrame(
        columns=["t_s", "metric", "value", "source", "point"])


def write_phase8_tables(phase_dir: Path, res: Phase8Result) -> None:
    """``hit_rate_matrix.csv`` (every point, rejected ones too), ``kv_usage.csv``, ``memory.csv``, ``phase8.json``."""
    phase_dir.mkdir(parents=True, exist_ok=True)
    res.matrix.to_csv(phase_dir / "hit_rate_matrix.csv", index=False)
    res.kv.to_csv(phase_dir / "kv_usage.csv", index=False)
    res.memory.to_csv(phase_dir / "memory.csv", index=False)
    write_json_atomic(phase_dir / "phase8.json", {"headline": plain(res.headline()), "notes": res.notes,
                                                  "engine": res.engine})


def kv_summary(res: Phase8Result) -> pd.DataFrame:
    """Peak and mean KV usage per point and metric (in % of the KV pool, as the findings say it), with the source
    named (``kv_usage.csv`` keeps the fractions)."""
    if res.kv.empty:
        return pd.DataFrame({"note": ["no KV usage samples (engine exposes neither a KV gauge nor /slots)"]})
    out = (res.kv.groupby(["point", "metric", "source"], sort=False)["value"]
           .agg(peak="max", mean="mean", samples="count").reset_index())
    return out.assign(peak=100 * out["peak"], mean=100 * out["mean"]).rename(
        columns={"peak": "peak (%)", "mean": "mean (%)"})


# ---------------------------------------------------------------- what the notebook shows

def matrix_view(res: "Phase8Result") -> pd.DataFrame:
    """The matrix's deciding columns, the client's worst event-loop stall and whether it kept up among them (the
    full table is ``phase8/hit_rate_matrix.csv``)."""
    cols = ["case_id", "target_rate", "verdict", "counter_hit_rate", "usage_hit_rate", "expected_rate",
            "tolerance_pp", "prefix_tokens", "requests", "counter_window_matches_requests", "loop_lag_max_ms",
            "client_kept_up", "reasons"]
    return res.matrix[[c for c in cols if c in res.matrix.columns]]


def accepted_view(res: "Phase8Result") -> pd.DataFrame:
    """The ACCEPTED points relative to the 0 % baseline (``analyse.prefix_cache.accepted_results``), each TTFT
    percentile with the requests it rests on, or ``max of N`` where too few (``hit_rate_matrix.csv`` keeps the
    numbers)."""
    acc = accepted_results(res.matrix)
    if acc.empty:
        return acc
    counts = res.matrix.set_index("case_id")[["n_ttft", "max_ttft_ms"]]
    return mx.labelled_percentiles(acc.join(counts, on="case_id")).drop(columns=["max_ttft_ms"])


def memory_view(res: "Phase8Result") -> pd.DataFrame:
    """The memory breakdown without the raw log lines (kept in ``phase8/memory.csv``)."""
    return res.memory.drop(columns=["line"], errors="ignore")


def memory_points(res: "Phase8Result", phase_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The memory layer per point beside its output TPS (``analyse.memory``): the KV pool and its peak use, weights,
    graphs, workspace and allocated/reserved where the engine exposes them, from each point's ``/metrics`` scrapes
    and this phase's engine log. Returns (table, sources), also written to ``phase8/memory_per_point.csv`` /
    ``memory_sources.csv``."""
    logs = sorted(Path(phase_dir, "server").glob("*.log"))
    table, sources = memory_layer.memory_table([p.case_dir for p in res.points],
                                               startup_log=logs[0].read_text(errors="replace") if logs else None,
                                               adapter=engine_for(res.engine))
    table.to_csv(Path(phase_dir) / "memory_per_point.csv", index=False)
    sources.to_csv(Path(phase_dir) / "memory_sources.csv", index=False)
    return memory_layer.page_view(table), sources


def record_h6(ctx: PhaseContext, res: "Phase8Result") -> pd.DataFrame:
    """Record this phase's evidence about H6 in the run's ledger; returns it as a one-row table."""
    verdict, summary, nums = h6_evidence(res)
    ev = record_evidence(ctx, "H6", verdict, summary, anchor="KV-usage-over-time", numbers=nums,
                         table=["kv_usage.csv", "hit_rate_matrix.csv"])
    return pd.DataFrame([{"hypothesis": ev.hypothesis, "verdict": ev.verdict, "summary": ev.summary, **nums}])


def point_requests(res: Phase8Result, case_id: str) -> pd.DataFrame:
    """Per request of one point: group, prompt/cached tokens (usage), TTFT — how each request hit the cache."""
    p = next((x for x in res.points if x.point.case_id == case_id), None)
    if p is None:
        return pd.DataFrame({"note": [f"no point {case_id}"]})
    rows = [{"request_id": r.request_id, "role": r.role, "group": r.group, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens,
             "ttft_ms": mx.request_metrics(r, mx.VLLM_BENCH).ttft_ms} for r in p.records]
    return pd.DataFrame(rows)


def findings(res: Phase8Result) -> list[str]:
    """What Phase 8 found, in sentences for the page's findings box: which hit-rate points are valid (ACCEPTED) and
    which were rejected and why, what the cache buys against the 0 % baseline and at which rate most, and the
    KV usage peak."""
    m = res.matrix
    out = []
    if m.empty:
        return ["No hit-rate point ran: nothing measured."]

    def pct(v: Any) -> str:
        return "—" if v is None or pd.isna(v) else f"{100 * float(v):.1f} %"
    acc = m[m["verdict"] == "ACCEPTED"]
    out.append(f"Hit-rate matrix on {res.engine}: {len(m)} points, {len(acc)} ACCEPTED (valid), "
               f"{len(m) - len(acc)} REJECTED; achieved rate from the counters: " + ", ".join(
                   f"{r.case_id} {pct(r.counter_hit_rate)} (target {pct(r.target_rate)}, {r.verdict})"
                   for r in m.itertuples()) + ".")
    rej = m[m["verdict"] != "ACCEPTED"]
    if len(rej):
        out.append("Rejected, shown but never used as results: " + "; ".join(
            f"{r.case_id} ({r.reasons or 'missed its target'})" for r in rej.itertuples()) + ".")
    ok = accepted_results(m)
    gain = ok[ok["target_rate"] > 0].dropna(subset=["ttft_vs_0pct"]) if not ok.empty else ok
    if not gain.empty:
        best = gain.loc[gain["ttft_vs_0pct"].astype(float).idxmin()]
        out.append("A/B of each hit rate against the 0 % baseline (ACCEPTED points only, the valid ones): " + "; ".join(
            f"{100 * r.target_rate:.0f} % → P50 TTFT ×{r.ttft_vs_0pct:.2f}, input TPS ×{r.input_tps_vs_0pct:.2f}"
            for r in gain.itertuples()) + f"; the cache buys most at the {100 * best['target_rate']:.0f} % hit rate "
            f"(P50 TTFT {best['p50_ttft_ms']:,.1f} ms) — the hit rate is a property of the workload (how much prefix it "
            "shares), not a setting to choose: read it as what a workload of that reuse gains.")
    else:
        out.append("No A/B: no accepted point can be compared with an accepted 0 % baseline, so nothing is said about "
                   "what the cache buys.")
    kv = res.kv[res.kv["metric"].isin(["kv_active", "kv_usage"])] if not res.kv.empty else res.kv
    if not kv.empty:
        out.append(f"KV usage peaked at {100 * float(kv['value'].max()):.1f} % ({', '.join(sorted(set(kv['metric'])))}).")
    return out
