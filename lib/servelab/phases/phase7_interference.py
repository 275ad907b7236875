"""Phase 7 — prefill/decode interference: a decode background, periodic long prefills, and one-knob sweeps.

**The case** (``docs/method.md#interference``): a decode background held at concurrency ``C`` — ``C`` closed-loop streams, each
sending its next request (ISL → OSL, unique prompt) as soon as the previous one finished, the first requests
shortened in steps of OSL/C so that the streams never change requests in lockstep — and, once every stream is
past its prefill (two warm-up TTFTs) and a settle time has passed, a long prefill (ISL_long → 1, C 1, no
warm-up) injected ``n`` times. Injection ``k`` is sent at ``max(start + k·period, end of injection k−1 + quiet
gap)``: periodic, but never on top of the previous one. After the last injection and one more quiet gap the
streams stop taking new requests. Settle and quiet gap default to two estimated windows (``window_steps`` × the
decode warm-up's TPOT). The steady span used for validity is measured, not assumed: from the latest first token
of the streams' first requests to the stop. Lengths scale with ``target.scale``.

**Knob sweep** (``docs/method.md#knobs``): the same case for each value of ONE launch setting, the engine restarted per value
(llama.cpp ``batch_size`` — its per-iteration token budget, which decode tokens fill first and prompt chunks
share: the analogue of SGLang's ``chunked_prefill_size`` — ``ubatch_size``, ``parallel``; SGLang
``chunked_prefill_size``, ``max_prefill_tokens``, ``max_running_requests``). A setting the engine ignores
(same command for two values) is refused before anything starts. Each value is written as a run-like record
(``manifest.json`` + ``cases.json`` naming the case's ``summary.json``, one repeat per injection) and compared with
:func:`servelab.measure.abtest.ab_compare` with the knob as the declared variable. The verdict ranks values by the
least damage to the decode SLO (mean P95 TPOT increase during injection, in ms), never by prefill TPS. Each
engine's default sweep and confounding setting come from its adapter (``interference_sweep``,
``confound_setting``).

The windows around each injection, the damage, the ranking of a sweep and the figures are computed in
:mod:`servelab.analyse.interference` from the raw records this module writes; this module runs the case, the
sweep and the A/B, writes the phase tables and holds the page's views and the H4 ledger entry.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import plotly.graph_objects as go

from servelab.analyse.interference import (InterferenceResult, InterferenceSpec, Marks, Schedule, SweepPoint,
                                           background_gaps, h4_evidence, injection_spans, injection_table,
                                           mean_clean_gap_ms, plan_schedule, prefill_chunks, steady_from_records,
                                           sweep_table, sweep_verdict, token_chunk_ns, window_table)
from servelab.analyse.interference_figures import timeline_figure
from servelab.measure import request_metrics as mx
from servelab.measure.case import case_seed, max_request_tokens
from servelab.measure.case_record import client_integrity, CaseSummary, request_counts, verdict_of
from servelab.measure.case_runner import CaseRun, Warmup
from servelab.measure.client import ClientConfig, run_async, run_sync
from servelab.measure.records import ClientRun, RequestRecord, read_records
from servelab.measure.loop_monitor import LoopMonitor
from servelab.measure.engine_metrics import gauge_series
from servelab.measure.launch_variants import (delta_of, snapshot_deltas, write_run_record, serving, with_launch,
                                              check_knob_changes_command, log_reproduce, env_changes)
from servelab.core.run import write_json_atomic, read_manifest, write_json_atomic as wj
from servelab.deploy.server import RunningServer
from servelab.measure.workload import RequestSpec, build_workload, engine_tokenizer, token_pool
from servelab.deploy.engines import engine_for
from servelab.analyse.serverside import case_serverside
from servelab.core.params import did_you_mean, param, ParamError, PhaseParams
from servelab.core.paths import path_slug
from servelab.measure.abtest import ab_compare
from servelab.report import ab_figures
from servelab.report.banner import banner
from servelab.report.findings import ab_findings
from servelab.report.ledger import record_evidence
from servelab.report.perf_figures import client_over_server
from servelab.measure.abtest import answers_from_params, write_ab_tables
from servelab.report.answers import record_correctness
from servelab.measure.correctness import greedy_summary
from servelab.measure.correctness import prompts_view
from servelab.measure.correctness import verdict_sentences
from servelab.phases.context import PhaseContext

SCALES: dict[str, dict[str, Any]] = {
    "cluster": {"background_input_tokens": 1024, "background_output_tokens": 1024, "concurrency": 32,
                "inject_input_tokens": 131072, "n_injections": 3, "window_steps": 16},
    "local": {"background_input_tokens": 32, "background_output_tokens": 32, "concurrency": 4,
              "inject_input_tokens": 192, "n_injections": 2, "window_steps": 6},
}
# the tiny random model decodes ~1000x faster than Gemma-3-270M on the same CPU: longer streams and a longer
# prefill keep its windows above the timer and scheduler noise (local scale otherwise)
MODEL_SCALES: dict[str, dict[str, Any]] = {
    "tiny": {"background_output_tokens": 256, "inject_input_tokens": 1536, "window_steps": 16},
}
# the A/B metrics of the sweep records (True = higher is better)
AB_METRICS = {"p95_tpot_ms": False, "output_tps": True, "p95_ttft_ms": False}


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 7's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase7 --cell``); ``-p`` and ``params/phase7.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase7"
    knob: str = param("", "the ONE launch setting swept; empty: batch_size on llama.cpp, chunked_prefill_size on SGLang")
    values: list = param([], "its values, the baseline first; empty: the engine's default sweep (llama.cpp: 2048, 32)")
    n_injections: int = param(0, "long prefills per value; 0: the scale's (2 locally, 3 on a cluster)")
    inject_input_tokens: int = param(0, "length of the long prefill; 0: the scale's (192 locally, 131072 on a cluster)")
    concurrency: int = param(0, "decode background concurrency; 0: the scale's (4 locally, 32 on a cluster)")
    background_input_tokens: int = param(0, "per background request; 0: the scale's (32 locally, 1024 on a cluster)")
    background_output_tokens: int = param(0, "per background request; 0: the scale's (32 locally, 1024 on a cluster)")
    window_steps: int = param(0, "before and after windows hold this many token gaps per stream; 0: the scale's")
    confound_demo: bool = param(True, "one extra run that changes the knob AND a second setting, to show the confound flag")
    confound_setting: dict = param({}, "that second setting; empty: ubatch_size 8 on llama.cpp")
    slo_tpot_ms: float = param(0.0, "decode TPOT SLO checked against P95 during injection; 0: none")
    definition: str = param(mx.VLLM_BENCH, "metric definition of the background summary: vllm or sglang [one of vllm, sglang]")
    seed: int = param(0, "workload seed (unique random token-id prompts)")
    ab_why: str = param("", "A/B question 2: why should this knob touch the current bottleneck")
    ab_profile_change: str = param("", "A/B question 5: how did the profile evidence change")
    ab_risk: str = param("", "A/B question 6: accuracy, stability or memory risk")
    ab_keep: str = param("", "A/B question 7: keep it")


def default_spec(target: Any, case_id: str = "I7", **over: Any) -> InterferenceSpec:
    """The scaled case for ``target`` (``over`` replaces fields; 0 / empty keeps the default)."""
    s = dict(SCALES[getattr(target, "scale", "local")])
    if getattr(target, "scale", "local") == "local":
        s.update(MODEL_SCALES.get(str(target.model), {}))
    spec = InterferenceSpec(case_id=case_id, **s)
    known = set(InterferenceSpec.__dataclass_fields__)
    for k, v in over.items():
        if k not in known:
            raise ParamError(f"unknown interference setting '{k}'{did_you_mean(k, known)}")
        if v:
            setattr(spec, k, v)
    limit = max_request_tokens(target)
    if limit is not None:
        if spec.inject_input_tokens + 1 > limit:
            spec.notes.append(f"inject_input_tokens clamped from {spec.inject_input_tokens} to {limit - 1}: a request "
                              f"may hold {limit} tokens on this target")
            spec.inject_input_tokens = limit - 1
        if spec.background_input_tokens + spec.background_output_tokens > limit:
            raise ValueError(f"background {spec.background_input_tokens} + {spec.background_output_tokens} tokens "
                             f"exceed the {limit} a request may hold on this target")
    return spec


# ---------------------------------------------------------------- the wave: background streams and injections

async def _wave(bg: list[RequestSpec], inj: list[RequestSpec], cfg: ClientConfig, spec: InterferenceSpec,
                sched: Schedule) -> tuple[list[RequestRecord], list[RequestRecord], list[dict[str, Any]], Marks,
                                          ClientRun]:
    """C closed-loop background streams + the injector, in one event loop, watched by one loop-lag monitor.

    The first injection is due two warm-up TTFTs (every stream past its prefill) plus the settle time after the
    start; ``Marks.steady_ns`` is then measured from the records (see :func:`steady_from_records`). An injection's
    record keeps when it was due (``scheduled_ns``) and when its timer woke (``ready_ns``): its lateness is dispatch
    lag. Returns the records, the schedule, the marks and the loop's ``ClientRun`` (every request, the monitor's
    samples) for the integrity record.
    """
    async with LoopMonitor() as mon:
        out = await _wave_body(bg, inj, cfg, spec, sched)
    bg_records, inj_records = out[0], out[1]
    return (*out, mon.client_run(bg_records + inj_records, concurrency=spec.concurrency))


async def _wave_body(bg: list[RequestSpec], inj: list[RequestSpec], cfg: ClientConfig, spec: InterferenceSpec,
                     sched: Schedule) -> tuple[list[RequestRecord], list[RequestRecord], list[dict[str, Any]], Marks]:
    marks = Marks(t0_ns=time.perf_counter_ns())
    stop = asyncio.Event()
    bg_records: list[RequestRecord] = []
    queue = list(bg)
    cap = spec.max_background_requests or 200

    async def stream() -> None:
        n = 0
        while not stop.is_set() and queue and n < cap:
            s = queue.pop(0)
            run = await run_async([s], cfg, concurrency=1, monitor_interval_s=None)
            bg_records.extend(run.records)
            n += 1

    streams = [asyncio.create_task(stream()) for _ in range(spec.concurrency)]
    inj_records: list[RequestRecord] = []
    schedule: list[dict[str, Any]] = []
    settle_ns = int(sched.first_inject_s * 1e9)
    gap_ns = int(sched.quiet_gap_s * 1e9)
    marks.settle_ns = settle_ns
    try:
        prev_end: int | None = None
        start = marks.t0_ns + int(2 * sched.warmup_ttft_s * 1e9) + settle_ns
        for k, s in enumerate(inj):
            planned = start + int(k * spec.period_s * 1e9)
            due = planned if prev_end is None else max(planned, prev_end + gap_ns)
            await asyncio.sleep(max(0.0, (due - time.perf_counter_ns()) / 1e9))
            if all(t.done() for t in streams):
                schedule.append({"injection": k, "planned_s": (planned - marks.t0_ns) / 1e9, "sent": False,
                                 "reason": "the background had ended (request cap or prompts exhausted)"})
                continue
            woke = time.perf_counter_ns()
            run = await run_async([s], cfg, concurrency=1, monitor_interval_s=None)
            rec = run.records[0]
            rec.scheduled_ns, rec.ready_ns = due, woke          # the injection timer's lateness is dispatch lag
            inj_records.append(rec)
            prev_end = max(rec.chunk_ns) if rec.chunk_ns else rec.end_ns
            schedule.append({"injection": k, "planned_s": (planned - marks.t0_ns) / 1e9,
                             "due_s": (due - marks.t0_ns) / 1e9, "sent": True,
                             "sent_s": (rec.send_ns - marks.t0_ns) / 1e9, "reason": ""})
        await asyncio.sleep(gap_ns / 1e9)               # room for the last injection's after window
    finally:
        marks.stop_ns = time.perf_counter_ns()
        stop.set()
        await asyncio.gather(*streams)
        marks.end_ns = time.perf_counter_ns()
    marks.steady_ns = steady_from_records(bg_records, spec.concurrency)
    return bg_records, inj_records, schedule, marks


# ---------------------------------------------------------------- one case on a running server


def run_interference(srv: RunningServer, run_dir: Path, spec: InterferenceSpec, pool: list[int], seed: int = 0,
                     definition: str = mx.VLLM_BENCH, poll_interval_s: float = 0.0, phase: str = "phase7",
                     repeat_of: str = "") -> InterferenceResult:
    """Warm up, plan, run the background streams with their injections; raw data first, then the tables.

    Files: ``cases/<case_id>/{meta.json, requests.jsonl, server/{metrics.parquet, slots.parquet,
    metrics_{before,after}.prom, engine_log_excerpt.txt}, windows.csv, injections.csv, summary.json}``, written
    through the case runner (:class:`servelab.measure.case_runner.CaseRun`): one repeat per injection.
    ``repeat_of``: the case this one is a variant of (a sweep value runs ``I7`` as ``I7_<label>``).
    """
    case = CaseRun(srv, run_dir, spec.case_id, phase, "interference", {
        "spec": asdict(spec), "engine": srv.target.engine, "base_url": srv.base_url, "launch": srv.target.launch,
        "definition": definition}, definition=definition, measured_roles=("background",))
    cdir, meta = case.dir, case.meta
    plan = Schedule(0.0, 0.0, 0.0, 0.0, 0.0)
    bg_recs: list[RequestRecord] = []
    inj_recs: list[RequestRecord] = []
    schedule: list[dict[str, Any]] = []
    marks = Marks()
    wave_run: ClientRun | None = None
    plan_error = ""
    with case:
        cfg = case.client_config()
        # decode warm-up at the background's shape (docs/method.md#warmup: decode points yes, the long prefill no)
        wrecs = case.warm_up(case.client_warmup(cfg, pool, Warmup(
            spec.concurrency, spec.background_input_tokens, 8, case_seed(seed, spec.case_id + "/warmup", 0),
            spec.concurrency)))
        try:
            plan = plan_schedule(spec, wrecs)
        except RuntimeError as exc:
            plan_error = str(exc)
        meta["schedule_plan"] = asdict(plan)
        case.flush()
        n_bg = spec.concurrency * (spec.max_background_requests or 200)
        bg = build_workload(spec.case_id, n_bg, spec.background_input_tokens, spec.background_output_tokens, pool,
                            seed=case_seed(seed, spec.case_id, 0), role="background").requests
        # stagger the streams: equal lengths would keep them in lockstep, all between two requests at the same
        # moment — an injection landing there would hide behind their new prefills instead of stalling tokens
        step = spec.background_output_tokens // spec.concurrency
        for i in range(1, min(spec.concurrency, len(bg))):
            bg[i] = replace(bg[i], output_tokens=max(2, spec.background_output_tokens - i * step))
        inj = build_workload(spec.case_id + "-inject", spec.n_injections, spec.inject_input_tokens, 1, pool,
                             seed=case_seed(seed, spec.case_id + "/inject", 0), role="inject",
                             start_index=2 * 10**6).requests
        interval = poll_interval_s or float(min(0.25, max(0.02, plan.window_estimate_s / 4)))
        case.open_window(server_cpu=True)
        case.watch(scrape_interval_s=max(interval, 0.05), poll_interval_s=interval)
        if not plan_error:
            bg_recs, inj_recs, schedule, marks, wave_run = run_sync(lambda: _wave(bg, inj, cfg, spec, plan))
        case.add(bg_recs + inj_recs)
    error = plan_error or case.error
    records, scrape, slots, before, after = case.records, case.scrape, case.slots, case.before, case.after
    write_json_atomic(cdir / "server" / "marks.json", asdict(marks))
    t0 = marks.t0_ns or (records[0].send_ns if records else 0)
    names = srv.engine.metric_names
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
    background = mx.summarize(bg_recs, span_s, definition, roles=("background",)) if bg_recs else {}
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
    integrity = client_integrity(wave_run)          # the wave loop's one monitor: did the client keep up?
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
    cpu0, cpu1 = case.cpu
    if cpu0 is not None and cpu1 is not None:
        server["server_cpu_s"] = cpu1 - cpu0
        server["server_cpu_util_cores"] = (cpu1 - cpu0) / max(wall_s, 1e-9)
    server["window_s"] = wall_s
    res = InterferenceResult(spec, cdir, plan, window_s, windows, injections, chunks, timeline, queue, schedule,
                             marks, verdict, background, server, dict(srv.target.launch), integrity)
    windows.to_csv(cdir / "windows.csv", index=False)
    injections.to_csv(cdir / "injections.csv", index=False)
    if not chunks.empty:
        chunks.to_csv(cdir / "prefill_chunks.csv", index=False)
    status = "success" if not error else "failed"
    if status != "success" and verdict.verdict == "VALID":
        res.verdict = mx.Verdict("INVALID", [f"case status {status}"])
    case.close(interference_summary(res, status, definition, records, repeat_of), status, error)
    return res


def interference_summary(res: InterferenceResult, status: str, definition: str, records: list[RequestRecord],
                         repeat_of: str = "") -> Any:
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


# ---------------------------------------------------------------- the knob sweep


def run_variant(target: Any, changes: dict[str, Any], spec: InterferenceSpec, run_dir: Path, record_root: Path,
                label: str, log_dir: Path, phase: str = "", seed: int = 0, definition: str = mx.VLLM_BENCH,
                parent_manifest: dict[str, Any] | None = None, health_timeout_s: float = 300.0
                ) -> tuple[InterferenceResult | None, Path, str]:
    """Serve ``target`` with ``changes``, run the case as ``<case_id>_<label>``, write the run-like record."""
    t = with_launch(target, changes, label)
    slug = path_slug(label)                  # a knob value such as ../../x never leaves record_root
    case = replace(spec, case_id=f"{spec.case_id}_{slug}", notes=list(spec.notes))
    rec_dir = Path(record_root) / slug
    res, error = None, ""
    srv_ref = None
    try:
        with serving(t, log_dir, run_dir, phase, health_timeout_s, check_env=env_changes(changes)) as srv:
            srv_ref = srv
            pool = token_pool(engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path,
                                               headers=srv.auth_headers), seed=seed)
            res = run_interference(srv, run_dir, case, pool, seed, definition, phase=phase or "phase7",
                                   repeat_of=spec.case_id)
    except Exception as exc:  # a value that cannot serve is recorded, the sweep goes on
        error = f"{type(exc).__name__}: {exc}"
    # the same case id on every side of the A/B; a value that did not run is listed with its reason
    cases = [(spec.case_id, res.case_dir if res is not None else None, error)]
    write_run_record(rec_dir, f"{(parent_manifest or {}).get('run_id', 'run')}-{slug}", t, srv_ref, cases,
                     parent_manifest)
    write_json_atomic(rec_dir / "variant.json", {"label": label, "changes": changes, "error": error,
                                                 "case_dir": str(res.case_dir) if res is not None else None})
    return res, rec_dir, error


def knob_sweep(target: Any, knob: str, values: list[Any], spec: InterferenceSpec, run_dir: Path, record_root: Path,
               log_dir: Path, phase: str = "", seed: int = 0, definition: str = mx.VLLM_BENCH,
               parent_manifest: dict[str, Any] | None = None) -> list[SweepPoint]:
    """The same case for each value of ONE launch setting, the engine restarted per value (first = baseline)."""
    check_knob_changes_command(target, knob, values)
    out = []
    for v in values:
        label = f"{knob}={v}"
        res, rec, err = run_variant(target, {knob: v}, spec, run_dir, record_root, label, log_dir, phase, seed,
                                    definition, parent_manifest)
        out.append(SweepPoint(knob, v, res, rec, err))
    return out


# ---------------------------------------------------------------- Phase 7 end to end

@dataclass
class Phase7Result:
    knob: str
    values: list[Any]
    sweep: list[SweepPoint]
    table: pd.DataFrame
    ab: Any                                  # abtest.ABResult over the sweep records (or None)
    confound: SweepPoint | None
    confound_ab: Any
    verdict: str
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> InterferenceResult | None:
        return self.sweep[0].result if self.sweep else None

    @property
    def not_executed(self) -> list[str]:
        """The sweep values whose case did not run."""
        return [p.label for p in self.sweep if p.result is None]

    def findings(self) -> list[str]:
        return findings(self)

    def headline(self) -> dict[str, Any]:
        out: dict[str, Any] = {"knob": self.knob, "values": [str(v) for v in self.values], "verdict": self.verdict}
        b = self.baseline
        if b is not None and b.verdict.verdict != "VALID":
            out["baseline"] = f"{self.sweep[0].label} INVALID: not a result"
        elif b is not None and not b.injections.empty:
            ok = b.injections[b.injections["valid"]]
            if not ok.empty:
                out["baseline_p95_tpot_before_ms"] = round(float(ok["p95_tpot_before_ms"].mean()), 2)
                out["baseline_p95_tpot_during_ms"] = round(float(ok["p95_tpot_during_ms"].mean()), 2)
                out["baseline_long_ttft_ms"] = round(float(ok["inject_ttft_ms"].mean()), 1)
        ranked = self.table[self.table["rank"].notna()] if "rank" in self.table.columns else self.table.iloc[0:0]
        if not ranked.empty:
            out["least_damage"] = str(ranked.iloc[0]["value"])
        if self.confound_ab is not None:
            out["confounded_ab_flagged"] = bool(self.confound_ab.confounded)
        return out


def run(ctx: PhaseContext) -> Phase7Result:
    """Phase 7's entry (the phase contract), from the notebook's parameters (``ctx.params``): the case under each value
    of one knob (baseline first), the A/B over them, the confounded demonstration, the ranking by least damage."""
    p = ctx.params
    plan = plan_sweep(ctx, p)
    log_reproduce(ctx, "phase7")
    sweep = knob_sweep(ctx.target, plan.knob, plan.values, plan.spec, ctx.run_dir, plan.record_root, plan.log_dir,
                       phase=ctx.phase, seed=p.seed, definition=p.definition, parent_manifest=plan.parent)
    notes = list(plan.spec.notes)
    ab = _ab_over_sweep(plan, sweep, answers_from_params(p.as_dict()), notes)
    confound, confound_ab = _confound_demo(ctx, p, plan, sweep[0])
    table = sweep_table(sweep, p.slo_tpot_ms or None)
    verdict = sweep_verdict(table, ab.comparison if ab is not None else None, sweep[0].label)
    res = Phase7Result(plan.knob, plan.values, sweep, table, ab, confound, confound_ab, verdict, notes)
    write_phase7_tables(ctx.phase_dir, res)
    return res


@dataclass(frozen=True)
class SweepPlan:
    """What every run of the sweep shares: knob, values (baseline first), case, record and log folders, run manifest."""
    knob: str
    values: list[Any]
    spec: InterferenceSpec
    record_root: Path
    log_dir: Path
    parent: dict[str, Any]


def plan_sweep(ctx: PhaseContext, p: Params) -> SweepPlan:
    """The knob (empty: the engine's default) and its values (empty: the engine's default sweep, for the default
    knob; fewer than two are refused) and the case scaled to the target (a size parameter 0 keeps the scale's)."""
    d_knob, d_values = engine_for(ctx.target.engine).interference_sweep
    knob = p.knob or d_knob
    values = list(p.values) if p.values else ([] if knob != d_knob else list(d_values))
    if not knob or len(values) < 2:
        raise ParamError(f"phase 7 needs a knob and at least two values (got knob={knob!r}, values={values!r})")
    sizes = ("n_injections", "inject_input_tokens", "concurrency", "background_input_tokens", "background_output_tokens",
             "window_steps")                   # the parameters that size the case, as InterferenceSpec names them
    spec = default_spec(ctx.target, "I7", **{k: getattr(p, k) for k in sizes})
    return SweepPlan(knob, values, spec, ctx.phase_dir / "ab", ctx.phase_dir / "server", read_manifest(ctx.run_dir))


def _ab_over_sweep(plan: SweepPlan, sweep: list[SweepPoint], answers: dict[str, str], notes: list[str]) -> Any:
    """The A/B over the sweep's records with the knob as the declared variable; None (and a note) when it fails."""
    try:
        return ab_compare([pt.record_dir for pt in sweep], plan.knob, answers=answers, metrics=AB_METRICS)
    except Exception as exc:
        notes.append(f"A/B over the sweep failed: {exc}")
        return None


def _confound_demo(ctx: PhaseContext, p: Params, plan: SweepPlan, baseline: SweepPoint) -> tuple[SweepPoint | None, Any]:
    """With ``confound_demo``: the knob's second value plus ``confound_setting`` (empty: the engine's) as one more
    variant, compared with the baseline — an A/B that must be flagged as confounded. ``(None, None)`` without it."""
    setting = dict(p.confound_setting or engine_for(ctx.target.engine).confound_setting) if p.confound_demo else {}
    if not setting:
        return None, None
    knob, second = plan.knob, plan.values[1]
    label = f"{knob}={second}+" + ",".join(f"{k}={v}" for k, v in setting.items())
    res, rec, err = run_variant(ctx.target, {knob: second, **setting}, plan.spec, ctx.run_dir, plan.record_root, label,
                                plan.log_dir, phase=ctx.phase, seed=p.seed, definition=p.definition, parent_manifest=plan.parent)
    return SweepPoint(knob, second, res, rec, err, dict(setting)), ab_compare([baseline.record_dir, rec], knob,
                                                                             metrics=AB_METRICS)


def write_phase7_tables(phase_dir: Path, res: Phase7Result) -> None:
    """``sweep.csv``, ``injections.csv`` / ``windows.csv`` (all values), ``ab_*.csv`` (differences, comparison, the
    greedy outputs compared, the seven questions), ``phase7.json``."""
    phase_dir.mkdir(parents=True, exist_ok=True)
    res.table.to_csv(phase_dir / "sweep.csv", index=False)
    pts = res.sweep + ([res.confound] if res.confound else [])
    inj = [p.result.injections.assign(value=p.label) for p in pts if p.result is not None]
    win = [p.result.windows.assign(value=p.label) for p in pts if p.result is not None]
    if inj:
        pd.concat(inj, ignore_index=True).to_csv(phase_dir / "injections.csv", index=False)
    if win:
        pd.concat(win, ignore_index=True).to_csv(phase_dir / "windows.csv", index=False)
    if res.ab is not None:
        write_ab_tables(res.ab, phase_dir)
    record_correctness(phase_dir.parent, phase_dir.name)      # the A/B's greedy-output verdicts as facts (M4)
    if res.confound_ab is not None:
        res.confound_ab.differences.to_csv(phase_dir / "ab_confounded_differences.csv", index=False)
    wj(phase_dir / "phase7.json", {"headline": res.headline(), "notes": res.notes})


# ---------------------------------------------------------------- what the notebook shows

def case_table(res: Phase7Result, which: str = "baseline") -> pd.DataFrame:
    """Per injection of the baseline value (or a label): TTFT, P95 before/during/after, damage, chunks
    (every column in ``phase7/injections.csv``)."""
    p = res.sweep[0] if which == "baseline" else next((x for x in res.sweep if x.label == which), None)
    if p is None or p.result is None:
        return pd.DataFrame({"note": [f"no result for {which}: {p.error if p else 'unknown value'}"]})
    cols = ["injection", "sent_s", "inject_ttft_ms", "p95_tpot_before_ms", "p95_tpot_during_ms",
            "p95_tpot_after_ms", "p95_tpot_increase_ms", "p95_tpot_increase_pct", "output_tps_drop_pct",
            "prefill_step_tokens", "engine_iterations_during", "max_waiting_during", "valid", "reasons"]
    return p.result.injections[cols]


def windows_view(res: Phase7Result) -> pd.DataFrame:
    """Before / during / after per injection for every value (long format)."""
    parts = [p.result.windows.assign(value=p.label) for p in res.sweep if p.result is not None]
    if not parts:
        return pd.DataFrame({"note": ["no windows"]})
    cols = ["value", "injection", "window", "duration_s", "n_gaps", "streams", "p50_tpot_ms", "p95_tpot_ms",
            "p99_tpot_ms", "max_tpot_ms", "output_tps", "inject_ttft_ms", "max_waiting", "valid", "reasons", "notes"]
    # each percentile with the token gaps it rests on, or "max of N" where too few (windows.csv keeps the numbers)
    return mx.labelled_percentiles(pd.concat(parts, ignore_index=True)[cols], counts={"tpot": "n_gaps"})


def integrity_columns(rec: dict[str, Any]) -> dict[str, Any]:
    """The client's integrity in a page row: its worst dispatch lag and event-loop stall (ms), whether it kept up
    ("not measured" for a case recorded without the monitor)."""
    if not rec:
        return {"dispatch_lag_max_ms": None, "loop_lag_max_ms": None, "client_kept_up": "not measured"}
    return {"dispatch_lag_max_ms": (rec.get("dispatch_lag") or {}).get("max_ms"),
            "loop_lag_max_ms": (rec.get("loop_lag") or {}).get("max_ms"),
            "client_kept_up": "yes" if rec.get("ok") else "no"}


def schedule_view(res: Phase7Result) -> pd.DataFrame:
    """Per value: the warm-up TPOT, the measured window, when the background was steady, the schedule, the
    server's CPU use, the client's integrity (worst dispatch lag and loop stall) and the case verdict."""
    rows = []
    for p in res.sweep + ([res.confound] if res.confound else []):
        if p.result is None:
            rows.append({"value": p.label, "verdict": "no result", "reasons": p.error})
            continue
        r = p.result
        m = r.marks
        rows.append({"value": p.label, "warmup_tpot_ms": r.schedule_plan.warmup_tpot_s * 1e3,
                     "window_s": r.window_s, "steady_at_s": (m.steady_ns - m.t0_ns) / 1e9 if m.steady_ns else None,
                     "injections_sent_s": ", ".join(f"{x['sent_s']:.2f}" for x in r.schedule if x.get("sent")),
                     "wave_s": (m.end_ns - m.t0_ns) / 1e9 if m.end_ns else None,
                     "background_requests": r.background.get("completed"),
                     "server_cpu_util_cores": r.server.get("server_cpu_util_cores"),
                     **integrity_columns(r.integrity),
                     "verdict": r.verdict.verdict, "reasons": "; ".join(r.verdict.reasons),
                     "notes": "; ".join(r.spec.notes)})
    return pd.DataFrame(rows)


def baseline_timeline(res: Phase7Result):
    """The baseline value's timeline (or an empty figure saying why there is none)."""
    if res.baseline is None:
        return go.Figure().update_layout(title=f"the baseline {res.sweep[0].label} produced no result: "
                                               f"{res.sweep[0].error}")
    return timeline_figure(res.baseline, f"{res.sweep[0].label}: background token gaps around each long prefill "
                                         "(green before, yellow during, grey after)")


def baseline_serverside(res: Phase7Result):
    """The baseline's background token gaps over the engine's own series (running/queued gauges, slots or batch
    lines from its log) and its scheduler lines, each injection shaded (docs/metrics.md#server-side)."""
    b = res.baseline
    if b is None:
        return go.Figure().update_layout(title="no baseline result: no server-side timeline")
    recs = read_records(b.case_dir / "requests.jsonl")
    off = recs[0].wall_offset_ns if recs else 0
    t0 = b.marks.t0_ns + off
    t1 = (b.marks.end_ns or max((r.end_ns for r in recs), default=b.marks.t0_ns)) + off
    engine = json.loads((b.case_dir / "meta.json").read_text()).get("engine", "")
    side = case_serverside(b.case_dir, engine_for(engine), t0, t1)
    tl = b.timeline.rename(columns={"gap_ms": "itl_ms"}).assign(run="baseline")
    during = b.windows[b.windows["window"] == "during"] if not b.windows.empty else b.windows
    bands = [(float(r["start_s"]), float(r["end_s"])) for _, r in during.iterrows()]
    return client_over_server(tl, {"baseline": side}, bands, f"{res.sweep[0].label}: background token gaps over the "
                              "engine's own series and scheduler lines (yellow: during each injection)",
                              "client: background token gap (ms)", "time since the background started (s)",
                              "token gap")


def verdict_banner(res: Phase7Result):
    """The sweep's verdict as a banner (least damage to the decode SLO, not max prefill speed)."""
    ranked = res.table[res.table["rank"].notna()] if "rank" in res.table.columns else res.table.iloc[0:0]
    kind = "info" if not ranked.empty else "warning"
    return banner(res.verdict, kind, f"Verdict for {res.knob} (ranked by least damage to the decode SLO)")


def ab_banner(res: Phase7Result, confounded: bool = False):
    """The A/B banner of the sweep (or of the deliberately confounded pair)."""
    ab = res.confound_ab if confounded else res.ab
    if ab is None:
        return banner("not run" + ("" if not confounded else ": confound_setting is empty"), "info",
                      "Confounded A/B demonstration" if confounded else "A/B")
    return ab_figures.ab_banner(ab)


def ab_differences(res: Phase7Result, confounded: bool = False) -> pd.DataFrame:
    ab = res.confound_ab if confounded else res.ab
    return ab.differences if ab is not None else pd.DataFrame({"note": ["no A/B"]})


def ab_questions(res: Phase7Result) -> pd.DataFrame:
    return res.ab.questions if res.ab is not None else pd.DataFrame({"note": ["no A/B"]})


def ab_correctness(res: Phase7Result) -> pd.DataFrame:
    """Per value against the baseline: the greedy outputs of the same fixed prompts compared token for token — the
    verdict (``no regression`` / ``regression`` / ``not decidable`` / ``not measured``) with its counts."""
    if res.ab is None:
        return pd.DataFrame({"note": ["no A/B"]})
    return greedy_summary(res.ab.correctness)


def ab_correctness_prompts(res: Phase7Result) -> pd.DataFrame:
    """The same comparison prompt by prompt (every row in ``phase7/ab_correctness.csv``)."""
    return prompts_view(res.ab.correctness if res.ab is not None else None)


def record_h4(ctx: PhaseContext, res: Phase7Result) -> pd.DataFrame:
    """Record this phase's evidence about H4 (long prefill interferes with decode) from the baseline value."""
    inj = res.baseline.injections if res.baseline is not None else pd.DataFrame()
    verdict, summary, nums = h4_evidence(inj)
    summary = f"{res.sweep[0].label}: {summary}"
    ev = record_evidence(ctx, "H4", verdict, summary, anchor="Ranking:-least-damage-to-the-decode-SLO",
                         numbers=nums, table=["injections.csv", "sweep.csv"])
    return pd.DataFrame([{"hypothesis": ev.hypothesis, "verdict": ev.verdict, "summary": ev.summary,
                          **{k: v for k, v in nums.items()}}])


def findings(res: Phase7Result) -> list[str]:
    """What Phase 7 found, in sentences for the page's findings box: the baseline's damage, the sweep's verdict and
    winning value, the A/B's verdict and whether it is valid, and the confound demonstration."""
    out = []
    b = res.baseline
    if b is not None and b.verdict.verdict != "VALID":
        out.append(f"Baseline {res.sweep[0].label}: INVALID ({'; '.join(b.verdict.reasons[:1]) or 'no reason given'})"
                   " — its damage numbers stay in the tables, marked, and are not a result.")
    elif b is not None and not b.injections.empty and b.injections["valid"].any():
        ok = b.injections[b.injections["valid"]]
        out.append(f"Baseline {res.sweep[0].label}: a long prefill of {b.spec.inject_input_tokens:,} tokens raised the "
                   f"background's P95 token gap from {ok['p95_tpot_before_ms'].mean():.1f} ms to "
                   f"{ok['p95_tpot_during_ms'].mean():.1f} ms (mean of {len(ok)} valid injection(s), "
                   f"C={b.spec.concurrency}); its own TTFT {ok['inject_ttft_ms'].astype(float).mean():,.0f} ms.")
    else:
        why = res.sweep[0].error if res.sweep and res.sweep[0].result is None else "no valid injection window"
        out.append(f"Baseline {res.sweep[0].label if res.sweep else '-'}: no valid measurement ({why}).")
    out.append(f"Sweep of {res.knob} over {', '.join(str(v) for v in res.values)} — {res.verdict}.")
    invalid = [p.label for p in res.sweep if p.result is None or p.result.verdict.verdict != "VALID"]
    if invalid:
        out.append("Values without a VALID run (never ranked): " + ", ".join(invalid) + ".")
    behind = [(p.label, p.result.integrity["reasons"]) for p in res.sweep + ([res.confound] if res.confound else [])
              if p.result is not None and (p.result.integrity or {}).get("reasons")]
    for label, why in behind:
        out.append(f"{label}: INVALID, the client did not keep up — {'; '.join(why)}.")
    if res.ab is not None:
        out += ab_findings(res.ab, {"p95_tpot_ms": "P95 TPOT during injection",
                                    "output_tps": "output TPS during injection", "p95_ttft_ms": "long-request TTFT"})
        out += verdict_sentences(res.ab.correctness, res.ab.runs[0].label)
    else:
        out.append("The A/B over the sweep did not run: " + ("; ".join(res.notes) or "fewer than two records") + ".")
    if res.confound_ab is not None:
        n = len(res.confound_ab.confounds)
        out.append(f"The deliberately confounded run ({res.confound.label if res.confound else '-'}) was "
                   + (f"flagged: {n} confound(s), no conclusion drawn." if res.confound_ab.confounded else
                      "NOT flagged as confounded — check the manifest diff."))
    return out
