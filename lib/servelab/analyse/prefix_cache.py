"""Prefix cache and KV memory, computed from what a case recorded: the achieved hit rate from two sources and the
accept / reject rule, a measured point judged (its matrix row and case summary), KV usage over time. The memory
breakdown of the start-up log is :func:`servelab.analyse.memory.memory_breakdown`; the figures are
:mod:`servelab.analyse.prefix_cache_figures`.

**KV usage over time.** vLLM (``vllm:kv_cache_usage_perc``) and SGLang (``sglang:token_usage``) expose a KV
gauge, scraped from ``/metrics`` during every point. llama.cpp has no KV gauge: its ``/slots`` endpoint gives,
per slot, ``n_ctx`` and the tokens the slot's KV holds (``n_prompt_tokens`` = prompt + generated so far, also
for an idle slot that keeps its last prompt for reuse). :class:`servelab.measure.slots.SlotsPoller` samples it;
*active* usage counts
the processing slots, *held* usage every slot (idle slots keep their cached prompt). Both are token counts over
the slots' capacity, not allocator bytes — the page says so.

**Achieved hit rate**, measured twice over the exact measurement window of a point (each engine's counter
formula is its adapter's ``prefix_cache_counts``):

- server counters — llama.cpp ``Δprompt_tokens_cached_total / (Δprompt_tokens_total +
  Δprompt_tokens_cached_total)`` (its ``prompt_tokens_total`` *excludes* cached tokens, per its own HELP text),
  vLLM ``Δprefix_cache_hits_total / Δprefix_cache_queries_total``, SGLang ``Δcached_tokens_total /
  Δprompt_tokens_total``;
- per request — ``Σ usage.prompt_tokens_details.cached_tokens / Σ usage.prompt_tokens``.

A point whose achieved rate (either source) misses the target by more than ``max(0.5 pp, page_size / ISL)`` is
**REJECTED**: shown with its reason, never used as a result (no TTFT/throughput comparison uses it).

The points themselves are measured by :mod:`servelab.measure.hit_points`; Phase 8 (``phase8_cache``) judges each
with :func:`hit_point_row` and closes its case with :func:`hit_point_summary`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.case_record import CaseSummary, client_integrity, judged_row, request_counts
from servelab.measure.hit_points import HitPoint, RawHitPoint
from servelab.measure.records import ClientRun, RequestRecord
from servelab.measure.launch_variants import Snapshot, delta_of, snapshot_deltas
from servelab.deploy.engines import ADAPTERS, engine_for
from servelab.deploy.server import RunningServer

TARGET_RATES = (0.0, 0.2, 0.5, 0.8)
MIN_TOLERANCE = 0.005                  # 0.5 percentage points (docs/metrics.md#hit-rate)


# ---------------------------------------------------------------- KV usage over time

def kv_usage_series(slots: pd.DataFrame | None, scrape: pd.DataFrame | None, engine: str,
                    metric_names: dict[str, str], t0_ns: int, label: str = "") -> pd.DataFrame:
    """KV usage over time as ``t_s, metric, value, source, point`` rows (value: fraction 0–1).

    llama.cpp: ``kv_active`` (tokens of processing slots / total slot capacity) and ``kv_held`` (all slots,
    idle ones keep their last prompt) from ``/slots``; others: the engine's KV gauge from ``/metrics``.
    """
    rows: list[pd.DataFrame] = []
    if engine_for(engine).slots_path and slots is not None and not slots.empty:
        g = slots.groupby("ts_ns")
        cap = g["n_ctx"].sum()
        active = slots[slots["is_processing"]].groupby("ts_ns")["n_prompt_tokens"].sum().reindex(cap.index,
                                                                                                fill_value=0)
        held = g["n_prompt_tokens"].sum()
        for name, s in (("kv_active", active / cap), ("kv_held", held / cap)):
            rows.append(pd.DataFrame({"t_s": (s.index.to_numpy() - t0_ns) / 1e9, "metric": name,
                                      "value": s.to_numpy(dtype=float),
                                      "source": "llama.cpp /slots token counts (no KV gauge exposed)"}))
    elif scrape is not None and not scrape.empty and metric_names.get("kv_usage"):
        series = metric_names["kv_usage"]
        s = scrape[scrape["name"] == series].groupby("ts_ns")["value"].sum()
        if not s.empty:
            rows.append(pd.DataFrame({"t_s": (s.index.to_numpy() - t0_ns) / 1e9, "metric": "kv_usage",
                                      "value": s.to_numpy(dtype=float), "source": f"{series} (/metrics gauge)"}))
    if not rows:
        return pd.DataFrame(columns=["t_s", "metric", "value", "source", "point"])
    out = pd.concat(rows, ignore_index=True)
    out["point"] = label
    return out


# ---------------------------------------------------------------- hit-rate points

def tolerance(page_tokens: int, input_tokens: int) -> float:
    """The rejection bound of ``docs/metrics.md#hit-rate``: ``max(0.5 pp, page_size / ISL)`` as a fraction."""
    return max(MIN_TOLERANCE, page_tokens / max(input_tokens, 1))


