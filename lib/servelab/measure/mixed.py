"""M1, the mixed A/B: a decode background at fixed concurrency, with and without one injected long prefill.

Protocol (``docs/method.md#mixed-ab``): run the finite decode background (control); run the same background again
(new prompts of the same shape, so no prefix-cache reuse) and, ``inject_after_s`` after its measurement
window starts, send one long prefill (ISL → 1, C 1, no warm-up) outside the concurrency cap (treatment).
Compare control vs treatment on the background's output TPS and P95 TTFT / TPOT / E2E, and look at the ITL of
the background in time windows before / during / after the injection (during = from the injected request's
send to its last chunk). Control windows use the same offsets from its own window start.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.case import CaseEnv, CaseResult, CaseSpec, case_seed, run_case, sizing_kw
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.records import ClientRun, RequestRecord, read_records
from servelab.measure.workload import build_workload

COMPARE_KEYS = ("output_throughput", "p95_ttft_ms", "p95_tpot_ms", "p95_e2el_ms", "p50_itl_ms", "p99_itl_ms",
                "max_itl_ms")


def m1_run_fn(env: CaseEnv, case: CaseSpec, cfg: ClientConfig, repeat: int) -> ClientRun:
    """One M1 wave: ``num_prompts`` decode requests at ``concurrency`` (sized: until ``min_duration_s`` has passed
    too), plus the injection for the treatment."""
    sized = sizing_kw(env, case, repeat)
    wl = build_workload(case.case_id, 0 if sized else case.num_prompts, case.input_tokens, case.output_tokens,
                        env.pool, seed=case_seed(env.seed, case.case_id, repeat), role="measure")
    injections = []
    if case.inject_input_tokens:
        inj = build_workload(case.case_id + "-inject", 1, case.inject_input_tokens, 1, env.pool,
                             seed=case_seed(env.seed, case.case_id + "/inject", repeat), role="inject",
                             start_index=2 * 10**6)
        injections = [(case.inject_after_s, inj.requests[0])]
    return run_requests(wl.requests, cfg, concurrency=case.concurrency, repeat=repeat, injections=injections,
                        **sized)


def run_m1_case(env: CaseEnv, case: CaseSpec) -> CaseResult:
    """``run_case`` with the M1 wave; the treatment also gets its injection's own metrics in ``extra``."""
    def injection(records: list[RequestRecord]) -> dict[str, Any]:
        inj = [r for r in records if r.role == "inject"]
        return {"injection": {d: [mx.request_metrics(r, d).__dict__ for r in inj] for d in mx.DEFINITIONS}}
    return run_case(env, case, run_fn=m1_run_fn, extra_fn=injection if case.inject_input_tokens else None)


def injection_window_ns(records: list[RequestRecord]) -> tuple[int, int] | None:
    """(send, last chunk) of the injected request, perf_counter ns; None without one."""
    inj = [r for r in records if r.role == "inject" and r.send_ns]
    if not inj:
        return None
    r = inj[0]
    end = max(r.chunk_ns) if r.chunk_ns else r.end_ns
    return r.send_ns, end


def itl_timeline(records: list[RequestRecord], window_start_ns: int, run: str, definition: str = mx.VLLM_BENCH
                 ) -> pd.DataFrame:
    """Every background ITL as a point: ``t_s`` (chunk arrival, s from the window start), ``itl_ms``, run."""
    rows = []
    for r in records:
        if r.role != "measure" or not r.ok:
            continue
        sel = [i for i, c in enumerate(r.chunk_choices) if c] if definition == mx.VLLM_BENCH else \
            [i for i, t in enumerate(r.chunk_text) if t]
        for a, b in zip(sel, sel[1:]):
            rows.append({"t_s": (r.chunk_ns[b] - window_start_ns) / 1e9,
                         "itl_ms": (r.chunk_ns[b] - r.chunk_ns[a]) / 1e6, "request_id": r.request_id, "run": run})
    return pd.DataFrame(rows, columns=["t_s", "itl_ms", "request_id", "run"])


def window_stats(timeline: pd.DataFrame, start_s: float, end_s: float) -> pd.DataFrame:
    """ITL p50/p95/p99/max and count per window (before / during / after) and run."""
    def which(t: float) -> str:
        return "before" if t < start_s else ("during" if t <= end_s else "after")
    if timeline.empty:
        return pd.DataFrame(columns=["run", "window", "n", "p50_itl_ms", "p95_itl_ms", "p99_itl_ms", "max_itl_ms"])
    tl = timeline.assign(window=timeline["t_s"].map(which))
    rows = []
    for (run, win), g in tl.groupby(["run", "window"]):
        v = g["itl_ms"].to_numpy()
        p = np.percentile(v, [50, 95, 99])
        rows.append({"run": run, "window": win, "n": len(v), "p50_itl_ms": p[0], "p95_itl_ms": p[1],
                     "p99_itl_ms": p[2], "max_itl_ms": float(v.max())})
    order = {"before": 0, "during": 1, "after": 2}
    return pd.DataFrame(rows).sort_values(["run", "window"], key=lambda s: s.map(order) if s.name == "window" else s
                                          ).reset_index(drop=True)


def ab_compare(control: CaseResult, treatment: CaseResult, definition: str = mx.VLLM_BENCH) -> pd.DataFrame:
    """Control vs treatment on the background: value, value, change % per metric (``definition`` named)."""
    c, t = control.summaries.get(definition, {}), treatment.summaries.get(definition, {})
    rows = []
    for k in COMPARE_KEYS:
        a, b = c.get(k), t.get(k)
        rows.append({"metric": k, "control": a, "treatment": b,
                     "change_pct": (100.0 * (b - a) / a) if a not in (None, 0) and b is not None else None,
                     "definition": definition})
    return pd.DataFrame(rows)


def m1_analysis(control: CaseResult, treatment: CaseResult, definition: str = mx.VLLM_BENCH) -> dict[str, Any]:
    """A/B table, injection metrics, ITL timeline of both runs and per-window ITL stats (first repeat)."""
    crec = [r for r in read_records(control.case_dir / "requests.jsonl") if r.repeat == 0 and r.role != "warmup"]
    trec = [r for r in read_records(treatment.case_dir / "requests.jsonl") if r.repeat == 0 and r.role != "warmup"]

    def start(recs: list[RequestRecord]) -> int:
        return min(r.scheduled_ns for r in recs if r.role == "measure")
    c0, t0 = start(crec), start(trec)
    tl = pd.concat([itl_timeline(crec, c0, "control", definition), itl_timeline(trec, t0, "treatment", definition)],
                   ignore_index=True)
    win = injection_window_ns(trec)
    inj_start_s = (win[0] - t0) / 1e9 if win else treatment.case.inject_after_s
    inj_end_s = (win[1] - t0) / 1e9 if win else inj_start_s
    inj = [r for r in trec if r.role == "inject"]
    return {"ab": ab_compare(control, treatment, definition), "timeline": tl,
            "windows": window_stats(tl, inj_start_s, inj_end_s), "inject_start_s": inj_start_s,
            "inject_end_s": inj_end_s,
            "injection": mx.request_frame(inj, definition) if inj else pd.DataFrame(), "definition": definition}
