"""Phase 1 end to end: start the engine, run the quick matrix (+ M1 A/B, + optional concurrency search), stop.

``run(ctx)`` is the phase, the one call of the notebook: the server is started inside a ``ProcessTracker`` and
stopped in ``finally`` — whatever fails, nothing is left running. An OOM restarts the engine before anything
else is measured (``docs/method.md#oom-restart``) and the restart is recorded; ENGINE_CRASH stops the run and lists the cases not
executed. Everything goes to ``<run>/cases/<case_id>/`` (raw records, summaries, server metrics),
``<run>/summary.csv`` and ``<run>/phase1/`` (matrix, search, frontier, M1 tables).

Every case, once written, gets its ``reproduce`` command on the page: ``servelab case <run_id> <case_id>`` re-runs
that one case from its recorded ``meta.json`` as a new attempt (:mod:`servelab.measure.case_rerun`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import pandas as pd

from servelab.analyse.serverside import (m1_stall_sentence, log_join, case_serverside, records_window,
                                         client_vs_server, read_metrics, server_percentiles, side_summary)
from servelab.measure import request_metrics as mx
from servelab.measure.case import SUCCESS, CaseEnv, CaseResult, CaseSpec, case_is_done, load_case_result, make_env
from servelab.measure.case_runner import EngineCrash
from servelab.measure.matrix import (SCALES, SUMMARY_KEYS, MatrixResult, c1_requests, dispatch_case, long_decode_sentence,
                                     long_decode_table, quick_matrix, run_matrix)
from servelab.measure.mixed import m1_analysis
from servelab.core.run import merge_table, write_json_atomic
from servelab.measure.search import SearchConfig, SearchResult, concurrency_search
from servelab.analyse import memory as memory_layer
from servelab.core.params import param, ParamError, PhaseParams
from servelab.deploy.engines import engine_for
from servelab.deploy.hosts import ProcessTracker
from servelab.deploy.attach import ATTACH_NOTE
from servelab.deploy.server import engine_info, start_server, stop_server
from servelab.measure.records import read_records
from servelab.measure.case_rerun import case_command
from servelab.phases.context import PhaseContext
from servelab.report.ledger import evidence_frame, record_evidence
from servelab.report import answers, crosscheck
from servelab.core.facts import Fact, make, plain


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 1's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase1 --cell``); ``-p`` and ``params/phase1.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase1"
    matrix: str = param("quick", "the fixed quick matrix P1-P4, D1, D2, M1 (the only matrix so far) [one of quick]")
    cases: list = param([], "case ids or scenarios to run, e.g. [\"P1\", \"D2\"]; empty: all")
    repeats: int = param(1, "1 for quick runs; 3 for milestones, whose CV of output TPS must stay within 3 % [min 1]")
    min_duration_s: float = param(0.0,
        "sizing: every case keeps sending until this long AND min_requests were sent (MLPerf LoadGen rule); "
        "0: 0.5 s local, 5 s cluster")
    min_requests: int = param(0,
        "sizing: requests of P1; longer concurrency-1 prompts get fewer by cost (at least 8), concurrent "
        "cases 2 waves; 0: 100 local, 200 cluster")
    slo_ttft_ms: float = param(3000.0, "TTFT SLO in ms, compared with P95 in the search; 0: none")
    slo_tpot_ms: float = param(150.0, "TPOT SLO in ms, compared with P95 in the search; 0: none")
    search: bool = param(True, "run the concurrency search after the matrix")
    search_max_concurrency: int = param(32, "the search stops at this concurrency (MAX_CONCURRENCY_REACHED) [min 1]")
    search_step: int = param(0, "concurrency step after C 1; 0: 16 on a cluster target, 4 on a local one")
    resume: bool = param(False, "skip cases whose meta.json says success and whose requests.jsonl re-parses")
    definition: str = param(mx.VLLM_BENCH,
        "metric definition of the tables and plots: vllm | sglang (both are always computed) [one of vllm, "
        "sglang]")
    seed: int = param(0, "workload seed (prompts are unique random token ids)")
    clients: int = param(1,
        "client processes each wave is sent from: one schedule split over them, one start instant, raw "
        "records merged (exact percentiles), each process judged on its own; raise it when one process cannot"
        " keep up (docs/scaling.md#many-clients) [min 1]")


@dataclass
class Phase1Result:
    """What the notebook shows."""
    matrix: MatrixResult
    definition: str
    search: SearchResult | None = None
    m1: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)
    facts: list[Fact] = field(default_factory=list)        # the run's answers, recorded once (report.answers)

    @property
    def aborted(self) -> str:
        return self.matrix.aborted

    @property
    def not_executed(self) -> list[str]:
        return self.matrix.not_executed

    def summary(self, definition: str | None = None) -> pd.DataFrame:
        """The matrix as the page shows it: every percentile with its sample count, or ``max of N`` where too few
        values hold it (``request_metrics.labelled_percentiles``); ``matrix.frame()`` keeps the numbers."""
        return mx.labelled_percentiles(self.matrix.frame(definition or self.definition))

    def findings(self) -> list[str]:
        return findings(self)

    def headline(self) -> dict[str, Any]:
        """The numbers the page and the run index put forward — each from a VALID case with enough samples for the
        statistic it names (a P50 needs 2, ``request_metrics.min_samples``), else the key says why it is not a
        result (the number stays in the tables, marked)."""
        df = self.matrix.frame(self.definition)
        out: dict[str, Any] = {"cases": len(self.matrix.results), "definition": self.definition,
                               "valid": int((df["validity"] == "VALID").sum()) if not df.empty else 0,
                               "not_executed": len(self.not_executed), "aborted": self.aborted or None}
        for cid, metric in (("P1", "ttft"), ("D1", "tpot")):
            r = case_result(self, cid)
            if r is None or not r.summaries:
                continue
            got = result_value(r, self.definition, metric, 50)
            if isinstance(got, str):
                out[f"{cid}_p50_{metric}"] = got
                continue
            v, n = got                 # a fact with its case and sample count (core.facts: a P50 needs two)
            out[f"{cid}_p50_{metric}_ms"] = make(f"phase1/{cid}_p50_{metric}_ms", round(v, 3), unit="ms", source=cid,
                                                 samples=n, kind="percentile", definition=self.definition)
            out[f"{cid}_{metric}_samples"] = n
        for f in self.facts:           # one answer per question, as recorded (report.answers)
            out[f.name] = f
        if self.search is not None:
            out.update(search_stop=self.search.stop_reason, max_successful_c=self.search.max_successful_concurrency)
        if self.m1 is not None:
            bad = [c for c in ("M1_control", "M1_treatment")
                   if (r := case_result(self, c)) is None or r.verdict.verdict != "VALID"]
            if bad:
                out["M1_change"] = f"{', '.join(bad)} INVALID: not a result"
            else:
                ab = self.m1["ab"].set_index("metric")
                for key, metric in (("M1_output_tps_change_pct", "output_throughput"),
                                    ("M1_p95_tpot_change_pct", "p95_tpot_ms")):    # a % to one decimal, never -62.0013
                    v = ab.loc[metric, "change_pct"]
                    out[key] = None if v is None or pd.isna(v) else round(float(v), 1)
        return out


def result_value(r: CaseResult, definition: str, metric: str, p: float) -> tuple[float, int] | str:
    """(Pp of ``metric`` in ms, its sample count) of a case when it may be put forward — the case VALID and enough
    values for the percentile — else a short text saying why not (``P1 INVALID: client fell behind …``)."""
    if r.verdict.verdict != "VALID":
        why = "; ".join(r.verdict.reasons[:1]) or r.status
        return f"not a result: {r.case.case_id} INVALID ({why[:90]})"
    s = r.summaries.get(definition, {})
    n = mx.metric_count(s, metric)
    label, v = mx.shown_percentile(s, metric, p)
    if v is None or n < mx.min_samples(p):
        return f"not a result: {label}"
    return float(v), n


def percentile_table(result: CaseResult) -> pd.DataFrame:
    """P50/P90/P95/P99/mean/max of TTFT, TPOT, ITL, E2E for one case, both definitions side by side (ms); each
    percentile cell says how many values it rests on, or is ``max of N`` where too few do
    (``request_metrics.percentile_cell``)."""
    rows = []
    for d, s in result.summaries.items():
        for m in ("ttft", "tpot", "itl", "itl_per_token", "e2el"):
            rows.append({"definition": d, "metric": m, "n": mx.metric_count(s, m), "mean_ms": s.get(f"mean_{m}_ms"),
                         **{f"{st}_ms": mx.percentile_cell(s, m, float(st[1:])) for st in ("p50", "p90", "p95", "p99")},
                         "max_ms": s.get(f"max_{m}_ms")})
    return pd.DataFrame(rows)


def search_config(target: Any, params: Params, cases: list[CaseSpec]) -> SearchConfig:
    """The search on the decode shape of D1/D2, its points sized like the matrix's cases (``docs/case.md#sizing``):
    C = 1 sends as many requests as D1, a concurrent point at least two waves, each for ``min_duration_s``."""
    scale = SCALES[getattr(target, "scale", "local")]
    step = int(params.search_step or (16 if target.scale == "cluster" else 4))
    nmin = int(params.min_requests or scale["min_requests"])
    wt = scale["decode_weight"]
    n1 = c1_requests(scale["D_in"], scale["D_out"], scale["P1"] + wt * 1, nmin, wt)
    return SearchConfig(input_tokens=scale["D_in"], output_tokens=scale["D_out"], step=step,
                        max_concurrency=int(params.search_max_concurrency or 64),
                        definition=params.definition, c1_requests=n1,
                        min_window_s=float(params.min_duration_s or scale["min_window_s"]))


def resumable(runner: Callable[[CaseEnv, CaseSpec], CaseResult], skipped: list[str]
              ) -> Callable[[CaseEnv, CaseSpec], CaseResult]:
    """``runner`` that loads a case already measured (the resume rule of the matrix: ``case_is_done``) instead of
    measuring it again, and lists it in ``skipped``: with ``resume`` the concurrency search replays its stored
    points (same results, same decisions) and measures only the points it had not reached."""
    def run(env: CaseEnv, case: CaseSpec) -> CaseResult:
        cdir = env.run_dir / "cases" / case.case_id
        if case_is_done(cdir, case.num_prompts * env.repeats):
            res = load_case_result(case, cdir)
            res.status = SUCCESS
            skipped.append(case.case_id)
            return res
        return runner(env, case)
    return run


HEALTH_TIMEOUT_S = 900.0        # how long the engine may take to answer its health probe (not a notebook parameter)


def run(ctx: PhaseContext) -> Phase1Result:
    """Phase 1's entry (the phase contract), from the notebook's parameters (``ctx.params``): the parameters
    checked, the quick matrix's cases sized, the engine started, the matrix (and the concurrency search) measured
    and the engine stopped (:func:`_measure`), M1's A/B, then the phase tables and the recorded answers."""
    p = ctx.params
    if p.definition not in mx.DEFINITIONS:
        raise ParamError(f"definition must be one of {mx.DEFINITIONS}, got {p.definition!r}")
    if p.matrix != "quick":
        raise ParamError(f"matrix: only 'quick' exists (got {p.matrix!r})")
    cases = quick_matrix(ctx.target, list(p.cases or []), min_duration_s=float(p.min_duration_s or 0),
                         min_requests=int(p.min_requests or 0))
    matrix, search, restarts, server = _measure(ctx, p, cases)
    if matrix.aborted and not matrix.results:        # nothing measured: the phase fails with why (resume re-runs it)
        raise EngineCrash(f"the matrix stopped before its first case: {matrix.aborted}")
    res = Phase1Result(matrix, p.definition, search, _m1(matrix, p.definition), restarts + matrix.restarts, server)
    write_phase_tables(ctx.phase_dir, res)
    res.facts = answers.record_phase1(ctx.run_dir)          # from the tables just written; phase1.json again:
    write_phase_tables(ctx.phase_dir, res)                  # its headline states the recorded answers
    return res


