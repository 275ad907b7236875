"""Phase 7's measurement: the interference case on a running server and the one-knob sweep that serves each launch
variant and runs it (``docs/method.md#interference``, ``docs/method.md#knobs``).

**The case**: a decode background held at concurrency ``C`` — ``C`` closed-loop streams, each sending its next
request as soon as the previous one finished, the first requests shortened in steps of OSL/C so that the streams
never change requests in lockstep — and, once every stream is past its prefill and a settle time has passed, a long
prefill (ISL_long → 1) injected ``n`` times, periodic but never on top of the previous one (:func:`_wave`).
:func:`measure_interference` runs it through the case runner (:class:`servelab.measure.case_runner.CaseRun`) and
returns the raw case (:class:`RawInterference`) with its raw files written and the case still open: the caller
analyses it (:mod:`servelab.analyse.interference`) and closes it with its summary (:meth:`RawInterference.close`).

**The sweep**: :func:`knob_sweep` / :func:`run_variant` serve the target with one launch change per value, run the
case and write the run-like record; the caller's ``finish`` (analyse and close a raw case) turns each raw case into
its result, so this layer never imports the analysis.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import numpy as np
import pandas as pd

from servelab.core.paths import path_slug
from servelab.core.run import write_json_atomic
from servelab.deploy.server import RunningServer
from servelab.measure import request_metrics as mx
from servelab.measure.case import case_seed
from servelab.measure.case_record import CaseSummary
from servelab.measure.case_runner import CaseRun, Warmup
from servelab.measure.client import ClientConfig, run_async, run_sync
from servelab.measure.launch_variants import (Snapshot, check_knob_changes_command, env_changes, serving,
                                              with_launch, write_run_record)
from servelab.measure.loop_monitor import LoopMonitor
from servelab.measure.records import ClientRun, RequestRecord
from servelab.measure.workload import RequestSpec, build_workload, engine_tokenizer, token_pool

R = TypeVar("R")


@dataclass
class InterferenceSpec:
    """One interference case (token counts exact; seconds where named)."""
    case_id: str
    background_input_tokens: int
    background_output_tokens: int          # per background request; streams refill until the last window ends
    concurrency: int
    inject_input_tokens: int
    n_injections: int
    window_steps: int = 8                  # window length in background token gaps
    first_inject_s: float = 0.0            # settle after the streams' prefill (0 = two estimated windows)
    period_s: float = 0.0                  # planned period between sends; 0 = as soon as the quiet gap allows
    quiet_gap_s: float = 0.0               # 0 = two windows (estimated from the warm-up TPOT)
    max_background_requests: int = 0       # safety cap per stream; 0 = 200
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the schedule

@dataclass
class Schedule:
    """What the warm-up measured and the schedule derived from it (seconds)."""
    warmup_tpot_s: float
    warmup_ttft_s: float
    window_estimate_s: float
    quiet_gap_s: float
    first_inject_s: float


def plan_schedule(spec: InterferenceSpec, warmup: list[RequestRecord]) -> Schedule:
    """Quiet gap and first wait from the warm-up's mean TPOT (vllm definition; at least 0.1 ms)."""
    ms = [mx.request_metrics(r, mx.VLLM_BENCH) for r in warmup if r.ok]
    tpots = [m.tpot_ms for m in ms if m.tpot_ms is not None]
    ttfts = [m.ttft_ms for m in ms if m.ttft_ms is not None]
    if not tpots:
        raise RuntimeError("the decode warm-up produced no TPOT (its requests failed): cannot plan the case")
    tpot_s = max(float(np.mean(tpots)) / 1e3, 1e-4)
    w = spec.window_steps * tpot_s
    return Schedule(tpot_s, float(np.max(ttfts)) / 1e3 if ttfts else 0.0, w, spec.quiet_gap_s or 2 * w,
                    spec.first_inject_s or 2 * w)


@dataclass
class Marks:
    """Perf-counter ns of the wave: start, steady (every stream decoding, measured), stop signalled, end."""
    t0_ns: int = 0
    steady_ns: int = 0
    stop_ns: int = 0
    end_ns: int = 0
    settle_ns: int = 0               # wait after the streams' prefill, before the first send


