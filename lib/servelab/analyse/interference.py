"""Prefill/decode interference computed from the raw records of a case: token gaps, the windows around each
injected long prefill, the damage it does to the decode background, and the ranking of a one-knob sweep.

**Windows per injection** (perf-counter ns from the raw records; a token gap ``[a, b]`` = consecutive token
chunks of one background request, one chunk = one token, checked). *during*: every gap that overlaps
``[send, last chunk of the injected request]`` — the stall a prefill causes ends at about the injected
request's first token and must not leak into *after*; *before*: the ``window_steps × C`` most recent gaps that
end by the send (and start after the previous injection); *after*: the ``window_steps × C`` earliest gaps that
start after the last chunk (and end by the next send). Counting gaps rather than seconds keeps the windows full
when tokens arrive in bursts (a loaded CPU, several tokens in one read). Per
window: token-gap (per-token decode time: TPOT as the streams feel it) P50/P95/P99/max, background output TPS
(token chunks arriving in the window / its length), streams seen, the engine queue (waiting gauge) and, for
llama.cpp, the long request's prompt progress observed on ``/slots`` (prefill chunks). A window outside the
steady span (before every stream ran, or after the streams were told to stop) is INVALID.

**Damage** per injection: ``p95_tpot_increase_ms`` = P95 during − P95 before (and the same in %), the
output-TPS drop, and the long request's TTFT (the other side of the trade).

**Ranking** of the values of a knob: by the least damage to the decode SLO (mean P95 TPOT increase during
injection, in ms), never by prefill TPS. The case that produces the records, its spec, schedule and marks are
measured in :mod:`servelab.measure.interference_case`; :func:`analyse_case` turns a raw case into its tables and
:func:`interference_summary` into its case summary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.case_record import CaseSummary, client_integrity, request_counts, verdict_of
from servelab.measure.engine_metrics import gauge_series
from servelab.measure.interference_case import (InterferenceSpec, Marks, RawInterference, Schedule, SweepPoint,
                                                token_chunk_ns)
from servelab.measure.launch_variants import delta_of, snapshot_deltas
from servelab.measure.records import RequestRecord

WINDOWS = ("before", "during", "after")


# ---------------------------------------------------------------- windows (pure functions of raw records)

def background_gaps(records: list[RequestRecord], role: str = "background") -> pd.DataFrame:
    """Every token gap of the background requests: ``request_id, a_ns, b_ns, gap_ms`` (token chunks)."""
    rows = []
    for r in records:
        if r.role != role or not r.ok:
            continue
        t = token_chunk_ns(r)
        for a, b in zip(t, t[1:]):
            rows.append((r.request_id, a, b, (b - a) / 1e6))
    return pd.DataFrame(rows, columns=["request_id", "a_ns", "b_ns", "gap_ms"])


def injection_spans(records: list[RequestRecord]) -> list[tuple[int, int, RequestRecord]]:
    """(send, last chunk, record) of every injected request, in send order."""
    out = []
    for r in sorted((r for r in records if r.role == "inject" and r.send_ns), key=lambda r: r.send_ns):
        out.append((r.send_ns, max(r.chunk_ns) if r.chunk_ns else r.end_ns, r))
    return out


def mean_clean_gap_ms(gaps: pd.DataFrame, spans: list[tuple[int, int, Any]]) -> float | None:
    """The mean background token gap that overlaps no injection (ms): the undisturbed decode step."""
    if gaps.empty:
        return None
    clean = np.ones(len(gaps), dtype=bool)
    for s, e, _ in spans:
        clean &= ~((gaps["a_ns"] < e) & (gaps["b_ns"] > s)).to_numpy()
    g = gaps["gap_ms"].to_numpy()[clean]
    return float(np.mean(g)) if len(g) else None


def window_gaps(gaps: pd.DataFrame, spans: list[tuple[int, int, Any]], k: int, n_gaps: int
                ) -> dict[str, pd.DataFrame]:
    """The background token gaps of injection ``k``'s three windows.

    *before*: the ``n_gaps`` most recent gaps (latest end, then latest start) that end by the send and start
    after the previous injection's last chunk; *during*: every gap that overlaps ``[send, last chunk]``;
    *after*: the ``n_gaps`` earliest gaps (earliest start, then earliest end) that start after the last chunk
    and end by the next send. Counting gaps (``window_steps × C``) instead of seconds keeps the windows full
    when tokens arrive in bursts.
    """
    send, end, _ = spans[k]
    prev_end = spans[k - 1][1] if k > 0 else None
    next_send = spans[k + 1][0] if k + 1 < len(spans) else None
    if gaps.empty:
        return {w: gaps for w in WINDOWS}
    a, b = gaps["a_ns"], gaps["b_ns"]
    sel_b = (b <= send) & ((a >= prev_end) if prev_end is not None else True)
    # ties broken on the other end so that the chosen set is unique (tokens of one read share a timestamp)
    before = gaps[sel_b].sort_values(["b_ns", "a_ns"], ascending=False, kind="stable").head(n_gaps)
    during = gaps[(a < end) & (b > send)]
    sel_a = (a >= end) & ((b <= next_send) if next_send is not None else True)
    after = gaps[sel_a].sort_values(["a_ns", "b_ns"], kind="stable").head(n_gaps)
    return {"before": before, "during": during, "after": after}


def window_table(records: list[RequestRecord], window_steps: int, concurrency: int, t0_ns: int,
                 steady_ns: int = 0, stop_ns: int = 0, scrape: pd.DataFrame | None = None,
                 waiting_series: str = "") -> pd.DataFrame:
    """One row per injection × window: token-gap percentiles, output TPS, streams, queue, validity.

    Before/after hold ``window_steps × concurrency`` gaps each. ``steady_ns`` / ``stop_ns`` bound the span in
    which all ``C`` streams were decoding (0 = unbounded); a window reaching outside it is INVALID.
    """
    gaps = background_gaps(records)
    spans = injection_spans(records)
    bg = [r for r in records if r.role == "background" and r.ok]
    tokens = np.sort(np.concatenate([np.array(token_chunk_ns(r), dtype=np.int64) for r in bg])) if bg \
        else np.zeros(0, dtype=np.int64)
    n_gaps = window_steps * concurrency
    rows = []
    for k, (send, end, inj) in enumerate(spans):
        for win, g in window_gaps(gaps, spans, k, n_gaps).items():
            if win == "before":
                lo, hi = (int(g["a_ns"].min()) if len(g) else send), send
            elif win == "during":
                lo, hi = send, end
            else:
                lo, hi = end, (int(g["b_ns"].max()) if len(g) else end)
            v = g["gap_ms"].to_numpy()
            dur_s = max(hi - lo, 1) / 1e9
            n_tok = int(((tokens >= lo) & (tokens <= hi)).sum()) if win == "during" else \
                int(((tokens > lo) & (tokens <= hi)).sum())
            reasons = []
            if (steady_ns and lo < steady_ns) or (stop_ns and hi > stop_ns):
                reasons.append("outside the steady span: not every stream was decoding")
            if len(v) == 0:
                reasons.append("no background token gap in this window")
            notes = ""
            if win != "during" and 0 < len(v) < n_gaps:
                notes = f"only {len(v)} of {n_gaps} gaps between the neighbouring injections"
            pct = np.percentile(v, [50, 95, 99]) if len(v) else [None] * 3
            row = {"injection": k, "window": win, "start_s": (lo - t0_ns) / 1e9, "end_s": (hi - t0_ns) / 1e9,
                   "duration_s": dur_s, "n_gaps": int(len(v)),
                   "streams": int(g["request_id"].nunique()) if len(g) else 0,
                   "p50_tpot_ms": pct[0], "p95_tpot_ms": pct[1], "p99_tpot_ms": pct[2],
                   "max_tpot_ms": float(v.max()) if len(v) else None,
                   "mean_tpot_ms": float(v.mean()) if len(v) else None,
                   "output_tokens": n_tok, "output_tps": n_tok / dur_s,
                   "inject_ttft_ms": mx.request_metrics(inj, mx.VLLM_BENCH).ttft_ms if win == "during" else None,
                   "max_waiting": None, "valid": not reasons, "reasons": "; ".join(reasons), "notes": notes}
            if scrape is not None and not scrape.empty and waiting_series:
                q = scrape[(scrape["name"] == waiting_series) & (scrape["ts_ns"] >= lo) & (scrape["ts_ns"] <= hi)]
                row["max_waiting"] = float(q["value"].max()) if not q.empty else None
            rows.append(row)
    cols = ["injection", "window", "start_s", "end_s", "duration_s", "n_gaps", "streams", "p50_tpot_ms",
            "p95_tpot_ms", "p99_tpot_ms", "max_tpot_ms", "mean_tpot_ms", "output_tokens", "output_tps",
            "inject_ttft_ms", "max_waiting", "valid", "reasons", "notes"]
    return pd.DataFrame(rows, columns=cols)


def prefill_chunks(slots: pd.DataFrame, records: list[RequestRecord]) -> pd.DataFrame:
    """The long requests' prompt progress seen on llama.cpp ``/slots``: one row per observed step.

    The injected request is the slot task with ``n_predict == 1``; each increase of its
    ``n_prompt_tokens_processed`` between two polls is one observed step (it holds several engine iterations
    when the poll is slower than the engine).
    """
    cols = ["injection", "id_task", "t_s", "processed_tokens", "step_tokens"]
    if slots is None or slots.empty:
        return pd.DataFrame(columns=cols)
    spans = injection_spans(records)
    inj = slots[(slots["n_predict"] == 1) & slots["is_processing"]].sort_values("ts_ns")
    rows = []
    for task, g in inj.groupby("id_task", sort=False):
        first = int(g["ts_ns"].iloc[0])
        k = next((i for i, (s, e, _) in enumerate(spans) if s - 50_000_000 <= first <= e + 50_000_000), None)
        prev = 0
        for _, r in g.iterrows():
            cur = int(r["n_prompt_tokens_processed"] or 0)
            if cur > prev:
                rows.append({"injection": k, "id_task": task, "t_s": (int(r["ts_ns"]) - spans[k][0]) / 1e9
                             if k is not None else None, "processed_tokens": cur, "step_tokens": cur - prev})
                prev = cur
    return pd.DataFrame(rows, columns=cols)


def injection_table(windows: pd.DataFrame, chunks: pd.DataFrame, records: list[RequestRecord],
                    schedule: list[dict[str, Any]], scrape: pd.DataFrame | None, decode_series: str,
                    t0_ns: int) -> pd.DataFrame:
    """One row per injection: long-request TTFT, P95/P99 token gap before/during/after, damage, chunks, validity."""
    rows = []
    spans = injection_spans(records)
    for k, (send, end, rec) in enumerate(spans):
        w = windows[windows["injection"] == k].set_index("window")
        if w.empty:
            continue
        m = mx.request_metrics(rec, mx.VLLM_BENCH)
        b, d, a = (w.loc[x] for x in WINDOWS)
        inc = (100.0 * (d["p95_tpot_ms"] / b["p95_tpot_ms"] - 1)) if b["p95_tpot_ms"] and d["p95_tpot_ms"] else None
        inc99 = (100.0 * (d["p99_tpot_ms"] / b["p99_tpot_ms"] - 1)) if b["p99_tpot_ms"] and d["p99_tpot_ms"] else None
        drop = (100.0 * (1 - d["output_tps"] / b["output_tps"])) if b["output_tps"] else None
        c = chunks[chunks["injection"] == k] if not chunks.empty else chunks
        decode_calls = None
        if scrape is not None and not scrape.empty and decode_series:
            s = scrape[scrape["name"] == decode_series].sort_values("ts_ns")
            pre = s[s["ts_ns"] <= send]
            post = s[s["ts_ns"] >= end]
            if not pre.empty and not post.empty:
                decode_calls = float(post["value"].iloc[0] - pre["value"].iloc[-1])
        sched = next((x for x in schedule if x.get("injection") == k and x.get("sent")), {})
        reasons = [f"{x}: {w.loc[x, 'reasons']}" for x in WINDOWS if not w.loc[x, "valid"]]
        exact = rec.prompt_tokens == rec.expected_input_tokens and rec.completion_tokens == 1
        if not rec.ok:
            reasons.append(f"injected request failed: {rec.error_kind} {rec.error[:120]}")
        elif not exact:
            reasons.append(f"injected request tokens off target: prompt {rec.prompt_tokens} (want "
                           f"{rec.expected_input_tokens}), output {rec.completion_tokens}")
        inc_ms = (d["p95_tpot_ms"] - b["p95_tpot_ms"]) if b["p95_tpot_ms"] is not None \
            and d["p95_tpot_ms"] is not None else None
        rows.append({"injection": k, "planned_s": sched.get("planned_s"), "sent_s": (send - t0_ns) / 1e9,
                     "inject_prompt_tokens": rec.prompt_tokens, "inject_ttft_ms": m.ttft_ms,
                     "during_s": (end - send) / 1e9,
                     "p95_tpot_before_ms": b["p95_tpot_ms"], "p95_tpot_during_ms": d["p95_tpot_ms"],
                     "p95_tpot_after_ms": a["p95_tpot_ms"], "p99_tpot_before_ms": b["p99_tpot_ms"],
                     "p99_tpot_during_ms": d["p99_tpot_ms"], "max_tpot_during_ms": d["max_tpot_ms"],
                     "p95_tpot_increase_ms": inc_ms, "p95_tpot_increase_pct": inc, "p99_tpot_increase_pct": inc99,
                     "output_tps_before": b["output_tps"], "output_tps_during": d["output_tps"],
                     "output_tps_after": a["output_tps"], "output_tps_drop_pct": drop,
                     "prefill_steps_observed": int(len(c)) if len(c) else None,
                     "prefill_step_tokens": ",".join(str(int(x)) for x in c["step_tokens"]) if len(c) else "",
                     "engine_iterations_during": decode_calls,
                     "max_waiting_during": d.get("max_waiting"),
                     "valid": not reasons, "reasons": "; ".join(reasons)})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- what one case and one sweep value produced

@dataclass
class InterferenceResult:
    spec: InterferenceSpec
    case_dir: Path
    schedule_plan: Schedule
    window_s: float                  # window_steps × the mean clean token gap (the typical window length)
    windows: pd.DataFrame
    injections: pd.DataFrame
    chunks: pd.DataFrame
    timeline: pd.DataFrame           # every background token gap: t_s (its end), gap_ms, request_id
    queue: pd.DataFrame              # running / waiting gauges: t_s, metric, value
    schedule: list[dict[str, Any]]
    marks: Marks
    verdict: mx.Verdict
    background: dict[str, Any]       # background summary (definition named)
    server: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    integrity: dict[str, Any] = field(default_factory=dict)   # request_metrics.integrity of the wave's loop

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per injection for ``summary.csv`` of a run-like record (repeat = injection)."""
        rows = []
        for _, r in self.injections.iterrows():
            rows.append({"case_id": self.spec.case_id, "repeat": int(r["injection"]),
                         "output_tps": r["output_tps_during"], "p95_tpot_ms": r["p95_tpot_during_ms"],
                         "p95_ttft_ms": r["inject_ttft_ms"], "p95_e2e_ms": None,
                         "p95_tpot_before_ms": r["p95_tpot_before_ms"],
                         "p95_tpot_increase_ms": r["p95_tpot_increase_ms"],
                         "p95_tpot_increase_pct": r["p95_tpot_increase_pct"],
                         "output_tps_drop_pct": r["output_tps_drop_pct"],
                         "valid": bool(r["valid"]) and self.verdict.verdict == "VALID"})
        return rows