def _measure(ctx: PhaseContext, p: Params, cases: list[CaseSpec]
             ) -> tuple[MatrixResult, SearchResult | None, list[dict[str, Any]], dict[str, Any]]:
    """(matrix, search or None, the OOM restarts, the server as started): the engine started inside a
    ``ProcessTracker``, the matrix run (an OOM restarts the engine before anything else is measured; an attached
    server is never restarted) and, with ``search``, the concurrency search; the engine stopped in ``finally``."""
    slo = mx.SLO(ttft_ms=p.slo_ttft_ms or None, tpot_ms=p.slo_tpot_ms or None)
    env_kw = dict(repeats=int(p.repeats), seed=int(p.seed), slo=slo, phase=ctx.phase, clients=int(p.clients or 1))
    log_dir = ctx.phase_dir / "server"
    restarts: list[dict[str, Any]] = []
    with ProcessTracker() as tracker:
        holder: dict[str, Any] = {"srv": start_server(ctx.target, log_dir, tracker, run_dir=ctx.run_dir,
                                                      phase=ctx.phase, health_timeout_s=HEALTH_TIMEOUT_S)}
        try:
            server = {"base_url": holder["srv"].base_url, "engine": ctx.target.engine, "info": engine_info(holder["srv"]),
                      "model_path": holder["srv"].model_path, "ready_s": holder["srv"].ready_s,
                      "attached": holder["srv"].attached}
            ctx.notes += holder["srv"].notes if holder["srv"].attached else []
            env = make_env(holder["srv"], ctx.run_dir, **env_kw)

            def on_oom(old: CaseEnv, res: CaseResult) -> CaseEnv:
                stop_server(old.srv, tracker, ctx.run_dir, ctx.phase)
                holder["srv"] = start_server(ctx.target, log_dir, tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                                             health_timeout_s=HEALTH_TIMEOUT_S)
                restarts.append({"after": res.case.case_id, "reason": "OOM"})
                ctx.notes.append(f"engine restarted after OOM in {res.case.case_id} (never measure on after an OOM)")
                return make_env(holder["srv"], ctx.run_dir, **env_kw)

            ctx.log_command("reproduce", ["servelab", "run", "phase1", "--target", ctx.target.name, "--run-id",
                                           ctx.run_id, "-p", f"repeats={env.repeats}", "-p", "resume=true"],
                        title="re-run / resume this phase")
            runner = recorded_runner(ctx, dispatch_case)
            # an attached server is never restarted: an OOM there stops the matrix with its reason
            matrix = run_matrix(env, cases, resume=bool(p.resume), case_runner=runner,
                                on_oom=None if holder["srv"].attached else on_oom)
            env = env if not restarts else make_env(holder["srv"], ctx.run_dir, **env_kw)
            search = None
            if p.search and not matrix.aborted:
                search_runner = resumable(runner, matrix.skipped) if p.resume else runner
                search = concurrency_search(env, search_config(ctx.target, p, cases), runner=search_runner)
        finally:
            stop_server(holder["srv"], tracker, ctx.run_dir, ctx.phase)
    return matrix, search, restarts, server