def token_chunk_ns(rec: RequestRecord) -> list[int]:
    """Arrival times of the chunks that carry a token: ``choices`` chunks, minus a trailing empty-text one
    that only carries the finish reason and usage (llama.cpp completions) when that makes the count match
    ``completion_tokens``."""
    idx = [i for i, c in enumerate(rec.chunk_choices) if c]
    if idx and rec.completion_tokens is not None and len(idx) == rec.completion_tokens + 1 \
            and not rec.chunk_text[idx[-1]]:
        idx = idx[:-1]
    return [rec.chunk_ns[i] for i in idx]


def steady_from_records(records: list[RequestRecord], concurrency: int, role: str = "background") -> int:
    """When every stream was decoding: the latest first token of the ``concurrency`` earliest-sent background
    requests (one per stream); 0 when a stream never produced one."""
    first = sorted((r for r in records if r.role == role), key=lambda r: r.send_ns)[:concurrency]
    if len(first) < concurrency or any(not token_chunk_ns(r) for r in first):
        return 0
    return max(token_chunk_ns(r)[0] for r in first)


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


# ---------------------------------------------------------------- one case on a running server: the raw case

@dataclass
class RawInterference:
    """One interference case as measured: its raw files written, its case runner still open (``close`` writes the
    summary and closes ``meta.json``). The server side (records, scrape, slots, snapshots, CPU) is the case
    runner's (:class:`CaseRun`)."""
    case: CaseRun
    spec: InterferenceSpec
    definition: str
    repeat_of: str                           # the case this one is a variant of ("" for none)
    plan: Schedule
    plan_error: str                          # why the warm-up could not plan the case ("" when it could)
    bg_records: list[RequestRecord]
    inj_records: list[RequestRecord]
    schedule: list[dict[str, Any]]
    marks: Marks
    wave_run: ClientRun | None               # the wave loop's requests and its one monitor's samples

    @property
    def dir(self) -> Path:
        return self.case.dir

    @property
    def error(self) -> str:
        """The case's error: why the warm-up could not plan the case, else what the case runner recorded in the block."""
        return self.plan_error or self.case.error

    @property
    def status(self) -> str:
        return "success" if not self.error else "failed"

    @property
    def records(self) -> list[RequestRecord]:
        """Every record of the case (warm-up, background, injections), in ``requests.jsonl`` order."""
        return self.case.records

    @property
    def scrape(self) -> pd.DataFrame:
        return self.case.scrape

    @property
    def slots(self) -> pd.DataFrame:
        return self.case.slots

    @property
    def before(self) -> Snapshot | None:
        return self.case.before

    @property
    def after(self) -> Snapshot | None:
        return self.case.after

    @property
    def cpu(self) -> tuple[float | None, float | None]:
        return self.case.cpu

    @property
    def metric_names(self) -> dict[str, str]:
        """The engine's series under our names (``running``, ``waiting``, ``decode_calls_total``, …)."""
        return self.case.srv.engine.metric_names

    @property
    def launch(self) -> dict[str, Any]:
        return dict(self.case.srv.target.launch)

    def close(self, summary: CaseSummary) -> dict[str, Any]:
        """The case's summary (``summary.json``), then ``meta.json`` closed with the case's status and error."""
        return self.case.close(summary, self.status, self.error)


def measure_interference(srv: RunningServer, run_dir: Path, spec: InterferenceSpec, pool: list[int], seed: int = 0,
                         definition: str = mx.VLLM_BENCH, poll_interval_s: float = 0.0, phase: str = "phase7",
                         repeat_of: str = "") -> RawInterference:
    """Warm up, plan, run the background streams with their injections; the raw data, nothing computed.

    Files: ``cases/<case_id>/{meta.json, requests.jsonl, server/{metrics.parquet, slots.parquet,
    metrics_{before,after}.prom, engine_log_excerpt.txt, marks.json}}``, written through the case runner; the
    caller's analysis adds the tables and :meth:`RawInterference.close` the summary.
    ``repeat_of``: the case this one is a variant of (a sweep value runs ``I7`` as ``I7_<label>``).
    """
    case = CaseRun(srv, run_dir, spec.case_id, phase, "interference", {
        "spec": asdict(spec), "engine": srv.target.engine, "base_url": srv.base_url, "launch": srv.target.launch,
        "definition": definition}, definition=definition, measured_roles=("background",))
    meta = case.meta
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
    write_json_atomic(case.dir / "server" / "marks.json", asdict(marks))
    return RawInterference(case, spec, definition, repeat_of, plan, plan_error, bg_recs, inj_recs, schedule, marks,
                           wave_run)