def analyse_case(raw: RawInterference) -> InterferenceResult:
    """The tables of a raw case (:func:`servelab.measure.interference_case.measure_interference`): windows, gaps,
    prefill chunks, injections, timeline, queue, background summary, the verdict and its reasons, the server's
    counter deltas and CPU use. Writes ``windows.csv``, ``injections.csv`` and (when observed) ``prefill_chunks.csv``
    into the case folder; the summary is the caller's (:func:`interference_summary`, then ``raw.close``)."""
    spec, marks, schedule, bg_recs = raw.spec, raw.marks, raw.schedule, raw.bg_records
    cdir, error = raw.dir, raw.error
    records, scrape, slots, before, after = raw.records, raw.scrape, raw.slots, raw.before, raw.after
    t0 = marks.t0_ns or (records[0].send_ns if records else 0)
    names = raw.metric_names
    gaps = background_gaps(records)
    clean_gap = mean_clean_gap_ms(gaps, injection_spans(records))
    window_s = spec.window_steps * clean_gap / 1e3 if clean_gap else 0.0
    windows = window_table(records, spec.window_steps, spec.concurrency, t0, marks.steady_ns, marks.stop_ns, scrape,
                           names.get("waiting", ""))
    chunks = prefill_chunks(slots, records)
    injections = injection_table(windows, chunks, records, schedule, scrape, names.get("decode_calls_total", ""), t0)
    timeline = pd.DataFrame({"t_s": (gaps["b_ns"] - t0) / 1e9, "gap_ms": gaps["gap_ms"],
                             "request_id": gaps["request_id"]})
    queue = pd.DataFrame(columns=["t_s", "metric", "value"])
    if not scrape.empty:
        q = gauge_series(scrape, names, ("running", "waiting"))
        queue = pd.DataFrame({"t_s": (q["ts_ns"] - t0) / 1e9, "metric": q["metric"], "value": q["value"]})
    span_s = max((marks.end_ns - marks.t0_ns) / 1e9, 1e-9) if marks.end_ns else 1.0
    background = mx.summarize(bg_recs, span_s, raw.definition, roles=("background",)) if bg_recs else {}
    reasons = []
    if error:
        reasons.append(f"error: {error}")
    if background:
        if background["failed"]:
            reasons.append(f"{background['failed']} background request(s) failed")
        if background["token_check"]["mismatches"]:
            reasons.append(f"background tokens off target in {background['token_check']['mismatches']} request(s)")
    if not all(len(token_chunk_ns(r)) == (r.completion_tokens or -1) for r in bg_recs if r.ok):
        reasons.append("a background chunk carried more than one token: token gaps are chunk gaps")
    not_sent = [s for s in schedule if not s.get("sent")]
    if not_sent:
        reasons.append(f"{len(not_sent)} injection(s) not sent: {not_sent[0]['reason']}")
    if injections.empty or not injections["valid"].any():
        reasons.append("no valid injection window")
    integrity = client_integrity(raw.wave_run)      # the wave loop's one monitor: did the client keep up?
    reasons += integrity.get("reasons") or []
    verdict = mx.Verdict("INVALID" if reasons else "VALID", reasons)
    server: dict[str, Any] = {"error": "the case stopped before its counter window opened"}
    try:
        if before is not None and after is not None:
            deltas = snapshot_deltas(before, after)
            server = {k: delta_of(deltas, v) for k, v in names.items() if k.endswith("_total")}
    except ValueError as exc:
        server = {"error": str(exc)}
    wall_s = (after.ts_ns - before.ts_ns) / 1e9 if before is not None and after is not None else 0.0
    cpu0, cpu1 = raw.cpu
    if cpu0 is not None and cpu1 is not None:
        server["server_cpu_s"] = cpu1 - cpu0
        server["server_cpu_util_cores"] = (cpu1 - cpu0) / max(wall_s, 1e-9)
    server["window_s"] = wall_s
    res = InterferenceResult(spec, cdir, raw.plan, window_s, windows, injections, chunks, timeline, queue, schedule,
                             marks, verdict, background, server, raw.launch, integrity)
    windows.to_csv(cdir / "windows.csv", index=False)
    injections.to_csv(cdir / "injections.csv", index=False)
    if not chunks.empty:
        chunks.to_csv(cdir / "prefill_chunks.csv", index=False)
    if raw.status != "success" and verdict.verdict == "VALID":
        res.verdict = mx.Verdict("INVALID", [f"case status {raw.status}"])
    return res