def _m1(matrix: MatrixResult, definition: str) -> dict[str, Any] | None:
    """M1's A/B (control against treatment) when both ran and the treatment has a result."""
    by_id = {r.case.case_id: r for r in matrix.results}
    if "M1_control" in by_id and "M1_treatment" in by_id and by_id["M1_treatment"].summaries:
        return m1_analysis(by_id["M1_control"], by_id["M1_treatment"], definition)
    return None


def recorded_runner(ctx: PhaseContext, runner: Callable[[CaseEnv, CaseSpec], CaseResult]
                    ) -> Callable[[CaseEnv, CaseSpec], CaseResult]:
    """``runner`` that, once a case's folder is written (whatever its verdict, an engine crash included), records
    the ``reproduce`` command re-running that case as a new attempt (once per case and run)."""
    def run(env: CaseEnv, case: CaseSpec) -> CaseResult:
        try:
            return runner(env, case)
        finally:
            if (Path(env.run_dir) / "cases" / case.case_id / "meta.json").is_file():
                ctx.log_command("reproduce", case_command(ctx.run_id, case.case_id),
                            title=f"re-run case {case.case_id}", unique=True)
    return run


def write_phase_tables(phase_dir: Path, res: Phase1Result) -> None:
    """``matrix.csv`` (both definitions, merged by case like ``summary.csv``), ``search.json`` +
    ``frontier.csv``, ``m1_*.csv``, ``phase1.json``."""
    phase_dir.mkdir(parents=True, exist_ok=True)
    merge_table(phase_dir / "matrix.csv", res.matrix.frame(), SUMMARY_KEYS)     # other cases' rows kept
    if res.search is not None:
        write_json_atomic(phase_dir / "search.json", {
            "stop_reason": res.search.stop_reason, "stop_detail": res.search.stop_detail,
            "max_successful_concurrency": res.search.max_successful_concurrency,
            "max_tps_concurrency": res.search.max_tps_concurrency,
            "max_under_slo_concurrency": res.search.max_under_slo_concurrency, "slo": res.search.slo,
            "definition": res.search.definition, "points": [asdict(x) for x in res.search.points]})
        res.search.frontier().to_csv(phase_dir / "frontier.csv", index=False)
    if res.m1 is not None:
        res.m1["ab"].to_csv(phase_dir / "m1_ab.csv", index=False)
        res.m1["windows"].to_csv(phase_dir / "m1_windows.csv", index=False)
    write_json_atomic(phase_dir / "phase1.json", {"headline": plain(res.headline()), "aborted": res.aborted,
                                                  "not_executed": res.not_executed, "restarts": res.restarts,
                                                  "skipped_on_resume": res.matrix.skipped, "server": res.server})


