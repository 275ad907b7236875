"""Speculative decoding, computed from what a point recorded: acceptance from counter deltas over the exact
measurement window, the window checks, target forwards and CPU use, the net gain against speculation off, the
per-position acceptance, and their figures.

**Acceptance** (never a running average such as SGLang's ``avg_spec_accept_length``):

- acceptance rate = Δaccepted_tokens / Δdraft_tokens;
- mean acceptance length = 1 + Δaccepted_tokens / Δdrafts (verification steps);
- per-position acceptance = Δaccepted_per_pos[i] / Δdrafts.

llama.cpp adds a request's speculative stats to its counters when the request ends, so the window must hold
whole requests; it is checked: Δ``tokens_predicted_total`` must equal the measured requests' completion
tokens, and the counters must equal the per-request ``draft acceptance = … (a accepted / g generated)`` lines
of the engine log in the same window.

**Overhead and net gain** are measured against the same cases with speculation off (same engine build, same
settings otherwise): output TPS and TPOT per concurrency; the mean wall time per target forward
(window / Δ``n_decode_total``: a llama.cpp target ``llama_decode`` call, which holds the verification batch) and
the tokens each target forward yields; the draft overhead per target step = step time with speculation − step
time without; the engine's CPU utilisation over the window (``/proc``: an engine waiting on its own threads or
on the client is idle CPU — the local stand-in for the GPU-timeline bubbles of Phase 3).

The points themselves are measured by :mod:`servelab.measure.spec_points`; a point's row and its case summary
are judged here (:func:`spec_point_row`, :func:`spec_point_summary`), the phase composes them
(``phase9_speculative``).
"""
from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

import pandas as pd

from servelab.core.facts import MIN_SAMPLES, enough, indicative
from servelab.measure import request_metrics as mx
from servelab.measure.case_record import CaseSummary, client_integrity, judged_row, request_counts
from servelab.measure.records import RequestRecord
from servelab.measure.launch_variants import Snapshot, delta_of, snapshot_deltas
from servelab.measure.spec_points import RawSpecPoint, SpecConfig
from servelab.deploy.engines import engine_for
from servelab.deploy.server import RunningServer


# ---------------------------------------------------------------- acceptance from counter deltas

