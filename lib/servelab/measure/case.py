"""One case: its spec (:class:`CaseSpec`), what every case of a run shares (:class:`CaseEnv`), its routine on the
case runner (:func:`run_case`), its result and summary, the resume rule and later attempts.

A case is warmed up when its spec says so (once, a short request of its shape; the long prefill points have none), the
prefix cache flushed after the warm-up (llama.cpp has no flush endpoint: every request then sends
``cache_prompt: false``, recorded in ``meta.json``), and — *sized* (``docs/case.md#sizing``, MLPerf LoadGen's rule,
:func:`sizing_kw`) — it keeps issuing requests at its concurrency until both ``min_duration_s`` has passed and
``num_prompts`` requests were sent; its wave runs ``CaseEnv.repeats`` times (quick runs once, milestones 3 with the CV
checked, ≤ 3 %), flushing between repeats.

Per case: ``cases/<case_id>/{meta.json, requests.jsonl, server/, summary_vllm_keys.jsonl, summary.json}``, written
through :class:`servelab.measure.case_record.CaseFolder` (the one case contract of every phase: ``requests.jsonl``
fsynced before ``summary.json``, the summary in the versioned case schema, see ``docs/case.md``). ``meta.json``
holds everything needed to run the case again exactly (the ``CaseSpec``, the ``CaseEnv`` settings, the target):
``servelab case RUN_ID CASE_ID`` re-runs it as a new attempt, ``cases/<case_id>@a<n>/`` (:func:`attempt_folder`).

The Phase 1 matrix these cases come from, and the loop that runs a list of them, is :mod:`servelab.measure.matrix`.
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from servelab.measure import request_metrics as mx
from servelab.measure.case_record import CaseFolder, CaseSummary, read_summary, request_counts, verdict_of
from servelab.measure.case_runner import (ENGINE_CRASH, CaseRun, EngineCrash, Warmup, client_config, flush_cache,
                                          head_log, log_events)
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.records import ClientRun, RequestRecord, read_records
from servelab.measure.engine_metrics import named_deltas
from servelab.deploy.server import RunningServer, health_problem
from servelab.measure.workload import build_workload, engine_tokenizer, spec_source, token_pool
from servelab.deploy.engines import engine_for
from servelab.measure.peer_results import to_vllm_keys
from servelab.measure.multiclient import multi_wave

SUCCESS, FAILED, OOM = "success", "failed", "OOM"
ATTEMPT_SEP = "@a"                          # cases/<case_id>@a<n>/: attempt n (≥ 2) of a case, re-run later


@dataclass
class CaseSpec:
    """One case: a point of the matrix (:mod:`servelab.measure.matrix`) or of a search."""
    case_id: str                     # P1, P4_c4, D2_c16, M1_control, M1_treatment, S_c17 ...
    scenario: str                    # P1..P4, D1, D2, M1, search
    kind: str                        # prefill | decode | mixed
    input_tokens: int
    output_tokens: int
    concurrency: int
    num_prompts: int
    warmup: bool
    purpose: str = ""
    notes: list[str] = field(default_factory=list)
    inject_input_tokens: int = 0     # M1 treatment: the long prefill
    inject_after_s: float = 0.0      # ... sent this long after the measurement window starts
    min_window_s: float = 0.0        # validity: shortest acceptable window
    min_duration_s: float = 0.0      # sizing: keep issuing until this long has passed AND num_prompts were sent
                                     # (MLPerf LoadGen min_duration / min_query_count); 0: one fixed wave


def max_request_tokens(target: Any) -> int | None:
    """Tokens one request may hold (prompt + output), as the target's engine counts them."""
    return engine_for(target.engine).max_request_tokens(target.launch or {})


# ---------------------------------------------------------------- environment of a run