def load_case(run_dir: Path, case: CaseSpec) -> CaseResult:
    return load_case_result(case, Path(run_dir) / "cases" / case.case_id)


# ---------------------------------------------------------------- what the notebook shows (None-safe)

def case_result(res: Phase1Result, case_id: str) -> CaseResult | None:
    return next((r for r in res.matrix.results if r.case.case_id == case_id), None)


def definitions_table(res: Phase1Result, case_id: str = "D1") -> pd.DataFrame:
    """One case's percentiles under both definitions (falls back to the first case that ran)."""
    r = case_result(res, case_id) or (res.matrix.results[0] if res.matrix.results else None)
    if r is None or not r.summaries:
        return pd.DataFrame({"note": [f"case {case_id} has no result"]})
    return percentile_table(r).assign(case_id=r.case.case_id)


def search_table(res: Phase1Result) -> pd.DataFrame:
    """The three concurrency answers and the stop reason (or why the search did not run)."""
    if res.search is None:
        why = "aborted run" if res.aborted else "search=False"
        return pd.DataFrame({"answer": ["search not run"], "detail": [why]})
    return res.search.answers()


def m1_tables(res: Phase1Result) -> pd.DataFrame:
    """M1 control vs treatment: one row per metric (control, treatment, change)."""
    if res.m1 is None:
        return pd.DataFrame({"note": ["M1 did not run (or failed): no A/B"]})
    return res.m1["ab"]