def acceptance(deltas: pd.DataFrame, metric_names: dict[str, str], engine: str) -> dict[str, Any]:
    """Acceptance rate, mean acceptance length and per-position acceptance from counter deltas."""
    drafts = delta_of(deltas, metric_names.get("spec_drafts_total", ""))
    draft_tokens = delta_of(deltas, metric_names.get("spec_draft_tokens_total", ""))
    accepted = delta_of(deltas, metric_names.get("spec_accepted_tokens_total", ""))
    out: dict[str, Any] = {"d_drafts": drafts, "d_draft_tokens": draft_tokens, "d_accepted": accepted,
                           "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                           "mean_accept_length": 1 + accepted / drafts if drafts else None}
    series = metric_names.get("spec_accepted_per_pos_total") or engine_for(engine).spec_per_position_series
    per_pos = {}
    if series and not deltas.empty and drafts:
        sel = deltas[deltas["name"] == series]
        for _, r in sel.iterrows():
            m = re.search(r"position=(\d+)", r["labels"])
            if m:
                per_pos[int(m.group(1))] = r["delta"] / drafts
    out["per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def log_acceptance(log_text: str, pattern: str) -> dict[str, int]:
    """Σ accepted and Σ generated draft tokens from the engine's per-request acceptance log lines (``pattern``:
    the adapter's ``log_markers["draft_acceptance"]``, groups ``acc`` and ``gen``; llama.cpp's
    ``draft acceptance = … (a accepted / g generated)``)."""
    acc = gen = n = 0
    for m in re.finditer(pattern, log_text):
        acc += int(m.group("acc"))
        gen += int(m.group("gen"))
        n += 1
    return {"log_requests": n, "log_accepted": acc, "log_generated": gen}


# ---------------------------------------------------------------- one point's row

def spec_row(srv: RunningServer, cfg: SpecConfig, concurrency: int, repeat: int, records: list[RequestRecord],
             run: Any, before: Snapshot, after: Snapshot, cpu0: float | None, cpu1: float | None, log_text: str,
             definition: str, error: str) -> dict[str, Any]:
    """One row: acceptance (deltas), checks, latency/throughput, target forwards, CPU use, validity."""
    names = srv.engine.metric_names
    measured = [r for r in records if r.role == "measure"]
    row: dict[str, Any] = {"config": cfg.label, "speculative": cfg.enabled, "draft": cfg.draft or "-",
                           "num_draft_tokens": cfg.num_draft_tokens if cfg.enabled else 0,
                           "concurrency": concurrency, "repeat": repeat}
    reasons = [f"error: {error}"] if error else []
    window_s = (after.ts_ns - before.ts_ns) / 1e9
    row["window_s"] = window_s
    try:
        deltas = snapshot_deltas(before, after)
    except ValueError as exc:
        deltas = pd.DataFrame()
        reasons.append(str(exc))
    acc = acceptance(deltas, names, srv.target.engine) if not deltas.empty else {}
    row.update({k: v for k, v in acc.items() if k != "per_position"})
    if cfg.as_served:
        # an attached server as served: it speculates if its draft counters moved over the window (None: it
        # exposes no such counter, so whether it speculates cannot be read from outside)
        drafts = acc.get("d_drafts")
        row["speculative"] = bool(drafts)
        row["draft"] = "as served" if drafts else ("none (no draft counted)" if drafts is not None
                                                    else "unknown (no draft counter)")
    row["per_position"] = acc.get("per_position", [])
    gen = delta_of(deltas, names.get("generation_tokens_total", "")) if not deltas.empty else None
    fwd = delta_of(deltas, names.get("decode_calls_total", "")) if not deltas.empty else None
    want = sum(int(r.completion_tokens or 0) for r in measured if r.ok)
    row["d_generated"] = gen
    row["window_matches_requests"] = (gen is not None and int(gen) == want)
    if gen is not None and int(gen) != want:
        reasons.append(f"counter window holds {gen:.0f} generated tokens, the measured requests {want}: "
                       "the window is not exact")
    accept_re = srv.engine.log_markers.get("draft_acceptance")
    if accept_re and cfg.enabled:        # as served: an attached server's log is not servelab's to read
        la = log_acceptance(log_text, accept_re)
        row.update(la)
        row["log_matches_counters"] = (acc.get("d_accepted") is not None and la["log_requests"] > 0
                                       and la["log_accepted"] == int(acc["d_accepted"])
                                       and la["log_generated"] == int(acc["d_draft_tokens"] or 0))
        if not acc.get("d_drafts"):
            reasons.append("speculation on but no draft was verified in the window (counters did not move)")
    row["target_forwards"] = fwd
    row["target_forwards_per_s"] = fwd / window_s if fwd else None
    row["tokens_per_target_forward"] = gen / fwd if gen and fwd else None
    row["step_ms"] = 1e3 * window_s / fwd if fwd else None
    if cpu0 is not None and cpu1 is not None:
        threads = int(srv.target.launch.get("threads") or 1)
        util = (cpu1 - cpu0) / max(window_s, 1e-9)
        row["server_cpu_util_cores"] = util
        row["server_cpu_idle_pct"] = max(0.0, 100.0 * (1 - util / threads))
    if run is not None and measured:
        s = mx.summarize(measured, max(run.duration_s, 1e-9), definition)
        row.update({"completed": s["completed"], "failed": s["failed"], "output_throughput": s["output_throughput"],
                    "p50_tpot_ms": s["p50_tpot_ms"], "p95_tpot_ms": s["p95_tpot_ms"], "p50_ttft_ms": s["p50_ttft_ms"],
                    "p50_e2el_ms": s["p50_e2el_ms"], "duration_s": run.duration_s,
                    # what the percentiles rest on, and the max a page shows where too few values hold one
                    "n_tpot": s["n_tpot"], "max_tpot_ms": s["max_tpot_ms"], "n_ttft": s["n_ttft"],
                    "max_ttft_ms": s["max_ttft_ms"]})
        if s["failed"]:
            reasons.append(f"{s['failed']} request(s) failed: {s['errors_by_kind']}")
        if s["token_check"]["mismatches"] and not cfg.synth_rates:
            reasons.append(f"achieved tokens off target in {s['token_check']['mismatches']} request(s)")
    done = row.get("completed")
    if done is not None and not enough("throughput", done):      # the sample-size rule (core.facts)
        reasons.append(f"{indicative(done)}: fewer than {MIN_SAMPLES['throughput']} completed requests make no "
                       "throughput point")
    row["validity"] = "INVALID" if reasons else "VALID"
    row["reasons"] = "; ".join(reasons)
    row["definition"] = definition
    return row


def spec_point_row(raw: RawSpecPoint) -> dict[str, Any]:
    """A measured point's row (:func:`spec_row`) with its case id; a client that fell behind makes the point
    INVALID in its row too, so the table and ``summary.json`` agree."""
    cpu0, cpu1 = raw.cpu
    row = spec_row(raw.case.srv, raw.config, raw.concurrency, raw.repeat, raw.records, raw.run, raw.before, raw.after,
                   cpu0, cpu1, raw.log_text, raw.definition, raw.error)
    row["case_id"] = raw.case_id
    behind = client_integrity(raw.run).get("reasons") or []
    if behind:
        row["validity"] = "INVALID"
        row["reasons"] = "; ".join([x for x in [row.get("reasons") or ""] if x] + list(behind))
    return row


ACCEPTANCE_KEYS = ("acceptance_rate", "mean_accept_length", "tokens_per_target_forward", "step_ms",
                   "server_cpu_idle_pct")


def spec_point_summary(cfg: SpecConfig, row: dict[str, Any], records: list[RequestRecord], run: Any, status: str,
                       definition: str, repeat: int, repeat_of: str) -> CaseSummary:
    """The case summary of a speculative point: the row's verdict, the measured requests' metrics (with the
    acceptance numbers beside them) as repeat ``repeat`` of ``repeat_of``, the row in ``details``."""
    pooled, judged = judged_row(records, run, definition, row.get("validity") == "VALID", row.get("reasons"), status)
    rep = {definition: {**pooled[definition], **{k: row.get(k) for k in ACCEPTANCE_KEYS}}} if pooled else {}
    return CaseSummary(
        case_id=row["case_id"], phase="", kind="speculative", status=status,
        verdict=judged, definition=definition, metrics=pooled,
        repeats=[{"repeat": repeat, "metrics": rep}] if rep else [], counts=request_counts(records),
        repeat_of=repeat_of, integrity=client_integrity(run), details={"config": asdict(cfg),
                                      "row": {k: v for k, v in row.items() if k not in ("validity", "reasons")}})


# ---------------------------------------------------------------- net gain vs the baseline

def net_gain(points: pd.DataFrame) -> pd.DataFrame:
    """Per speculative config and concurrency, against ``off`` at the same concurrency (means over the VALID
    repeats): output-TPS gain, TPOT change, draft overhead per target step, acceptance — never acceptance alone.

    Every speculative (config, concurrency) that ran has a row: where either side has no VALID repeat the row's
    verdict is ``invalid``, its gain empty and ``reasons`` says which side failed and why (a point does not vanish
    from the table because it could not be compared). A run with no ``off`` point at all (an attached server
    measured as served) gives each speculating config's own acceptance and throughput, verdict ``no baseline``;
    a config whose drafts never moved has no row."""
    if points.empty:
        return pd.DataFrame()
    ok = points[points["validity"] == "VALID"]
    keys = ["output_throughput", "p50_tpot_ms", "p95_tpot_ms", "step_ms", "tokens_per_target_forward",
            "acceptance_rate", "mean_accept_length", "server_cpu_idle_pct"]
    mean = ok.groupby(["config", "concurrency"], sort=False)[[k for k in keys if k in ok.columns]].mean()
    rows = []
    drafted = points["speculative"].fillna(False).astype(bool) if "speculative" in points.columns \
        else points["config"] != "off"
    speculating = set(points.loc[drafted, "config"])
    no_off = "off" not in set(points["config"])
    for (config, c) in points[["config", "concurrency"]].drop_duplicates().itertuples(index=False):
        if config == "off" or config not in speculating:      # nothing drafted (an attached server as served)
            continue
        if no_off:       # no baseline in the run at all (an attached server as served): its own side, no gain
            own = mean.loc[(config, c)] if (config, c) in mean.index else pd.Series(dtype=float)
            rows.append({"config": config, "concurrency": c, "acceptance_rate": own.get("acceptance_rate"),
                         "mean_accept_length": own.get("mean_accept_length"),
                         "output_tps_spec": own.get("output_throughput"), "net_gain_pct": None,
                         "verdict": "no baseline", "reasons": "no speculation-off point in this run"
                         + ("" if (config, c) in mean.index else "; " + _why_not_valid(points, config, c))})
            continue
        missing = [_why_not_valid(points, side, c) for side in (config, "off") if (side, c) not in mean.index]
        if missing:
            rows.append({"config": config, "concurrency": c, "net_gain_pct": None, "verdict": "invalid",
                         "reasons": "; ".join(missing)})
            continue
        r, b = mean.loc[(config, c)], mean.loc[("off", c)]
        reps = ok[(ok["config"] == config) & (ok["concurrency"] == c)]
        breps = ok[(ok["config"] == "off") & (ok["concurrency"] == c)]
        gain = 100.0 * (r["output_throughput"] / b["output_throughput"] - 1) if b["output_throughput"] else None
        spread = None
        if len(reps) > 1 and len(breps) > 1:
            spread = (f"spec {reps['output_throughput'].min():,.1f}–{reps['output_throughput'].max():,.1f}, "
                      f"off {breps['output_throughput'].min():,.1f}–{breps['output_throughput'].max():,.1f}")
        rows.append({"config": config, "concurrency": c, "acceptance_rate": r.get("acceptance_rate"),
                     "mean_accept_length": r.get("mean_accept_length"),
                     "output_tps_off": b["output_throughput"], "output_tps_spec": r["output_throughput"],
                     "net_gain_pct": gain,
                     "p50_tpot_off_ms": b["p50_tpot_ms"], "p50_tpot_spec_ms": r["p50_tpot_ms"],
                     "step_ms_off": b.get("step_ms"), "step_ms_spec": r.get("step_ms"),
                     "draft_overhead_ms_per_step": (r.get("step_ms") - b.get("step_ms"))
                     if r.get("step_ms") is not None and b.get("step_ms") is not None else None,
                     "tokens_per_target_forward_off": b.get("tokens_per_target_forward"),
                     "tokens_per_target_forward_spec": r.get("tokens_per_target_forward"),
                     "cpu_idle_pct_off": b.get("server_cpu_idle_pct"),
                     "cpu_idle_pct_spec": r.get("server_cpu_idle_pct"),
                     "repeats": int(len(reps)), "repeat_range": spread,
                     "verdict": "gain" if gain is not None and gain > 0 else "loss", "reasons": ""})
    cols = ["config", "concurrency", "acceptance_rate", "mean_accept_length", "output_tps_off", "output_tps_spec",
            "net_gain_pct", "p50_tpot_off_ms", "p50_tpot_spec_ms", "step_ms_off", "step_ms_spec",
            "draft_overhead_ms_per_step", "tokens_per_target_forward_off", "tokens_per_target_forward_spec",
            "cpu_idle_pct_off", "cpu_idle_pct_spec", "repeats", "repeat_range", "verdict", "reasons"]
    return pd.DataFrame(rows, columns=cols)


def _why_not_valid(points: pd.DataFrame, config: str, c: Any) -> str:
    """One clause: why ``config`` at concurrency ``c`` has no VALID repeat (its points' reasons, or that none ran)."""
    side = points[(points["config"] == config) & (points["concurrency"] == c)]
    if side.empty:
        return f"{config} did not run at C={c}"
    why = sorted({str(x) for x in side.get("reasons", pd.Series(dtype=str)).dropna() if str(x)})
    return f"{config} at C={c}: no VALID repeat" + (f" ({'; '.join(why)})" if why else "")


def per_position_frame(points: pd.DataFrame) -> pd.DataFrame:
    """Per config, concurrency and draft position: Δaccepted_pos / Δdrafts (long format)."""
    rows = []
    for _, r in points[points["speculative"]].iterrows():
        for i, v in enumerate(r.get("per_position") or []):
            rows.append({"config": r["config"], "concurrency": r["concurrency"], "repeat": r["repeat"],
                         "position": i, "acceptance": v})
    return pd.DataFrame(rows, columns=["config", "concurrency", "repeat", "position", "acceptance"])
