"""The Phase 1 quick matrix (P1–P4, D1–D4, M1) and the case runner.

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

Per case: ``cases/<case_id>/{meta.json, requests.jsonl, server/, summary_vllm_keys.jsonl, summary.json}``, written
through :class:`servelab.measure.case_record.CaseFolder` (the one case contract of every phase: ``requests.jsonl``
fsynced before ``summary.json``, the summary in the versioned case schema, see ``docs/case.md``). ``meta.json``
holds everything needed to run the case again exactly (the ``CaseSpec``, the ``CaseEnv`` settings, the target):
``servelab case RUN_ID CASE_ID`` re-runs it as a new attempt, ``cases/<case_id>@a<n>/`` (:func:`attempt_folder`).

While the matrix runs, :func:`run_matrix` appends "case i of n" events (elapsed, a naive estimate of what is
left) to ``<run>/<phase>/progress.jsonl`` (:func:`servelab.core.run.emit_progress`).
"""
from __future__ import annotations

import json
import re
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.case_record import CaseFolder, CaseSummary, read_summary, request_counts, verdict_of
from servelab.measure.case_runner import (ENGINE_CRASH, CaseRun, EngineCrash, Warmup, client_config, flush_cache,
                                          head_log, log_events)
from servelab.measure.client import ClientConfig, run_requests
from servelab.measure.records import ClientRun, RequestRecord, read_records
from servelab.measure.engine_metrics import named_deltas
from servelab.core import signals
from servelab.core.run import emit_progress, human_duration, merge_table, now_iso
from servelab.deploy.server import RunningServer, is_healthy
from servelab.measure.workload import build_workload, engine_tokenizer, spec_source, token_pool
from servelab.core.params import ParamError, did_you_mean
from servelab.deploy.engines import engine_for
from servelab.measure.peer_results import to_vllm_keys
from servelab.measure.multiclient import multi_wave

SUCCESS, FAILED, OOM = "success", "failed", "OOM"
LONG_PREFILL = ("P2", "P3", "P4")          # no same-shape warm-up (expensive 32K/128K points)
ATTEMPT_SEP = "@a"                          # cases/<case_id>@a<n>/: attempt n (≥ 2) of a case, re-run later


@dataclass
class CaseSpec:
    """One point of the matrix."""
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


def max_request_tokens(target: Any) -> int | None:
    """Tokens one request may hold (prompt + output), as the target's engine counts them."""
    return engine_for(target.engine).max_request_tokens(target.launch or {})


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
    healthy = is_healthy(env.srv)
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
        raise EngineCrash(f"{case.case_id}: engine lost health ({result.error or 'health probe failed'})")
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


# ---------------------------------------------------------------- the matrix

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