def m1_windows_table(res: Phase1Result) -> pd.DataFrame:
    """The background's ITL per window of M1 (before, during and after the injected prefill), each percentile with
    the gaps it rests on or ``max of N`` where too few."""
    if res.m1 is None:
        return pd.DataFrame({"note": ["M1 did not run (or failed): no ITL windows"]})
    return mx.labelled_percentiles(res.m1["windows"], counts={"itl": "n"})


# ---------------------------------------------------------------- M1 stalls and TTFT split from the engine's log

def m1_log_join(res: Phase1Result, sides: dict[str, Any] | None = None) -> Any:
    """M1 treatment's client chunks joined with the prefills its engine log times (``analyse.serverside.log_join``,
    docs/metrics.md#m1-log-join); None when M1 did not run or its files are missing."""
    r = case_result(res, "M1_treatment")
    side = (sides if sides is not None else m1_serverside(res)).get("treatment")
    if r is None or side is None:
        return None
    try:
        recs = [x for x in read_records(r.case_dir / "requests.jsonl") if x.repeat == 0 and x.role != "warmup"]
    except OSError:
        return None
    return log_join(recs, side, _adapter(r.case_dir))


def memory_table(res: Phase1Result, phase_dir: Path) -> pd.DataFrame:
    """What the engine printed about its memory at start (weights, KV pool, compute buffers; the routine Phase 8
    uses), from this phase's server log; says so where the engine does not print it at its log level."""
    engine = res.server.get("engine")
    logs = sorted(Path(phase_dir, "server").glob("*.log"))
    if not logs or not engine:
        return pd.DataFrame({"note": ["no server log in this phase: memory not read"]})
    mem = memory_layer.memory_breakdown(logs[0].read_text(errors="replace"), engine_for(engine))
    out = mem.drop(columns=[c for c in ("line",) if c in mem.columns]).rename(columns={"mib": "MiB"})
    return out.assign(log=logs[0].name)