def page_tokens(target: Any) -> int:
    """Cache granularity in tokens: ``launch.page_size`` where set, else the engine's default."""
    la = target.launch or {}
    return int(la.get("page_size") or la.get("block_size") or engine_for(target.engine).default_page_tokens)


def counter_hit_rate(engine: str, deltas: pd.DataFrame, metric_names: dict[str, str]) -> dict[str, Any]:
    """Achieved hit rate from counter deltas (each engine's formula is its adapter's ``prefix_cache_counts``)."""
    cached, total, formula = engine_for(engine).prefix_cache_counts(lambda key: delta_of(deltas, metric_names[key]))
    rate = cached / total if cached is not None and total else None
    return {"counter_cached_tokens": cached, "counter_prompt_tokens": total, "counter_hit_rate": rate,
            "counter_formula": formula}


def usage_hit_rate(records: list[RequestRecord]) -> dict[str, Any]:
    """Σ cached_tokens / Σ prompt_tokens of the measured requests' usage; None when the server gave none."""
    ok = [r for r in records if r.ok and r.role == "measure"]
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens is not None]
    if not reported:
        return {"usage_cached_tokens": None, "usage_prompt_tokens": None, "usage_hit_rate": None,
                "usage_reported": 0}
    c = sum(int(r.cached_tokens) for r in reported)
    p = sum(int(r.prompt_tokens) for r in reported)
    return {"usage_cached_tokens": c, "usage_prompt_tokens": p, "usage_hit_rate": c / p if p else None,
            "usage_reported": len(reported)}


def judge_point(target_rate: float, counter_rate: float | None, usage_rate: float | None, tol: float,
                usage_reported: int, measured: int) -> tuple[str, list[str]]:
    """ACCEPTED or REJECTED with reasons: each available source must lie within ``tol`` of the target."""
    reasons = []
    if counter_rate is None:
        reasons.append("server counters give no hit rate (counters absent or no prompt tokens in the window)")
    elif abs(counter_rate - target_rate) > tol:
        reasons.append(f"counter hit rate {counter_rate:.2%} misses the target {target_rate:.0%} by "
                       f"{abs(counter_rate - target_rate) * 100:.2f} pp > {tol * 100:.2f} pp")
    if usage_rate is not None:
        if abs(usage_rate - target_rate) > tol:
            reasons.append(f"per-request hit rate {usage_rate:.2%} misses the target {target_rate:.0%} by "
                           f"{abs(usage_rate - target_rate) * 100:.2f} pp > {tol * 100:.2f} pp")
        if usage_reported < measured:
            reasons.append(f"only {usage_reported} of {measured} requests reported cached tokens")
    elif measured:
        reasons.append("no request reported usage.prompt_tokens_details.cached_tokens (second source missing)")
    return ("REJECTED" if reasons else "ACCEPTED"), reasons


# ---------------------------------------------------------------- points and the matrix

@dataclass
class PointResult:
    point: HitPoint
    case_dir: Path
    row: dict[str, Any]                      # one row of the matrix table
    records: list[RequestRecord]
    slots: pd.DataFrame
    scrape: pd.DataFrame
    t0_ns: int
    flush: dict[str, Any] = field(default_factory=dict)