def interference_summary(res: InterferenceResult, status: str, definition: str, records: list[RequestRecord],
                         repeat_of: str = "") -> CaseSummary:
    """The case summary of an interference case: the background's metrics pooled, one repeat per injection
    (the during-window numbers the A/B compares), the schedule, windows and damage in ``details``."""
    repeats = [{"repeat": r["repeat"], "valid": bool(r["valid"]),
                "metrics": {definition: {k: v for k, v in r.items() if k not in ("case_id", "repeat", "valid")}}}
               for r in res.summary_rows()]
    return CaseSummary(
        case_id=res.spec.case_id, phase="", kind="interference", status=status, verdict=verdict_of(res.verdict),
        definition=definition, metrics={definition: res.background} if res.background else {}, repeats=repeats,
        counts=request_counts(records, ("background",)), repeat_of=repeat_of, integrity=res.integrity,
        details={"spec": asdict(res.spec), "schedule_plan": asdict(res.schedule_plan), "window_s": res.window_s,
                 "schedule": res.schedule, "marks": asdict(res.marks),
                 "injections": res.injections.to_dict(orient="records"), "server_deltas": res.server})


# ---------------------------------------------------------------- the sweep: table, ranking, verdict, H4

def sweep_table(points: list[SweepPoint[InterferenceResult]], slo_tpot_ms: float | None = None) -> pd.DataFrame:
    """One row per value: P95 token gap before/during, mean damage over the injections (min–max), TPS drop,
    long-request TTFT, SLO check, validity; ranked by least P95 TPOT increase (never by prefill speed)."""
    rows = []
    for p in points:
        row: dict[str, Any] = {"value": p.label, "knob": p.knob}
        inj = p.result.injections if p.result is not None else pd.DataFrame()
        ok = inj[inj["valid"]] if not inj.empty else inj
        if p.result is None or ok.empty:
            row.update(valid=False, reasons=p.error or (p.result.verdict.reasons if p.result else "no result"))
            rows.append(row)
            continue
        inc = ok["p95_tpot_increase_ms"].astype(float)
        row.update({"injections": len(ok), "p95_tpot_before_ms": ok["p95_tpot_before_ms"].mean(),
                    "p95_tpot_during_ms": ok["p95_tpot_during_ms"].mean(),
                    "p95_tpot_increase_ms": inc.mean(), "increase_min_ms": inc.min(), "increase_max_ms": inc.max(),
                    "p95_tpot_increase_pct": ok["p95_tpot_increase_pct"].astype(float).mean(),
                    "p99_tpot_during_ms": ok["p99_tpot_during_ms"].mean(),
                    "output_tps_drop_pct": ok["output_tps_drop_pct"].astype(float).mean(),
                    "long_request_ttft_ms": ok["inject_ttft_ms"].astype(float).mean(),
                    "prefill_steps_observed": ok["prefill_steps_observed"].mean()
                    if ok["prefill_steps_observed"].notna().any() else None,
                    "valid": p.result.verdict.verdict == "VALID",
                    "reasons": "; ".join(p.result.verdict.reasons)})
        if slo_tpot_ms:
            row["meets_tpot_slo_during"] = bool(ok["p95_tpot_during_ms"].max() <= slo_tpot_ms)
        rows.append(row)
    return rank_values(pd.DataFrame(rows))


