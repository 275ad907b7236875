"""Concurrency search (``docs/method.md#search``): C = 1, then add ``step`` (16 on the cluster) with regression fallback.

Each point is a case (``cases/search_c<C>/``) sized like every case of the matrix (``docs/case.md#sizing``): the
C = 1 point sends as many requests as the matrix's concurrency-1 case of the same shape (``c1_requests``, D1's
count), a concurrent point at least ``waves × C`` (two waves), each for at least ``min_window_s``; with the
warm-up / flush policy of decode points. A point that completed fewer requests than that is INVALID ("too few
requests"), and an INVALID point decides nothing: it is kept in the frontier, marked, but no stop rule reads it
and no answer comes from it. After every VALID point the stop conditions are checked from evidence, in order:

- ``OOM``               the engine log matched the adapter's ``oom`` marker during the point;
- ``ENGINE_CRASH``      the engine failed its health probe (process gone or /health not 200);
- ``TTFT_SLO_EXCEEDED`` P``slo_percentile`` TTFT > the TTFT SLO (when ``stop_on_slo``);
- ``TPOT_SLO_EXCEEDED`` P``slo_percentile`` TPOT > the TPOT SLO (when ``stop_on_slo``);
- ``TPS_REGRESSION``    output TPS fell more than ``regression_pct`` below the best so far — first the
                        midpoint between the best C and this C is probed once (the fallback), then stop;
- ``TPS_SATURATED``     output TPS grew less than ``saturation_gain_pct`` over the previous point;
- ``MAX_CONCURRENCY_REACHED`` the next C would exceed ``max_concurrency``.

Three different answers (never one number): max successful C (every request succeeded), max-TPS C (highest
output TPS among successful VALID points; None when no point is VALID), max-under-SLO C (largest successful VALID
C whose P``slo_percentile`` TTFT and TPOT meet the SLOs — the percentile as shown, i.e. the maximum where too few
requests hold it; None when no SLO is set). The SLO frontier table has throughput vs per-user
tok/s (1000 / median TPOT) and TTFT/TPOT percentiles for every point.

Each step appends a progress event ("search step k: concurrency C") to ``<run>/<phase>/progress.jsonl``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from servelab.core.run import emit_progress, human_duration
from servelab.measure import request_metrics as mx
from servelab.measure.case import ENGINE_CRASH, OOM, SUCCESS, CaseEnv, CaseResult, CaseSpec, EngineCrash, run_case
from servelab.measure.matrix import MIN_WAVES

STOP_REASONS = ("OOM", "ENGINE_CRASH", "TTFT_SLO_EXCEEDED", "TPOT_SLO_EXCEEDED", "TPS_SATURATED", "TPS_REGRESSION",
                "MAX_CONCURRENCY_REACHED")


@dataclass
class SearchConfig:
    """Shape of the search points and its stop thresholds."""
    input_tokens: int
    output_tokens: int
    step: int = 16
    max_concurrency: int = 256
    waves: int = MIN_WAVES              # requests of a concurrent point: at least waves × C (as the matrix's cases)
    c1_requests: int = 0                # requests of the C = 1 point (the matrix's count for this shape); 0: waves
    saturation_gain_pct: float = 5.0
    regression_pct: float = 10.0
    slo_percentile: int = 95
    stop_on_slo: bool = True
    definition: str = mx.VLLM_BENCH
    min_window_s: float = 0.0


@dataclass
class SearchPoint:
    concurrency: int
    case_id: str
    status: str
    output_tps: float | None
    total_tps: float | None
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    tok_per_s_per_user: float | None
    meets_slo: bool | None
    verdict: str
    reasons: list[str] = field(default_factory=list)
    role: str = "ladder"                # ladder | fallback
    slo_shown: dict[str, Any] = field(default_factory=dict)   # metric → (label, value) the SLO was judged on
    completed: int | None = None        # requests the point completed (its sample count)
    required: int | None = None         # requests it had to send (its size)


@dataclass
class SearchResult:
    points: list[SearchPoint]
    stop_reason: str
    stop_detail: str
    max_successful_concurrency: int | None
    max_tps_concurrency: int | None
    max_under_slo_concurrency: int | None
    slo: dict[str, Any]
    definition: str

    def frontier(self) -> pd.DataFrame:
        """The SLO frontier: one row per point, sorted by concurrency."""
        rows = []
        for p in sorted(self.points, key=lambda p: p.concurrency):
            rows.append({"concurrency": p.concurrency, "status": p.status, "validity": p.verdict,
                         "requests": p.completed, "requests_needed": p.required, "reasons": "; ".join(p.reasons),
                         "output_tps": p.output_tps, "total_tps": p.total_tps,
                         "tok_per_s_per_user": p.tok_per_s_per_user,
                         **{f"{k}_ttft_ms": v for k, v in p.ttft_ms.items()},
                         **{f"{k}_tpot_ms": v for k, v in p.tpot_ms.items()},
                         "meets_slo": p.meets_slo, "role": p.role, "case_id": p.case_id})
        return pd.DataFrame(rows)

    def answers(self) -> pd.DataFrame:
        return pd.DataFrame([
            {"answer": "max successful concurrency", "concurrency": self.max_successful_concurrency},
            {"answer": "max-TPS concurrency", "concurrency": self.max_tps_concurrency},
            {"answer": "max concurrency under SLO", "concurrency": self.max_under_slo_concurrency},
            {"answer": "stop reason", "concurrency": None, "detail": f"{self.stop_reason}: {self.stop_detail}"}])


def ladder(step: int, max_concurrency: int) -> list[int]:
    """1, step, 2·step, ... ≤ max (on the cluster: 1, 16, 32, 48, ...)."""
    if step < 1:
        raise ValueError(f"search step must be >= 1, got {step}")
    out = [1]
    c = step
    while c <= max_concurrency:
        if c > 1:
            out.append(c)
        c += step
    return out


def too_few_requests(completed: Any, needed: int) -> str | None:
    """The reason a point is INVALID for its size, or None: fewer completed requests than it had to send."""
    if completed is None or needed <= 0:
        return None
    if int(completed) < needed:
        return (f"too few requests: {int(completed)} completed < {needed} (a search point is sized like a case, "
                "docs/case.md#sizing)")
    return None


def point_from_result(res: CaseResult, cfg: SearchConfig, slo: mx.SLO, role: str = "ladder") -> SearchPoint:
    """The point as the search reads it. Its verdict is the case's, and INVALID too when it completed fewer requests
    than its size (``too few requests``: a point loaded from an older run may have been one request). The SLO is
    judged on the percentile as shown (``request_metrics.shown_percentile``: the maximum where too few requests
    hold it), and only on a VALID point."""
    s = res.summaries.get(cfg.definition, {})
    p = cfg.slo_percentile
    ttft = {k: s.get(f"{k}_ttft_ms") for k in ("p50", "p95", "p99")}
    tpot = {k: s.get(f"{k}_tpot_ms") for k in ("p50", "p95", "p99")}
    verdict, reasons = res.verdict.verdict, list(res.verdict.reasons)
    small = too_few_requests(s.get("completed"), res.case.num_prompts)
    if small and not any(r.startswith(("too few", "too few completed")) for r in reasons):
        verdict, reasons = "INVALID", [*reasons, small]
    shown = {m: mx.shown_percentile(s, m, p) for m in ("ttft", "tpot", "e2el")}
    meets = None
    if slo.is_set() and res.status == SUCCESS and verdict == "VALID":
        meets = all(lim is None or (v is not None and v <= lim)
                    for lim, v in ((slo.ttft_ms, shown["ttft"][1]), (slo.tpot_ms, shown["tpot"][1]),
                                   (slo.e2el_ms, shown["e2el"][1])))
    return SearchPoint(res.case.concurrency, res.case.case_id, res.status, s.get("output_throughput"),
                       s.get("total_token_throughput"), ttft, tpot, s.get("median_tok_per_s_per_user"), meets,
                       verdict, reasons, role, shown,
                       None if s.get("completed") is None else int(s["completed"]), res.case.num_prompts)


def _progress(env: Any, message: str, **fields: Any) -> None:
    """A search progress event in ``<run>/<phase>/progress.jsonl`` (none for an env without a run folder)."""
    rdir = getattr(env, "run_dir", None)
    if rdir is not None:
        emit_progress(rdir, getattr(env, "phase", "phase1"), message, step="search", **fields)


def point_requests(cfg: SearchConfig, c: int) -> int:
    """Requests a point sends at least: the C = 1 point as many as the matrix's concurrency-1 case of its shape
    (``c1_requests``), a concurrent point ``waves × C`` — the sizing rule of every case."""
    if c == 1 and cfg.c1_requests > 0:
        return cfg.c1_requests
    return max(1, cfg.waves) * c


def search_case(cfg: SearchConfig, c: int) -> CaseSpec:
    """A point is sized like every case (``docs/case.md#sizing``): it keeps issuing at concurrency C until
    ``min_window_s`` has passed and :func:`point_requests` requests were sent, so a fast point is measured, not
    INVALID, and no percentile of a point rests on one request."""
    return CaseSpec(f"search_c{c}", "search", "decode", cfg.input_tokens, cfg.output_tokens, c,
                    point_requests(cfg, c), True, "concurrency search point", min_window_s=cfg.min_window_s,
                    min_duration_s=cfg.min_window_s)


def concurrency_search(env: CaseEnv, cfg: SearchConfig,
                       runner: Callable[[CaseEnv, CaseSpec], CaseResult] | None = None) -> SearchResult:
    """Run the ladder until a stop condition fires; see the module docstring for the rules."""
    run = runner or run_case
    slo = env.slo
    points: list[SearchPoint] = []
    stop, detail = "MAX_CONCURRENCY_REACHED", f"reached {cfg.max_concurrency}"
    q = f"p{cfg.slo_percentile}"
    steps = ladder(cfg.step, cfg.max_concurrency)
    t0 = time.monotonic()

    def do(c: int, role: str) -> SearchPoint | str:
        k = len(points) + 1
        where = "regression fallback" if role == "fallback" else f"ladder {steps.index(c) + 1} of at most {len(steps)}"
        _progress(env, f"search step {k}: concurrency {c} ({where}) … ({human_duration(time.monotonic() - t0)} "
                       f"elapsed)", k=k, concurrency=c, role=role, elapsed_s=round(time.monotonic() - t0, 1))
        try:
            res = run(env, search_case(cfg, c))
        except EngineCrash as exc:
            points.append(SearchPoint(c, f"search_c{c}", ENGINE_CRASH, None, None, {}, {}, None, None, "INVALID",
                                      [str(exc)], role))
            return f"{ENGINE_CRASH}|{exc}"
        p = point_from_result(res, cfg, slo, role)
        points.append(p)
        if res.status == OOM:
            return f"{OOM}|C={c}: {res.log_events.get('oom', [''])[0][:200]}"
        return p

    for c in steps:
        got = do(c, "ladder")
        if isinstance(got, str):
            stop, detail = got.split("|", 1)
            break
        p = got
        if p.verdict != "VALID":
            continue                      # an INVALID point is not a result: it decides nothing, the ladder goes on
        s_ok = [x for x in points if x.status == SUCCESS and x.output_tps is not None and x.role == "ladder"
                and x.verdict == "VALID"]
        if cfg.stop_on_slo and slo.ttft_ms is not None and p.meets_slo is False:
            label, v = p.slo_shown.get("ttft", ("", None))
            if v is not None and v > slo.ttft_ms:
                stop, detail = "TTFT_SLO_EXCEEDED", f"C={c}: {q} TTFT {v:.1f} ms ({label}) > {slo.ttft_ms} ms"
                break
        if cfg.stop_on_slo and slo.tpot_ms is not None and p.meets_slo is False:
            label, v = p.slo_shown.get("tpot", ("", None))
            if v is not None and v > slo.tpot_ms:
                stop, detail = "TPOT_SLO_EXCEEDED", f"C={c}: {q} TPOT {v:.2f} ms ({label}) > {slo.tpot_ms} ms"
                break
        prev = [x for x in s_ok if x is not p]
        if prev and p.output_tps is not None:
            best = max(prev, key=lambda x: x.output_tps or 0)
            if p.output_tps < best.output_tps * (1 - cfg.regression_pct / 100):
                mid = (best.concurrency + c) // 2
                tested = {x.concurrency for x in points}
                if mid not in tested and best.concurrency < mid < c:
                    got_mid = do(mid, "fallback")
                    if isinstance(got_mid, str):
                        stop, detail = got_mid.split("|", 1)
                        break
                stop, detail = "TPS_REGRESSION", (f"C={c}: output TPS {p.output_tps:.1f} < best {best.output_tps:.1f}"
                                                  f" at C={best.concurrency} by > {cfg.regression_pct}%"
                                                  f"; fallback probed C={mid}")
                break
            last = prev[-1]
            if last.output_tps and p.output_tps < last.output_tps * (1 + cfg.saturation_gain_pct / 100):
                stop, detail = "TPS_SATURATED", (f"C={c}: output TPS {p.output_tps:.1f} gained < "
                                                 f"{cfg.saturation_gain_pct}% over {last.output_tps:.1f} at "
                                                 f"C={last.concurrency}")
                break
    ok = [x for x in points if x.status == SUCCESS]
    valid_ok = [x for x in ok if x.verdict == "VALID" and x.output_tps is not None]
    max_succ = max((x.concurrency for x in ok), default=None)
    max_tps = max(valid_ok, key=lambda x: x.output_tps or 0).concurrency if valid_ok else None
    under = [x.concurrency for x in ok if x.meets_slo]
    max_slo = max(under, default=None) if slo.is_set() else None
    _progress(env, f"search done: {len(points)} step(s) in {human_duration(time.monotonic() - t0)}, stopped on "
                   f"{stop} ({detail})", steps=len(points), stop_reason=stop)
    return SearchResult(points, stop, detail, max_succ, max_tps, max_slo, slo.__dict__, cfg.definition)