@dataclass
class CaseEnv:
    """What every case of a run shares: the server, where to write, the token pool, SLOs and policies."""
    srv: RunningServer
    run_dir: Path
    pool: list[int]
    repeats: int = 1
    seed: int = 0
    slo: mx.SLO = field(default_factory=mx.SLO)
    api: str = "completions"
    timeout_s: float = 600.0
    scrape_interval_s: float = 0.5
    max_cv_pct: float = 3.0
    progress: bool = False
    profiler_attached: bool = False
    log_offsets: dict[str, int] = field(default_factory=dict)
    phase: str = "phase1"            # the phase whose cases these are (written into every summary.json)
    attempt: int = 1                 # 1: cases/<case_id>/; n ≥ 2: a later re-run, cases/<case_id>@a<n>/
    integrity_rules: mx.IntegrityRules = field(default_factory=mx.IntegrityRules)
    clients: int = 1                 # client processes a wave is sent from (measure.multiclient; docs/scaling.md)

    def recipe(self) -> dict[str, Any]:
        """The settings a case of this env ran with, as recorded in its ``meta.json`` (``case_env``): with the
        ``CaseSpec`` and the target they are what ``servelab case`` needs to run the case again exactly."""
        return {"repeats": self.repeats, "seed": self.seed, "slo": asdict(self.slo), "api": self.api,
                "timeout_s": self.timeout_s, "scrape_interval_s": self.scrape_interval_s,
                "max_cv_pct": self.max_cv_pct, "profiler_attached": self.profiler_attached, "phase": self.phase,
                "integrity_rules": asdict(self.integrity_rules), "clients": self.clients}

    @property
    def engine(self) -> Any:
        return self.srv.engine

    def client_config(self, case_id: str) -> ClientConfig:
        return client_config(self.srv, self.run_dir, case_id, api=self.api, timeout_s=self.timeout_s,
                             progress=self.progress)


def make_env(srv: RunningServer, run_dir: Path, **kw: Any) -> CaseEnv:
    """A ``CaseEnv`` with the token pool taken from the engine's own tokenizer."""
    tok = engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path, headers=srv.auth_headers)
    return CaseEnv(srv=srv, run_dir=Path(run_dir), pool=token_pool(tok, seed=kw.get("seed", 0)), **kw)


def case_seed(base: int, case_id: str, repeat: int) -> int:
    return (base * 1_000_003 + zlib.crc32(case_id.encode()) + 7919 * repeat) % (2**32)


def attempt_folder(case_id: str, attempt: int = 1) -> str:
    """The folder name of attempt ``attempt`` of a case: the case id itself for the first, ``<case_id>@a<n>``
    for a later re-run (its summary's ``repeat_of`` is the case id)."""
    return case_id if attempt <= 1 else f"{case_id}{ATTEMPT_SEP}{int(attempt)}"


def split_attempt(folder: str) -> tuple[str, int]:
    """``P1@a3`` → ``("P1", 3)``; ``P1`` → ``("P1", 1)``."""
    m = re.fullmatch(rf"(.+){re.escape(ATTEMPT_SEP)}(\d+)", folder)
    return (m.group(1), int(m.group(2))) if m else (folder, 1)


def target_ref(target: Any) -> dict[str, Any]:
    """Which target a case ran on, for its ``meta.json``: name, the file it was read from, engine and model."""
    return {"name": target.name, "source": getattr(target, "source", ""), "engine": target.engine,
            "model": target.model}


# ---------------------------------------------------------------- result and files

