"""The Phase 1 quick matrix (P1–P4, D1–D4, M1): its cases per scale, which wave each runs, and the loop that
runs them.

Matrix (``docs/method.md#cases``), scaled by ``target.scale``:

| case | cluster | local (2-core CPU, llama.cpp slots) | goal |
|---|---|---|---|
| P1 | 1K → 1, C 1 | 64 → 1, C 1 | fixed overhead, minimum TTFT |
| P2 | 32K → 1, C 1 | 256 → 1, C 1 | mid-length prefill |
| P3 | 128K → 1, C 1 | 768 → 1, C 1 | long prefill, memory pressure |
| P4 | 32K → 1, C 4 / 16 | 256 → 1, C 2 / 4 | prefill throughput, chunked prefill |
| D1 | 1K → 1K, C 1 | 64 → 64, C 1 | single-request TPOT |
| D2 | 1K → 1K, C 16 / 32 / 64 | 64 → 64, C 4 / 8 / 16 | decode throughput, batching |
| D3 | 1K → 4K, C 16 | 64 → 256, C 4 | long-output decode (the context grows while decoding) |
| D4 | 32K → 1K, C 16 | 512 → 64, C 4 | decode at a long context (attention over a long KV) |
| M1 | decode 1K → 1K C 32 + one 128K → 1 injected 10 s in | decode 64 → 128 C 8 + one 768 → 1 at 2 s | prefill interference |

11 fixed points + M1 (control, treatment, and the injected request). D3 and D4 run at D2's lowest concurrency, so
each differs from that D2 point in one length only (the Phase 1 page compares their TPOT with it). Lengths never exceed
the serving capacity: an input that does not fit the per-request context (llama.cpp: context / slots) is
clamped, and the reason is written into the case (``docs/method.md#capacity``: if 128K is not available, lower it and
record why).

Rules (``docs/method.md#rules``): one warm-up for short prefill and decode points (P1, D1, D2, M1's background), none for
the long prefill points (P2, P3, P4, the injection); prefix cache flushed after the warm-up (llama.cpp has no
flush endpoint: every request then sends ``cache_prompt: false``, recorded in ``meta.json``); every matrix case is
*sized* (``docs/case.md#sizing``, MLPerf LoadGen's rule): it keeps issuing requests at its concurrency until both
``min_duration_s`` has passed and ``num_prompts`` requests were sent — concurrency-1 cases get a request count
scaled by prompt cost (:func:`c1_requests`: many for P1, fewer for the longest prompts), concurrent ones at least two
waves; quick runs do this once, milestones 3 repeats with the CV checked (≤ 3 %); a failed case is recorded
and the matrix continues; a server that loses health aborts the run (``ENGINE_CRASH``), keeping what was
measured; resume skips a case only if its ``meta.json`` says success and its ``requests.jsonl`` re-parses;
cases not executed are listed.

While the matrix runs, :func:`run_matrix` appends "case i of n" events (elapsed, a naive estimate of what is
left) to ``<run>/<phase>/progress.jsonl`` (:func:`servelab.core.run.emit_progress`). One case — its spec, its
routine on the case runner, its files — is :mod:`servelab.measure.case`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.case import (OOM, SUCCESS, CaseEnv, CaseResult, CaseSpec, case_is_done, load_case_result,
                                   max_request_tokens, run_case)
from servelab.measure.case_runner import ENGINE_CRASH, EngineCrash
from servelab.measure.mixed import run_m1_case
from servelab.core import signals
from servelab.core.params import ParamError, did_you_mean
from servelab.core.run import emit_progress, human_duration, merge_table, now_iso

LONG_PREFILL = ("P2", "P3", "P4")          # no same-shape warm-up (expensive 32K/128K points)

SCALES: dict[str, dict[str, Any]] = {
    "cluster": {"P1": 1024, "P2": 32768, "P3": 131072, "P4": 32768, "P4_c": (4, 16), "D_in": 1024, "D_out": 1024,
                "D2_c": (16, 32, 64), "D3_out": 4096, "D4_in": 32768, "M1_c": 32, "M1_out": 1024,
                "M1_inject": 131072, "M1_after_s": 10.0,
                "min_window_s": 5.0, "min_requests": 200, "decode_weight": 50},
    "local": {"P1": 64, "P2": 256, "P3": 768, "P4": 256, "P4_c": (2, 4), "D_in": 64, "D_out": 64,
              "D2_c": (4, 8, 16), "D3_out": 256, "D4_in": 512, "M1_c": 8, "M1_out": 128, "M1_inject": 768,
              "M1_after_s": 2.0,
              "min_window_s": 0.5, "min_requests": 100, "decode_weight": 10},
}
C1_MIN_REQUESTS = 8          # the fewest requests a concurrency-1 case sends, however long its prompt
MIN_WAVES = 2                # a concurrent case sends at least this many waves of C requests


def c1_requests(input_tokens: int, output_tokens: int, ref_cost: float, min_requests: int,
                decode_weight: float) -> int:
    """Requests of a concurrency-1 case, scaled by prompt cost: ``min_requests`` for the cheapest shape
    (``ref_cost``, P1's), proportionally fewer for costlier ones, never fewer than :data:`C1_MIN_REQUESTS`.
    A request's cost is its prompt tokens plus ``decode_weight`` × its output tokens (a decoded token costs
    about that many prefilled ones)."""
    cost = input_tokens + decode_weight * output_tokens
    n = round(min_requests * ref_cost / cost) if cost > 0 else min_requests
    return int(max(min(C1_MIN_REQUESTS, min_requests), min(min_requests, n)))


def _fit(case: CaseSpec, limit: int | None) -> CaseSpec:
    for attr in ("input_tokens", "inject_input_tokens"):
        out = case.output_tokens if attr == "input_tokens" else 1
        want = getattr(case, attr)
        if limit is not None and want and want + out > limit:
            got = limit - out
            setattr(case, attr, got)
            case.notes.append(f"{attr} clamped from {want} to {got}: a request may hold {limit} tokens "
                              f"(prompt + {out} output) on this target")
    return case


def quick_matrix(target: Any, cases: list[str] | None = None, min_duration_s: float = 0.0,
                 min_requests: int = 0) -> list[CaseSpec]:
    """The fixed quick matrix for ``target`` (scale from ``target.scale``); ``cases`` filters by id or scenario.

    Every case is sized (``docs/case.md#sizing``): ``min_duration_s`` (0: the scale's ``min_window_s``) is both
    how long it keeps issuing requests and the shortest window its verdict accepts; ``min_requests`` (0: the
    scale's) is P1's request count, the other concurrency-1 cases get fewer by prompt cost (:func:`c1_requests`),
    concurrent cases at least :data:`MIN_WAVES` waves. M1 runs at least twice its injection delay, so the
    background surrounds the injected prefill."""
    scale = getattr(target, "scale", "local")
    if scale not in SCALES:
        raise ValueError(f"target.scale must be one of {sorted(SCALES)}, got {scale!r}")
    if min_duration_s < 0 or min_requests < 0:
        raise ParamError(f"min_duration_s and min_requests must be >= 0 (got {min_duration_s}, {min_requests})")
    s = SCALES[scale]
    w = float(min_duration_s or s["min_window_s"])
    nmin = int(min_requests or s["min_requests"])
    wt = s["decode_weight"]
    limit = max_request_tokens(target)

    def c1(case_id: str, scenario: str, kind: str, isl: int, osl: int, warm: bool, purpose: str) -> CaseSpec:
        c = _fit(CaseSpec(case_id, scenario, kind, isl, osl, 1, 1, warm, purpose, min_window_s=w,
                          min_duration_s=w), limit)
        c.num_prompts = c1_requests(c.input_tokens, c.output_tokens, s["P1"] + wt * 1, nmin, wt)
        return c

    def cc(case_id: str, scenario: str, kind: str, isl: int, osl: int, c: int, warm: bool, purpose: str,
           dur: float = w, **kw: Any) -> CaseSpec:
        return _fit(CaseSpec(case_id, scenario, kind, isl, osl, c, MIN_WAVES * c, warm, purpose, min_window_s=dur,
                             min_duration_s=dur, **kw), limit)

    out = [c1("P1", "P1", "prefill", s["P1"], 1, True, "fixed overhead and minimum TTFT"),
           c1("P2", "P2", "prefill", s["P2"], 1, False, "mid-length prefill"),
           c1("P3", "P3", "prefill", s["P3"], 1, False, "long prefill and memory pressure")]
    out += [cc(f"P4_c{c}", "P4", "prefill", s["P4"], 1, c, False, "prefill throughput (chunked prefill)")
            for c in s["P4_c"]]
    out.append(c1("D1", "D1", "decode", s["D_in"], s["D_out"], True, "single-request TPOT"))
    out += [cc(f"D2_c{c}", "D2", "decode", s["D_in"], s["D_out"], c, True, "decode throughput") for c in s["D2_c"]]
    c3 = s["D2_c"][0]
    out.append(cc(f"D3_c{c3}", "D3", "decode", s["D_in"], s["D3_out"], c3, True, "long-output decode"))
    out.append(cc(f"D4_c{c3}", "D4", "decode", s["D4_in"], s["D_out"], c3, False, "decode at a long context"))
    m1 = max(w, 2 * s["M1_after_s"])
    out.append(cc("M1_control", "M1", "mixed", s["D_in"], s["M1_out"], s["M1_c"], True,
                  "decode background without injection", dur=m1))
    out.append(cc("M1_treatment", "M1", "mixed", s["D_in"], s["M1_out"], s["M1_c"], True,
                  "same decode background + one long prefill", dur=m1, inject_input_tokens=s["M1_inject"],
                  inject_after_s=s["M1_after_s"]))
    if cases:
        known = {c.case_id for c in out} | {c.scenario for c in out}
        for name in cases:
            if name not in known:
                raise ParamError(f"unknown case '{name}'{did_you_mean(name, known)}; cases: {sorted(known)}")
        out = [c for c in out if c.case_id in cases or c.scenario in cases]
    return out


def dispatch_case(env: CaseEnv, case: CaseSpec) -> CaseResult:
    """Which wave a case runs: M1 cases need the injection wave; every other case is a plain closed-loop wave.

    Phase 1 runs its matrix with it; Phase 2 replays the same cases under the hardware collectors; ``servelab case``
    re-runs one case through it."""
    return run_m1_case(env, case) if case.scenario == "M1" else run_case(env, case)


# ---------------------------------------------------------------- running the matrix

@dataclass
class MatrixResult:
    results: list[CaseResult]
    skipped: list[str]                    # resumed: already done
    not_executed: list[str]               # aborted before they ran
    aborted: str = ""                     # why the run stopped early ("" = it did not)
    restarts: list[dict[str, Any]] = field(default_factory=list)

    def frame(self, definition: str | None = None) -> pd.DataFrame:
        defs = [definition] if definition else list(mx.DEFINITIONS)
        return pd.DataFrame([r.row(d) for r in self.results for d in defs])


def run_matrix(env: CaseEnv, cases: list[CaseSpec], resume: bool = False,
               case_runner: Callable[[CaseEnv, CaseSpec], CaseResult] | None = None,
               on_oom: Callable[[CaseEnv, CaseResult], CaseEnv] | None = None) -> MatrixResult:
    """Run ``cases`` in order. A failed case is recorded and the matrix goes on; ENGINE_CRASH stops it.

    ``resume``: a case whose dir passes ``case_is_done`` is loaded, not re-run. ``on_oom(env, result)``
    must restart the engine and return the new env (``docs/method.md#oom-restart``: never measure on after an OOM
    without a restart); without it an OOM stops the run. Writes ``summary.csv`` over all cases.
    """
    runner = case_runner or run_case
    results: list[CaseResult] = []
    skipped: list[str] = []
    aborted = ""
    restarts: list[dict[str, Any]] = []
    done_ids: list[str] = []
    t0 = time.monotonic()
    ran, ran_s = 0, 0.0
    for i, case in enumerate(cases, 1):
        cdir = env.run_dir / "cases" / case.case_id
        if resume and case_is_done(cdir, case.num_prompts * env.repeats):
            results.append(load_case_result(case, cdir))
            results[-1].status = SUCCESS
            skipped.append(case.case_id)
            done_ids.append(case.case_id)
            _progress(env, f"case {i} of {len(cases)}: {case.case_id} already measured, skipped (resume)",
                      i=i, n=len(cases), case_id=case.case_id, skipped=True)
            continue
        elapsed = time.monotonic() - t0
        # naive: the mean time of the cases run so far, times the cases left (this one included)
        eta = ran_s / ran * (len(cases) - i + 1) if ran else None
        _progress(env, f"case {i} of {len(cases)}: {case.case_id} … ({human_duration(elapsed)} elapsed"
                       + (f", about {human_duration(eta)} left)" if eta is not None else ")"),
                  i=i, n=len(cases), case_id=case.case_id, elapsed_s=round(elapsed, 1),
                  eta_s=None if eta is None else round(eta, 1))
        t_case = time.monotonic()
        try:
            res = runner(env, case)
        except EngineCrash as exc:
            aborted = f"{ENGINE_CRASH}: {exc}"
            if (cdir / "summary.json").exists():
                results.append(load_case_result(case, cdir))
            done_ids.append(case.case_id)
            break
        except KeyboardInterrupt:
            # the user stopped the run (docs/method.md#case-policy): keep what was measured, list what was not
            # executed; the interrupted case's row (status INTERRUPTED) replaces any earlier one in summary.csv
            aborted = f"STOPPED_BY_USER during {case.case_id}"
            if (cdir / "summary.json").exists():
                try:
                    results.append(load_case_result(case, cdir))
                except (OSError, ValueError):
                    pass
            break
        ran, ran_s = ran + 1, ran_s + time.monotonic() - t_case
        results.append(res)
        done_ids.append(case.case_id)
        if res.status == OOM:
            if on_oom is None:
                aborted = f"{OOM}: {case.case_id} (no restart hook; never measure on after an OOM without a restart)"
                break
            env = on_oom(env, res)
            restarts.append({"after": case.case_id, "reason": OOM, "when": now_iso()})
    not_executed = [c.case_id for c in cases if c.case_id not in done_ids]
    valid = sum(r.verdict.verdict == "VALID" for r in results)
    _progress(env, f"matrix done: {len(results)} of {len(cases)} cases in {human_duration(time.monotonic() - t0)}, "
                   f"{valid} VALID" + (f"; stopped: {aborted}" if aborted else ""),
              n=len(cases), done=len(results), valid=valid, aborted=aborted)
    mr = MatrixResult(results, skipped, not_executed, aborted, restarts)
    write_summary_csv(env.run_dir, mr)
    if aborted.startswith("STOPPED_BY_USER") and signals.received():
        # a signal (SIGTERM to the kernel or the run) means stop, not "render what was measured": the interrupt
        # goes on once summary.csv holds every case (Ctrl-C in a notebook keeps the page path)
        raise KeyboardInterrupt(f"{aborted} (signal {signals.received()})")
    return mr


def _progress(env: CaseEnv, message: str, **fields: Any) -> None:
    emit_progress(env.run_dir, env.phase, message, step="matrix", **fields)


SUMMARY_KEYS = ["case_id", "definition"]      # a row of summary.csv / matrix.csv is one case under one definition


def write_summary_csv(run_dir: Path, mr: MatrixResult) -> Path:
    """``<run>/summary.csv``: one row per case × definition (both definitions, each row says which), merged by
    case: this invocation's cases replace their earlier rows, the cases it did not run keep theirs."""
    path = Path(run_dir) / "summary.csv"
    merge_table(path, mr.frame(), SUMMARY_KEYS)
    return path


LONG_DECODE = {"D3": "long output", "D4": "long context"}


def long_decode_table(frame: pd.DataFrame) -> pd.DataFrame:
    """D3 (long output) and D4 (long context) against the D2 point at the same concurrency, which differs from each
    in one length only: P50 TPOT and output TPS of both, and the TPOT change. Only VALID cases are compared; a pair
    with an INVALID side says so in ``note`` and carries no change."""
    cols = ["case", "what", "ISL → OSL", "C", "P50 TPOT (ms)", "D2 case", "D2 P50 TPOT (ms)", "TPOT change (%)",
            "output TPS (tok/s)", "D2 output TPS (tok/s)", "note"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    by_id = {r["case_id"]: r for r in frame.to_dict("records")}
    for r in frame[frame["scenario"].isin(list(LONG_DECODE))].to_dict("records"):
        ref = by_id.get(f"D2_c{int(r['concurrency'])}")
        bad = [x["case_id"] for x in (r, ref) if x is not None and x["validity"] != "VALID"]
        note = ("no D2 point at this concurrency" if ref is None else
                f"{', '.join(bad)} INVALID: not compared" if bad else "")
        ok = not note and r.get("p50_tpot_ms") is not None and ref.get("p50_tpot_ms")
        rows.append({"case": r["case_id"], "what": LONG_DECODE[r["scenario"]],
                     "ISL → OSL": f"{int(r['input_len'])} → {int(r['output_len'])}", "C": int(r["concurrency"]),
                     "P50 TPOT (ms)": r.get("p50_tpot_ms"), "D2 case": ref["case_id"] if ref else "—",
                     "D2 P50 TPOT (ms)": ref.get("p50_tpot_ms") if ref else None,
                     "TPOT change (%)": (100.0 * (r["p50_tpot_ms"] / ref["p50_tpot_ms"] - 1)) if ok else None,
                     "output TPS (tok/s)": r.get("output_throughput"),
                     "D2 output TPS (tok/s)": ref.get("output_throughput") if ref else None, "note": note})
    return pd.DataFrame(rows, columns=cols)


def long_decode_sentence(table: pd.DataFrame) -> str | None:
    """The Phase 1 finding about D3/D4: TPOT at long output / long context against the same-C D2 point."""
    if table.empty:
        return None
    parts = []
    for r in table.to_dict("records"):
        if r["TPOT change (%)"] is None or pd.isna(r["TPOT change (%)"]):
            parts.append(f"{r['case']} ({r['what']}) {r['note'] or 'no TPOT'}")
        else:
            parts.append(f"{r['case']} ({r['what']}, {r['ISL → OSL']}) P50 TPOT {r['P50 TPOT (ms)']:.2f} ms vs "
                         f"{r['D2 case']} {r['D2 P50 TPOT (ms)']:.2f} ms ({r['TPOT change (%)']:+.0f} %)")
    return "Long decode against D2 at the same concurrency: " + "; ".join(parts) + "."