def point_row(point: HitPoint, srv: RunningServer, records: list[RequestRecord], run: ClientRun | None,
              before: Snapshot | None, after: Snapshot | None, definition: str, error: str = "") -> dict[str, Any]:
    """The matrix row of a point: target, achieved (both sources), tolerance, verdict, TTFT and throughput."""
    tol = tolerance(page_tokens(srv.target), point.input_tokens)
    row: dict[str, Any] = {"case_id": point.case_id, "target_rate": point.target_rate, "purpose": point.purpose,
                           "input_tokens": point.input_tokens, "output_tokens": point.output_tokens,
                           "prefix_tokens": point.prefix_tokens, "groups": point.groups,
                           "requests": point.groups * point.requests_per_group, "cache_prompt": point.cache_prompt,
                           "tolerance_pp": tol * 100, "page_tokens": page_tokens(srv.target)}
    measured = [r for r in records if r.role == "measure"]
    counters: dict[str, Any] = {"counter_cached_tokens": None, "counter_prompt_tokens": None,
                                "counter_hit_rate": None, "counter_formula": ""}
    window_check = None
    if before is not None and after is not None and before.ok and after.ok:
        deltas = snapshot_deltas(before, after)
        counters = counter_hit_rate(srv.target.engine, deltas, srv.engine.metric_names)
        if counters["counter_prompt_tokens"] is not None:
            window_check = int(counters["counter_prompt_tokens"]) == sum(int(r.prompt_tokens or 0)
                                                                          for r in measured if r.ok)
    usage = usage_hit_rate(records)
    row.update(counters)
    row.update(usage)
    row["counter_window_matches_requests"] = window_check
    expected = point.prefix_tokens / point.input_tokens
    row["expected_rate"] = expected
    verdict, reasons = judge_point(point.target_rate, counters["counter_hit_rate"], usage["usage_hit_rate"], tol,
                                   usage["usage_reported"], sum(r.ok for r in measured))
    if error:
        verdict, reasons = "REJECTED", [f"error: {error}", *reasons]
    if run is not None and measured:
        s = mx.summarize(measured, max(run.duration_s, 1e-9), definition)
        tc = s["token_check"]
        if tc["mismatches"]:
            verdict = "REJECTED"
            reasons.append(f"achieved tokens off target in {tc['mismatches']} of {tc['checked']} requests")
        if s["failed"]:
            verdict = "REJECTED"
            reasons.append(f"{s['failed']} request(s) failed: {s['errors_by_kind']}")
        row.update({"duration_s": run.duration_s, "completed": s["completed"], "failed": s["failed"],
                    "p50_ttft_ms": s["p50_ttft_ms"], "p95_ttft_ms": s["p95_ttft_ms"], "p50_tpot_ms": s["p50_tpot_ms"],
                    "input_throughput": s["input_throughput"], "output_throughput": s["output_throughput"],
                    "total_token_throughput": s["total_token_throughput"],
                    # what the percentiles rest on, and the max a page shows where too few values hold one
                    "n_ttft": s["n_ttft"], "max_ttft_ms": s["max_ttft_ms"], "n_tpot": s["n_tpot"],
                    "max_tpot_ms": s["max_tpot_ms"]})
        cached = row.get("counter_cached_tokens")
        if cached is not None and row.get("counter_prompt_tokens") is not None:
            row["computed_prefill_tok_s"] = (row["counter_prompt_tokens"] - cached) / max(run.duration_s, 1e-9)
    row["verdict"], row["reasons"] = verdict, "; ".join(reasons)
    row["definition"] = definition
    return row