@dataclass
class CaseResult:
    case: CaseSpec
    status: str                           # success | failed | ENGINE_CRASH | OOM | skipped
    case_dir: Path
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)   # definition → pooled summary
    repeat_summaries: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    cv: dict[str, Any] = field(default_factory=dict)
    verdict: mx.Verdict = field(default_factory=lambda: mx.Verdict("INVALID", ["not run"]))
    error: str = ""
    log_events: dict[str, list[str]] = field(default_factory=dict)
    server_deltas: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    integrity: dict[str, Any] = field(default_factory=dict)     # mx.pooled_integrity over the repeats

    def row(self, definition: str) -> dict[str, Any]:
        s = self.summaries.get(definition, {})
        keep = ("completed", "failed", "timeouts", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "input_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", *[f"{st}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                     for st in ("mean", "p50", "p95", "p99", "max")], "median_tok_per_s_per_user",
                *[f"n_{m}" for m in ("ttft", "tpot", "itl", "e2el")])
        return {"case_id": self.case.case_id, "scenario": self.case.scenario, "kind": self.case.kind,
                "input_len": self.case.input_tokens, "output_len": self.case.output_tokens,
                "concurrency": self.case.concurrency, "num_prompts": self.case.num_prompts,
                "repeats": len(self.repeat_summaries), "status": self.status, "definition": definition,
                "validity": self.verdict.verdict, "validity_reasons": "; ".join(self.verdict.reasons),
                "cv_output_throughput_pct": (self.cv.get("output_throughput") or {}).get("cv_pct"),
                "client_loop_lag_max_ms": (self.integrity.get("loop_lag") or {}).get("max_ms"),
                "littles_law_error": (self.integrity.get("littles_law") or {}).get("error"),
                **{k: s.get(k) for k in keep}}


def case_is_done(case_dir: Path, expected_measured: int | None = None) -> bool:
    """Resume rule: ``meta.json`` says success and ``requests.jsonl`` re-parses (with the expected count). An
    ``INTERRUPTED`` case (Ctrl-C mid-case: its meta and summary say so) is never done: resume runs it again."""
    try:
        meta = json.loads((case_dir / "meta.json").read_text())
        if meta.get("status") != SUCCESS:
            return False
        recs = read_records(case_dir / "requests.jsonl")
    except (OSError, ValueError):
        return False
    n = sum(r.role == "measure" for r in recs)
    want = expected_measured if expected_measured is not None else meta.get("expected_measured")
    # a sized case sends at least its num_prompts (more when its minimum duration asked for more)
    return bool(recs) and (want is None or n >= want)


def load_case_result(case: CaseSpec, case_dir: Path) -> CaseResult:
    """A finished case read back from disk (for resume and for the notebook)."""
    summ = read_summary(case_dir / "summary.json")
    meta = json.loads((case_dir / "meta.json").read_text())
    d = summ["details"]
    v = summ["verdict"]
    return CaseResult(case, meta.get("status", "unknown"), case_dir, summ["metrics"],
                      [r["metrics"] for r in summ["repeats"]], d.get("cv", {}), mx.Verdict(v["status"], v["reasons"]),
                      meta.get("error", ""), meta.get("log_events", {}), d.get("server_deltas", {}),
                      d.get("extra", {}), summ.get("integrity") or {})


# ---------------------------------------------------------------- running one case

def run_case(env: CaseEnv, case: CaseSpec, run_fn: Callable[[CaseEnv, CaseSpec, ClientConfig, int], ClientRun]
             | None = None, extra_fn: Callable[[list[RequestRecord]], dict[str, Any]] | None = None) -> CaseResult:
    """Run one matrix case through the case runner (:class:`servelab.measure.case_runner.CaseRun`: health check,
    warm-up, flush, the ``/metrics`` scraper, raw records first): its wave is the repeats (flushing between them),
    its summary both definitions per repeat and pooled, the CV, the verdict and the engine's counter deltas.

    Raises ``EngineCrash`` (after writing everything measured) when the engine is unhealthy afterwards.
    ``run_fn(env, case, cfg, repeat) -> ClientRun`` replaces the default closed-loop wave (used by M1);
    ``extra_fn(records)`` adds entries to ``CaseResult.extra`` before the summary is written (M1's injection).
    """
    expected = case.num_prompts * env.repeats          # at least (a sized case may send more)
    run = CaseRun(env.srv, env.run_dir, attempt_folder(case.case_id, env.attempt), env.phase, case_kind(case), {
        "case": asdict(case), "repeats": env.repeats, "expected_measured": expected, "engine": env.srv.target.engine,
        "base_url": env.srv.base_url, "api": env.api, "seed": env.seed, "profiler_attached": env.profiler_attached,
        "repeat_of": case.case_id, "attempt": env.attempt, "case_env": env.recipe(),
        "target": target_ref(env.srv.target)}, interrupt_details={"case": asdict(case)})
    runs: list[ClientRun] = []
    with run:
        cfg = run.client_config(env.client_config(run.case_id))
        if case.warmup:
            osl = min(case.output_tokens, 16)
            run.warm_up(run.client_warmup(cfg, env.pool, Warmup(1, case.input_tokens, osl,
                                                                case_seed(env.seed, case.case_id + "/warmup", 0))),
                        shape=[case.input_tokens, osl])
        else:
            run.warm_up(None, "no same-shape warm-up for long prefill points (docs/method.md#warmup)")
        run.flush()
        run.watch(scrape_interval_s=env.scrape_interval_s, scrape_timeout_s=5.0)
        for rep in range(env.repeats):
            wave = (run_fn or run_wave)(env, case, cfg, rep)
            runs.append(wave)
            run.add(wave.records)
            if rep + 1 < env.repeats and env.engine.flush_cache_path:
                flush_cache(env.srv)
    records, error, frame = run.records, run.error, run.scrape
    events = log_events(run.log_text, env.engine.log_markers)
    problem = health_problem(env.srv)                     # "" when healthy; else which part, in one line
    healthy = not problem
    result = CaseResult(case, SUCCESS, run.dir, error=error, log_events=events)
    result.server_deltas = named_deltas(frame, env.engine.metric_names) if not frame.empty else {}
    if runs:
        rep_summ = [mx.both_definitions(r.records, measured_window_s(r), env.slo, r.window_start_ns) for r in runs]
        pooled_dur = sum(measured_window_s(r) for r in runs)
        measured = [x for r in runs for x in r.records]
        result.repeat_summaries = rep_summ
        result.summaries = mx.both_definitions(measured, pooled_dur, env.slo)
        result.cv = mx.cv_across_repeats([s[mx.VLLM_BENCH] for s in rep_summ]) if len(runs) > 1 else {}
        rules = mx.ValidityRules(min_completed=case.num_prompts * len(runs), min_window_s=case.min_window_s,
                                 max_cv_pct=env.max_cv_pct if len(runs) >= 3 else None)
        result.integrity = mx.pooled_integrity([mx.integrity(r, env.integrity_rules) for r in runs])
        result.verdict = mx.validity(result.summaries[mx.VLLM_BENCH], rules, env.profiler_attached, result.cv,
                                     result.integrity)
        result.extra["client_cpu_s"] = sum(r.client_cpu_s for r in runs)
        if extra_fn is not None:
            result.extra.update(extra_fn(records))
    if "oom" in events:
        result.status = OOM
    elif not healthy:
        result.status = ENGINE_CRASH
    elif error or not runs or result.summaries[mx.VLLM_BENCH]["failed"]:
        result.status = FAILED
    if result.status != SUCCESS and result.verdict.verdict == "VALID":
        result.verdict = mx.Verdict("INVALID", [f"case status {result.status}"])
    if error and not result.error:
        result.error = error
    if not error and result.status == FAILED and runs:
        result.error = f"{result.summaries[mx.VLLM_BENCH]['failed']} request(s) failed: " \
                       f"{result.summaries[mx.VLLM_BENCH]['errors_by_kind']}"
    # the client's own measurement windows on the wall clock: Phase 2 slices telemetry to exactly these
    windows = [[r.window_start_ns + r.wall_offset_ns, r.window_end_ns + r.wall_offset_ns] for r in runs]
    run.close(case_summary(result, run.folder, records, attempt=env.attempt), result.status, result.error,
              windows_wall_ns=windows, log_events=events, healthy_after=healthy, engine_log=head_log(env.srv)[1])
    if result.status == ENGINE_CRASH:
        raise EngineCrash(f"{case.case_id}: engine lost health ({problem or result.error or 'health probe failed'})")
    return result


def sizing_kw(env: CaseEnv, case: CaseSpec, repeat: int, role: str = "measure") -> dict[str, Any]:
    """``run_requests`` arguments of a sized case (``docs/case.md#sizing``): an unbounded prompt source of the case's
    shape and the two minimums; empty for a fixed wave (``min_duration_s`` 0)."""
    if case.min_duration_s <= 0:
        return {}
    return {"make_spec": spec_source(case.case_id, case.input_tokens, case.output_tokens, env.pool,
                                     case_seed(env.seed, case.case_id, repeat), role=role),
            # the client times its minimum from the window's opening; the validity window runs from the first send
            # to the last end, a few ms shorter: a small margin keeps a sized case clear of the floor it must meet
            "min_requests": case.num_prompts, "min_duration_s": case.min_duration_s * 1.02 + 0.02}


def run_wave(env: CaseEnv, case: CaseSpec, cfg: ClientConfig, repeat: int) -> ClientRun:
    """The default wave of a case at its concurrency: ``num_prompts`` requests, or — sized — as many as it takes
    to meet both ``min_duration_s`` and ``num_prompts``."""
    kw = sizing_kw(env, case, repeat)
    if env.clients > 1:             # the same requests from several client processes, records merged
        return multi_wave(env, case, cfg, repeat, case_seed(env.seed, case.case_id, repeat), kw)
    if kw:
        return run_requests([], cfg, concurrency=case.concurrency, repeat=repeat, **kw)
    wl = build_workload(case.case_id, case.num_prompts, case.input_tokens, case.output_tokens, env.pool,
                        seed=case_seed(env.seed, case.case_id, repeat))
    return run_requests(wl.requests, cfg, concurrency=case.concurrency, repeat=repeat)


def case_kind(case: CaseSpec) -> str:
    """The summary's ``kind``: prefill | decode | mixed for matrix points, ``search`` for search points."""
    return "search" if case.scenario == "search" else case.kind


def measured_window_s(run: ClientRun) -> float:
    """The measurement window of a wave: its start to the end of its last *measured* request.

    Equal to the client window without injections; with one (M1) the injected request's tail is excluded,
    so the background's throughput is not diluted by time in which it was already done.
    """
    ends = [r.end_ns for r in run.records if r.role == "measure" and r.end_ns]
    end = max(ends) if ends else run.window_end_ns
    return max(end - run.window_start_ns, 1) / 1e9


def case_summary(result: CaseResult, folder: CaseFolder, records: list[RequestRecord], attempt: int = 1
                 ) -> CaseSummary:
    """The case's summary (the case schema: pooled metrics per definition, one entry per repeat, the verdict), with
    ``summary_vllm_keys.jsonl`` written beside it (the same numbers under ``vllm bench serve``'s keys).
    A later attempt (``attempt`` ≥ 2, folder ``<case_id>@a<n>``) is a repeat of the case: ``repeat_of`` is the case
    id and ``details.attempt`` says which attempt of which folder it is."""
    if result.summaries:
        # the same numbers under vllm bench serve's keys, one object per definition (like --append-result)
        lines = [json.dumps(to_vllm_keys(result.summaries[d], {"label": result.case.case_id,
                                                               "max_concurrency": result.case.concurrency}),
                            default=str) for d in mx.DEFINITIONS if d in result.summaries]
        (result.case_dir / "summary_vllm_keys.jsonl").write_text("\n".join(lines) + "\n")
    details = {"case": asdict(result.case), "cv": result.cv, "server_deltas": result.server_deltas,
               "log_events": result.log_events, "extra": result.extra, "error": result.error}
    if attempt > 1:
        details["attempt"] = {"n": attempt, "of": result.case.case_id, "first": f"cases/{result.case.case_id}"}
    return CaseSummary(
        case_id=folder.case_id, phase=folder.phase, kind=folder.kind, status=result.status,
        verdict=verdict_of(result.verdict), definition=mx.VLLM_BENCH, metrics=result.summaries,
        repeats=[{"repeat": i, "metrics": s} for i, s in enumerate(result.repeat_summaries)],
        counts=request_counts(records, ("measure",)), details=details, repeat_of=result.case.case_id,
        integrity=result.integrity)


def write_summary(result: CaseResult, folder: CaseFolder, records: list[RequestRecord], attempt: int = 1
                  ) -> dict[str, Any]:
    """:func:`case_summary` written (``summary.json``, after ``requests.jsonl``)."""
    return folder.write_summary(case_summary(result, folder, records, attempt))