def memory_cases(res: Phase1Result, phase_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The memory layer per case beside its output TPS (``analyse.memory``, ``docs/metrics.md#memory``): weights,
    KV pool and its peak use, graphs, workspace and allocated/reserved where the engine exposes them, from each
    case's ``/metrics`` scrapes, this phase's engine log (start-up lines) and the case's log excerpt. Returns (table,
    where each number came from); both are written to ``phase1/memory_per_case.csv`` / ``memory_sources.csv``."""
    dirs = [r.case_dir for r in res.matrix.results]
    if res.search is not None:
        dirs += [Path(phase_dir).parent / "cases" / p.case_id for p in res.search.points]
    logs = sorted(Path(phase_dir, "server").glob("*.log"))
    engine = res.server.get("engine")
    table, sources = memory_layer.memory_table(dirs, res.definition,
                                               startup_log=logs[0].read_text(errors="replace") if logs else None,
                                               adapter=engine_for(engine) if engine else None)
    table.to_csv(Path(phase_dir) / "memory_per_case.csv", index=False)
    sources.to_csv(Path(phase_dir) / "memory_sources.csv", index=False)
    return memory_layer.page_view(table), sources


# ---------------------------------------------------------------- the server-side layer (docs/metrics.md#server-side)

def _adapter(case_dir: Path) -> Any:
    return engine_for(json.loads((case_dir / "meta.json").read_text())["engine"])


def m1_serverside(res: Phase1Result) -> dict[str, Any]:
    """M1's control and treatment runs seen from the engine, each on the window of its first repeat (the window
    the ITL timeline shows): ``{"control": ServerSide, "treatment": ServerSide}``; empty if M1 did not run."""
    out: dict[str, Any] = {}
    if res.m1 is None:
        return out
    for run, cid in (("control", "M1_control"), ("treatment", "M1_treatment")):
        r = case_result(res, cid)
        if r is None:
            continue
        try:
            t0, t1 = records_window(r.case_dir)
            out[run] = case_serverside(r.case_dir, _adapter(r.case_dir), t0, t1)
        except (OSError, ValueError, KeyError):   # a case without its raw files: the page shows the others
            continue
    return out


def serverside_percentiles(res: Phase1Result) -> pd.DataFrame:
    """Per case: the client's TTFT/ITL/E2E percentiles beside the engine's histogram percentiles (bucket-
    interpolated, with the bucket that holds the server's P95) and its queue time; one row per case saying so
    where the engine exposes no histograms."""
    frames = []
    for r in res.matrix.results:
        if not r.summaries:
            continue
        try:
            adapter = _adapter(r.case_dir)
            hist = server_percentiles(read_metrics(r.case_dir), adapter)
        except (OSError, ValueError, KeyError) as exc:
            frames.append(pd.DataFrame([{"case": r.case.case_id, "metric": "-",
                                         "note": f"server metrics unreadable: {type(exc).__name__}"}]))
            continue
        if hist.empty:
            why = (f"{adapter.name} exposes no latency histograms on /metrics" if not adapter.histogram_series
                   else "fewer than two scrapes with histogram samples")
            frames.append(pd.DataFrame([{"case": r.case.case_id, "metric": "-", "note": why}]))
            continue
        frames.append(client_vs_server(r.summaries.get(res.definition, {}), hist, r.case.case_id))
    if not frames:
        return pd.DataFrame({"note": ["no case with results"]})
    out = pd.concat(frames, ignore_index=True)
    if "note" in out and out["note"].notna().all() and out["note"].nunique() == 1:
        return pd.DataFrame({"cases": [", ".join(out["case"])], "note": [out["note"].iloc[0] + ": the client's "
                             "percentiles above are the only latency percentiles of this run"]})
    return out


def run_status(res: Phase1Result) -> pd.DataFrame:
    """Per case: status, verdict, reasons; then the cases not executed and why the run stopped."""
    rows = [{"case_id": r.case.case_id, "status": r.status, "validity": r.verdict.verdict,
             "reasons": "; ".join(r.verdict.reasons), "notes": "; ".join(r.case.notes),
             "resumed": r.case.case_id in res.matrix.skipped} for r in res.matrix.results]
    rows += [{"case_id": c, "status": "NOT EXECUTED", "validity": "-", "reasons": res.aborted or "",
              "notes": "", "resumed": False} for c in res.not_executed]
    return pd.DataFrame(rows)


def _num(v: Any, digits: int = 1) -> str:
    """``digits`` decimals; below 1 three significant digits (a 0.0031 ms TPOT must not read 0.00)."""
    if v is None or pd.isna(v):
        return "—"
    v = float(v)
    return f"{v:.3g}" if 0 < abs(v) < 1 else f"{v:,.{digits}f}"


def answers_sentence(facts: list[Fact], max_successful: int | None, slo: str) -> str:
    """The run's three concurrency answers in one sentence, each as its recorded fact shows it; an unsettled
    maximum (both sides with their concurrencies) is said once, not again for its concurrency."""
    got = {f.name: f.shown() for f in facts}
    tps, at = got.get(answers.MAX_TPS, "—"), got.get(answers.MAX_TPS_C, "—")
    max_tps = f"max output TPS and its concurrency {tps}" if tps == at else f"max output TPS {tps}, at concurrency {at}"
    return (f"Concurrency search: max successful concurrency {max_successful or '—'}; the run's answers (search and "
            f"matrix together) — {max_tps}, max concurrency under the SLO ({slo}) "
            f"{got.get(answers.MAX_UNDER_SLO_C, '—')}.")


def findings(res: Phase1Result, run_dir: Path | None = None) -> list[str]:
    """What Phase 1 found, in sentences for the page's findings box: the three concurrency answers and the stop
    reason, M1's effect on P95 TPOT and output TPS with its validity, the matrix's validity and key numbers — each
    number from a VALID case with enough samples for its statistic — and the cross-checks of results that answer
    the same question (``report.crosscheck``: search vs matrix, Phase 2's replays)."""
    out: list[str] = [f"Measured on {res.server['base_url']}, {ATTACH_NOTE}."] if res.server.get("attached") else []
    df = res.matrix.frame(res.definition)
    s = res.search
    if s is not None:
        slo = ", ".join(f"P95 {k.split('_')[0].upper()} ≤ {v:g} ms" for k, v in (s.slo or {}).items() if v) or "no SLO"
        out.append(answers_sentence(res.facts, s.max_successful_concurrency, slo))
        bad = [p for p in s.points if p.verdict != "VALID"]
        out.append(f"The search stopped with {s.stop_reason}" + (f": {s.stop_detail}" if s.stop_detail else "")
                   + (f"; {len(bad)} of its {len(s.points)} points INVALID, decided nothing ("
                      + "; ".join(f"C={p.concurrency}: {(p.reasons or ['?'])[0]}" for p in bad[:3]) + ")"
                      if bad else "") + ".")
    else:
        out.append("The concurrency search did not run (" + ("the run was aborted" if res.aborted else "search=false")
                   + "): no concurrency answer from this run.")
    by_id = {r.case.case_id: r for r in res.matrix.results}
    if res.m1 is not None:
        ab = res.m1["ab"].set_index("metric")
        verdicts = {k: by_id[k].verdict for k in ("M1_control", "M1_treatment") if k in by_id}
        invalid = {k: v for k, v in verdicts.items() if v.verdict != "VALID"}
        validity = ("both runs VALID" if not invalid else
                    "not valid — " + "; ".join(f"{k} {v.verdict} ({', '.join(v.reasons) or 'no reason given'})"
                                              for k, v in invalid.items()) + ", so this is not a result")

        def change(metric: str, unit: str, digits: int) -> str:
            r = ab.loc[metric] if metric in ab.index else None
            if r is None:
                return f"{metric} not measured"
            pct = "" if r["change_pct"] is None or pd.isna(r["change_pct"]) else f" ({float(r['change_pct']):+.0f} %)"
            return f"{_num(r['control'], digits)} → {_num(r['treatment'], digits)} {unit}{pct}"
        def tail(metric: str, p: float) -> str:
            # each side's percentile as shown: with its count, or "max of N" where too few values hold it
            sides = [by_id[k].summaries.get(res.definition, {}) if k in by_id else {}
                     for k in ("M1_control", "M1_treatment")]
            shown = [mx.shown_percentile(x, metric, p) for x in sides]
            return " → ".join(f"{_num(v, 2)} ms ({lab})" for lab, v in shown)
        if invalid:
            out.append(f"M1 (one long prefill injected into the decode background): {validity}.")
        else:
            out.append(f"M1 (one long prefill injected into the decode background): TPOT tail "
                       f"{tail('tpot', 95)}, output TPS {change('output_throughput', 'tok/s', 1)}; "
                       f"{validity}.")
        side = m1_serverside(res).get("treatment")
        if side is not None:
            t = side_summary(side)
            seen = [f"{label} {_num(t[key], 0)}" for key, label in (("running max (req)", "at most"),
                                                                     ("queued max (req)", "queued at most"))
                    if t[key] is not None]
            out.append(f"The engine's own view of M1's treatment window: {len(side.lines)} scheduler log lines"
                       + (f"; /metrics: {' running, '.join(seen)}" if seen else "; no /metrics scrape inside it")
                       + (f"; slots in use per its log up to {_num(t['slots in use max (log)'], 0)}"
                          if t["slots in use max (log)"] is not None else "") + ".")
            out.append(m1_stall_sentence(m1_log_join(res, {"treatment": side})))
    elif any(c.startswith("M1") for c in [*by_id, *res.not_executed]):
        out.append("M1 produced no A/B (a side failed or did not run): no statement about interference.")
    if not df.empty:
        bad = df[df["validity"] != "VALID"]
        text = f"{len(df) - len(bad)} of {len(df)} cases VALID"
        if len(bad):
            text += "; INVALID (never shown as results): " + "; ".join(
                f"{r.case_id} ({r.validity_reasons or r.status})" for r in bad.head(4).itertuples()) \
                + (" …" if len(bad) > 4 else "")
        nums = []
        for cid, metric, what in (("P1", "ttft", "prefill floor"), ("D1", "tpot", "single stream")):
            r = by_id.get(cid)
            if r is not None and r.summaries:
                got = result_value(r, res.definition, metric, 50)
                if not isinstance(got, str):
                    nums.append(f"{cid} P50 {metric.upper()} ({what}) {_num(got[0], 2)} ms, "
                                f"{mx.percentile_label(50, got[1])}")
        if s is None and (f := next((x for x in res.facts if x.name == answers.MAX_TPS), None)) is not None:
            nums.append(f"max output TPS {f.shown()}")
        out.append(text + (". " + ", ".join(nums) if nums else "") + ".")
        if (long := long_decode_sentence(long_decode_table(df))) is not None:
            out.append(long)
    if res.aborted:
        out.append(f"The run stopped early ({res.aborted}); not executed: {', '.join(res.not_executed) or 'none'}.")
    rdir = run_dir or (res.matrix.results[0].case_dir.parent.parent if res.matrix.results else None)
    if rdir is not None and Path(rdir, "cases").is_dir():
        out += crosscheck.findings(rdir, phases=("phase1",))
    return out


# ---------------------------------------------------------------- evidence for the ledger (H4, H6)

M1_H4_FACTOR = 1.2        # the treatment's P95 ITL during the injection over the larger reference, to support H4
M1_MIN_GAPS = mx.min_samples(95)   # token gaps a P95 of the treatment's during window needs (20) to judge


def h4_evidence(res: Phase1Result) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H4 from the mixed A/B M1: the treatment's P95 ITL *during* the injected
    prefill against the larger of its own *before* window and the control's same window. *supported* when it is
    ≥ 1.2× that reference, *refuted* below; *inconclusive* without M1, with an INVALID M1 case or fewer token gaps
    during the injection than a P95 needs (20, ``request_metrics.min_samples``)."""
    if res.m1 is None:
        return "inconclusive", "M1 (the mixed A/B) did not run", {}
    bad = [f"{c}: {'; '.join(r.verdict.reasons[:2])}" for c in ("M1_control", "M1_treatment")
           if (r := case_result(res, c)) is not None and r.verdict.verdict != "VALID"]
    if bad:
        return "inconclusive", "an M1 case is INVALID — " + " | ".join(bad), {}
    w = res.m1["windows"].set_index(["run", "window"]) if not res.m1["windows"].empty else pd.DataFrame()

    def p95(run: str, window: str) -> tuple[float | None, int]:
        if w.empty or (run, window) not in w.index:
            return None, 0
        return float(w.loc[(run, window), "p95_itl_ms"]), int(w.loc[(run, window), "n"])
    during, n = p95("treatment", "during")
    before, _ = p95("treatment", "before")
    control, _ = p95("control", "during")
    nums = {"treatment_during_p95_itl_ms": during, "treatment_before_p95_itl_ms": before,
            "control_during_p95_itl_ms": control, "during_gaps": n, "factor": M1_H4_FACTOR}
    refs = [x for x in (before, control) if x]
    if during is None or n < M1_MIN_GAPS or not refs:
        return "inconclusive", f"{n} token gaps during the injection (need {M1_MIN_GAPS}) or no reference window", nums
    ref = max(refs)
    nums["ratio"] = round(during / ref, 3)
    text = (f"M1: background ITL {mx.percentile_label(95, n)} {during:.1f} ms during the injected prefill vs "
            f"{ref:.1f} ms reference "
            f"(treatment before {before or float('nan'):.1f} ms, control same window {control or float('nan'):.1f} ms): "
            f"{during / ref:.2f}×, threshold {M1_H4_FACTOR:g}×")
    return ("supported" if during >= M1_H4_FACTOR * ref else "refuted"), text, nums


def h6_evidence(res: Phase1Result) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H6 (KV capacity limits concurrency) from the concurrency search's stop
    reason: ``OOM`` → *supported*; ``MAX_CONCURRENCY_REACHED`` with every point successful → *refuted* up to that
    concurrency; any other stop (throughput, SLO, crash) → *inconclusive* (KV usage, Phase 8, says whether KV was
    the cause)."""
    s = res.search
    if s is None:
        return "inconclusive", "the concurrency search did not run", {}
    nums = {"stop_reason": s.stop_reason, "max_successful_c": s.max_successful_concurrency,
            "max_tps_c": s.max_tps_concurrency, "points": len(s.points)}
    failed = [p for p in s.points if p.status != "success"]
    if s.stop_reason == "OOM":
        return "supported", f"the search stopped on OOM: {s.stop_detail} (max successful C={s.max_successful_concurrency})", nums
    if s.stop_reason == "MAX_CONCURRENCY_REACHED" and not failed:
        return "refuted", (f"every search point up to C={max(p.concurrency for p in s.points)} succeeded, no OOM "
                           f"({s.stop_detail}): KV capacity did not limit concurrency here"), nums
    return "inconclusive", (f"the search stopped on {s.stop_reason} ({s.stop_detail}), not on memory; KV usage "
                            "(Phase 8) says whether KV was the limit"), nums


def record_h4(ctx: PhaseContext, res: Phase1Result) -> pd.DataFrame:
    """Record H4 from M1 (see :func:`h4_evidence`), linking ``m1_windows.csv`` / ``m1_ab.csv``."""
    verdict, summary, nums = h4_evidence(res)
    tables = [t for t in ("m1_windows.csv", "m1_ab.csv") if (Path(ctx.phase_dir) / t).is_file()] or ["matrix.csv"]
    return evidence_frame([record_evidence(ctx, "H4", verdict, summary, anchor="Mixed-A/B-(M1)", table=tables,
                                           numbers=nums)])


def record_h6(ctx: PhaseContext, res: Phase1Result) -> pd.DataFrame:
    """Record H6 from the concurrency search (see :func:`h6_evidence`), linking ``frontier.csv`` / ``search.json``."""
    verdict, summary, nums = h6_evidence(res)
    tables = [t for t in ("frontier.csv", "search.json") if (Path(ctx.phase_dir) / t).is_file()] or ["matrix.csv"]
    return evidence_frame([record_evidence(ctx, "H6", verdict, summary, anchor="Concurrency-search", table=tables,
                                           numbers=nums)])