def integrity_row(rec: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The client's integrity in the matrix row: worst dispatch lag and event-loop stall (ms), and — when the client
    fell behind — the row REJECTED with the reason (its numbers measured the client, not the cache)."""
    out: dict[str, Any] = {"dispatch_lag_max_ms": (rec.get("dispatch_lag") or {}).get("max_ms") if rec else None,
                           "loop_lag_max_ms": (rec.get("loop_lag") or {}).get("max_ms") if rec else None,
                           "client_kept_up": ("yes" if rec.get("ok") else "no") if rec else "not measured"}
    behind = list(rec.get("reasons") or [])
    if behind:
        out["verdict"] = "REJECTED"
        out["reasons"] = "; ".join([x for x in str(row.get("reasons") or "").split("; ") if x] + behind)
    return out


def hit_point_row(raw: RawHitPoint) -> dict[str, Any]:
    """A measured point's matrix row (:func:`point_row`) with the client's integrity in it (:func:`integrity_row`):
    a client that fell behind makes the point REJECTED in its row too, so the table and ``summary.json`` agree."""
    row = point_row(raw.point, raw.case.srv, raw.records, raw.run, raw.before, raw.after, raw.definition, raw.error)
    row.update(integrity_row(client_integrity(raw.run) if raw.run is not None else {}, row))
    return row


def hit_point_summary(point: HitPoint, row: dict[str, Any], records: list[RequestRecord], run: ClientRun | None,
                      status: str, definition: str) -> CaseSummary:
    """The case summary of a hit-rate point: the verdict (ACCEPTED → VALID, REJECTED → INVALID, with the
    row's reasons), the measured requests' metrics as the one repeat, the matrix row in ``details``."""
    pooled, judged = judged_row(records, run, definition, row.get("verdict") == "ACCEPTED", row.get("reasons"), status)
    return CaseSummary(
        case_id=point.case_id, phase="", kind="prefix_cache", status=status,
        verdict=judged, definition=definition, metrics=pooled,
        repeats=[{"repeat": 0, "metrics": pooled}] if pooled else [], counts=request_counts(records),
        integrity=client_integrity(run) if run is not None else {},
        details={"point": asdict(point), "row": {k: v for k, v in row.items() if k not in ("verdict", "reasons")}})


def matrix_frame(points: list[PointResult]) -> pd.DataFrame:
    """One row per point (both achieved rates, tolerance, verdict, TTFT and throughput)."""
    cols = ["case_id", "target_rate", "purpose", "verdict", "counter_hit_rate", "usage_hit_rate", "expected_rate",
            "tolerance_pp", "prefix_tokens", "input_tokens", "output_tokens", "groups", "requests", "cache_prompt",
            "p50_ttft_ms", "p95_ttft_ms", "p50_tpot_ms", "input_throughput", "output_throughput",
            "computed_prefill_tok_s", "n_ttft", "max_ttft_ms", "n_tpot", "max_tpot_ms", "counter_cached_tokens",
            "counter_prompt_tokens", "usage_cached_tokens",
            "usage_prompt_tokens", "counter_window_matches_requests", "counter_formula", "page_tokens", "definition",
            "dispatch_lag_max_ms", "loop_lag_max_ms", "client_kept_up", "reasons"]
    df = pd.DataFrame([p.row for p in points])
    for c in cols:
        if c not in df.columns:
            df[c] = None
    return df[cols]


def accepted_results(matrix: pd.DataFrame) -> pd.DataFrame:
    """Only the ACCEPTED points, with TTFT / throughput relative to the 0 % baseline (if it was accepted)."""
    ok = matrix[matrix["verdict"] == "ACCEPTED"].copy()
    base = ok[ok["target_rate"] == 0.0]
    cols = ["case_id", "target_rate", "purpose", "counter_hit_rate", "p50_ttft_ms", "p95_ttft_ms",
            "input_throughput", "computed_prefill_tok_s"]
    if ok.empty:
        return pd.DataFrame(columns=cols + ["ttft_vs_0pct", "input_tps_vs_0pct"])
    if not base.empty:
        b = base.iloc[0]
        ok["ttft_vs_0pct"] = ok["p50_ttft_ms"] / b["p50_ttft_ms"] if b["p50_ttft_ms"] else None
        ok["input_tps_vs_0pct"] = ok["input_throughput"] / b["input_throughput"] if b["input_throughput"] else None
    else:
        ok["ttft_vs_0pct"] = None
        ok["input_tps_vs_0pct"] = None
    return ok[cols + ["ttft_vs_0pct", "input_tps_vs_0pct"]].reset_index(drop=True)


# ---------------------------------------------------------------- H6

def h6_evidence(res: Any) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H6 (KV capacity limits concurrency) from this phase's KV samples
    (``res``: a Phase 8 result — its ``kv`` samples, ``points`` and ``matrix``)."""
    kv = res.kv[res.kv["metric"].isin(["kv_active", "kv_usage"])]
    peak = float(kv["value"].max()) if not kv.empty else math.nan
    deferred = 0.0
    for p in res.points:
        if not p.scrape.empty:
            d = p.scrape[p.scrape["name"].isin([a.metric_names["waiting"] for a in ADAPTERS.values()])]
            deferred = max(deferred, float(d["value"].max()) if not d.empty else 0.0)
    nums = {"kv_peak_active": peak, "max_waiting_requests": deferred,
            "concurrency": int(res.matrix["groups"].max()) if not res.matrix.empty else None}
    if math.isnan(peak):
        return "inconclusive", "no KV usage exposed by the engine in this phase", nums
    if peak >= 0.9 or deferred > 0:
        return "supported", (f"KV usage peaked at {peak:.0%} with up to {deferred:.0f} request(s) waiting at "
                             f"C={nums['concurrency']}"), nums
    return "inconclusive", (f"KV usage peaked at {peak:.1%} with no request waiting at C={nums['concurrency']}: "
                            "this matrix does not press KV capacity (Phase 1's concurrency search decides H6)"), nums