# ---------------------------------------------------------------- the knob sweep

@dataclass
class SweepPoint(Generic[R]):
    """One value of the swept knob: its result (the caller's ``finish`` of the raw case; None when the case did not
    run), its run-like record, the error and any setting changed beside the knob."""
    knob: str
    value: Any
    result: R | None
    record_dir: Path
    error: str = ""
    extra_changes: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.extra_changes.items())
        return f"{self.knob}={self.value}" + (f"+{extra}" if extra else "")


def run_variant(target: Any, changes: dict[str, Any], spec: InterferenceSpec, run_dir: Path, record_root: Path,
                label: str, log_dir: Path, finish: Callable[[RawInterference], R], phase: str = "", seed: int = 0,
                definition: str = mx.VLLM_BENCH, parent_manifest: dict[str, Any] | None = None,
                health_timeout_s: float = 300.0) -> tuple[R | None, Path, str]:
    """Serve ``target`` with ``changes``, run the case as ``<case_id>_<label>``, ``finish`` it (analyse and close the
    raw case: its result), write the run-like record."""
    t = with_launch(target, changes, label)
    slug = path_slug(label)                  # a knob value such as ../../x never leaves record_root
    case = replace(spec, case_id=f"{spec.case_id}_{slug}", notes=list(spec.notes))
    rec_dir = Path(record_root) / slug
    res, error = None, ""
    raw: RawInterference | None = None
    srv_ref = None
    try:
        with serving(t, log_dir, run_dir, phase, health_timeout_s, check_env=env_changes(changes)) as srv:
            srv_ref = srv
            pool = token_pool(engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path,
                                               headers=srv.auth_headers), seed=seed)
            raw = measure_interference(srv, run_dir, case, pool, seed, definition, phase=phase or "phase7",
                                       repeat_of=spec.case_id)
            res = finish(raw)
    except Exception as exc:  # a value that cannot serve is recorded, the sweep goes on
        error = f"{type(exc).__name__}: {exc}"
    # the same case id on every side of the A/B; a value that did not run is listed with its reason
    case_dir = raw.dir if res is not None and raw is not None else None
    cases = [(spec.case_id, case_dir, error)]
    write_run_record(rec_dir, f"{(parent_manifest or {}).get('run_id', 'run')}-{slug}", t, srv_ref, cases,
                     parent_manifest)
    write_json_atomic(rec_dir / "variant.json", {"label": label, "changes": changes, "error": error,
                                                 "case_dir": str(case_dir) if case_dir is not None else None})
    return res, rec_dir, error


def knob_sweep(target: Any, knob: str, values: list[Any], spec: InterferenceSpec, run_dir: Path, record_root: Path,
               log_dir: Path, finish: Callable[[RawInterference], R], phase: str = "", seed: int = 0,
               definition: str = mx.VLLM_BENCH, parent_manifest: dict[str, Any] | None = None) -> list[SweepPoint[R]]:
    """The same case for each value of ONE launch setting, the engine restarted per value (first = baseline);
    ``finish`` turns each raw case into its result (:func:`run_variant`)."""
    check_knob_changes_command(target, knob, values)
    out = []
    for v in values:
        label = f"{knob}={v}"
        res, rec, err = run_variant(target, {knob: v}, spec, run_dir, record_root, label, log_dir, finish, phase,
                                    seed, definition, parent_manifest)
        out.append(SweepPoint(knob, v, res, rec, err))
    return out