def rank_values(table: pd.DataFrame) -> pd.DataFrame:
    """Rank by least mean P95 TPOT increase during injection (ms, during − before: the SLO is in ms, and a
    percentage of a near-zero before-gap explodes), then least TPS drop; invalid values last, unranked."""
    if table.empty:
        return table
    t = table.copy()
    for c in ("p95_tpot_increase_ms", "output_tps_drop_pct"):
        if c not in t.columns:
            t[c] = np.nan
    valid = t["valid"].fillna(False).astype(bool) & t["p95_tpot_increase_ms"].notna()
    ok = t[valid].sort_values(["p95_tpot_increase_ms", "output_tps_drop_pct"], na_position="last")
    ok = ok.assign(rank=range(1, len(ok) + 1))
    bad = t[~valid].assign(rank=None)
    return pd.concat([ok, bad], ignore_index=True)


def sweep_verdict(table: pd.DataFrame, comparison: pd.DataFrame | None = None, baseline: str = "") -> str:
    """One sentence: which value does the least damage to the decode SLO, at what long-request TTFT cost."""
    ok = table[table["rank"].notna()] if "rank" in table.columns else table.iloc[0:0]
    if ok.empty:
        return "no valid value: nothing can be ranked"
    best = ok.iloc[0]
    base = table[table["value"] == baseline].iloc[0] if baseline and (table["value"] == baseline).any() else None
    text = (f"least damage to the decode SLO: {best['value']} (P95 TPOT during injection "
            f"{best['p95_tpot_during_ms']:.1f} ms, {best['p95_tpot_increase_ms']:+.1f} ms over before")
    if base is not None and base["value"] != best["value"] and base.get("valid") \
            and not pd.isna(base.get("p95_tpot_increase_ms")):
        text += (f"; baseline {base['value']}: {base['p95_tpot_during_ms']:.1f} ms, "
                 f"{base['p95_tpot_increase_ms']:+.1f} ms")
        if base.get("long_request_ttft_ms") and best.get("long_request_ttft_ms"):
            text += (f"; cost: long-request TTFT {best['long_request_ttft_ms']:.0f} ms vs "
                     f"{base['long_request_ttft_ms']:.0f} ms")
    text += ")"
    if comparison is not None and not comparison.empty and base is not None:
        c = comparison[(comparison["metric"] == "p95_tpot_ms") & (comparison["b_run"].astype(str)
                                                                  .str.endswith(str(best["value"])))]
        if not c.empty:
            text += f"; A/B verdict on P95 TPOT vs the baseline: {c.iloc[0]['verdict']}"
    return text


def h4_evidence(injections: pd.DataFrame) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H4 from one case's valid injections: *supported* when every injection's
    P95 token gap during the prefill exceeds the largest P95 before any injection; *refuted* when none does."""
    ok = injections[injections["valid"]] if not injections.empty else injections
    if ok.empty:
        return "inconclusive", "no valid injection window", {}
    before_max = float(ok["p95_tpot_before_ms"].max())
    during = ok["p95_tpot_during_ms"].astype(float)
    nums = {"p95_tpot_before_max_ms": before_max, "p95_tpot_during_min_ms": float(during.min()),
            "p95_tpot_increase_ms_mean": float(ok["p95_tpot_increase_ms"].mean()), "injections": int(len(ok))}
    if (during > before_max).all():
        return "supported", (f"every long prefill raised the background's P95 token gap: {during.min():.1f}–"
                             f"{during.max():.1f} ms during vs at most {before_max:.1f} ms before "
                             f"({nums['p95_tpot_increase_ms_mean']:+.1f} ms on average)"), nums
    if (during <= before_max).all():
        return "refuted", (f"no long prefill raised the P95 token gap above the before windows' "
                           f"{before_max:.1f} ms"), nums
    return "inconclusive", "some injections raised the P95 token gap, some did not", nums
