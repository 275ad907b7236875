"""Phase 9 — speculative decoding: acceptance from counter deltas, draft overhead, net gain per concurrency.

Seeds §14: record accept rate, mean accept length, target forward TPS, draft/MTP overhead, CPU scheduling
bubbles and the net gain at several concurrencies — never only the accept length, never only C = 1.

**Acceptance** comes from the engine's counters over the exact measurement window (a ``/metrics`` snapshot
taken at idle right before the measured requests and one right after they all finished), as ``vllm bench
serve`` does it (``../shared/research/bench_clients.md`` §4) — never from a running average such as SGLang's
``avg_spec_accept_length``:

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

**llama.cpp locally**: real draft-model speculative decoding, ``-md <draft.gguf> --spec-type draft-simple
--spec-draft-n-max N`` (the draft must share the target's vocabulary). With the model as its own draft
(``self``) greedy decoding accepts every draft token by construction — an upper bound that also pays a draft as
large as the target; with an independent random model of the same vocabulary (``random:<seed>``, tiny target
only) nearly nothing is accepted — the lower bound, pure overhead. ``--spec-synth-rates`` (llama.cpp's
benchmarking-only synthetic acceptance; the generated text is not valid) gives known per-position rates.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.case import CaseEnv, case_seed, flush_cache, max_request_tokens, read_log_since
from servelab.measure.client import RequestRecord, run_requests
from servelab.measure.launch_variants import (Snapshot, delta_of, metrics_snapshot, server_cpu_s, snapshot_deltas,
                                      write_run_record)
from servelab.core.run import write_json_atomic
from servelab.target.server import RunningServer, is_healthy
from servelab.measure.workload import build_workload

SCALES: dict[str, dict[str, Any]] = {
    "cluster": {"input_tokens": 1024, "output_tokens": 1024, "concurrencies": [1, 16, 32]},
    "local": {"input_tokens": 32, "output_tokens": 32, "concurrencies": [1, 4]},
}
MODEL_SCALES: dict[str, dict[str, Any]] = {"tiny": {"output_tokens": 256}}
PER_POS_SERIES = {"llamacpp": "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"}
LOG_ACCEPT_RE = re.compile(r"draft acceptance = +(?P<rate>[\d.]+) \( *(?P<acc>\d+) accepted / +(?P<gen>\d+) "
                           r"generated\)")


@dataclass
class SpecConfig:
    """One speculative setting. ``draft`` None = speculation off (the baseline)."""
    label: str
    draft: str | None = None            # "self" | "random:<seed>" (tiny only) | a GGUF path
    num_draft_tokens: int = 3
    draft_min: int = 0
    synth_rates: list[float] = field(default_factory=list)   # llama.cpp --spec-synth-rates (benchmarking only)

    @property
    def enabled(self) -> bool:
        return self.draft is not None


def parse_configs(drafts: list[str], num_draft_tokens: int, synth_rates: list[float] | None = None,
                  model: str = "") -> list[SpecConfig]:
    """The baseline (off) plus one config per draft; an empty list means the model's default drafts."""
    if not drafts:
        drafts = ["self", "random:1"] if model == "tiny" else ["self"]
    out = [SpecConfig("off")]
    for d in drafts:
        out.append(SpecConfig(f"draft={d} n={num_draft_tokens}", d, num_draft_tokens))
    if synth_rates:
        out.append(SpecConfig(f"draft=self n={len(synth_rates)} synthetic {','.join(map(str, synth_rates))}", "self",
                              len(synth_rates), synth_rates=list(synth_rates)))
    return out


def draft_path(draft: str, target: Any) -> str:
    """The GGUF of a draft key: ``self`` = the target's model, ``random:<seed>`` = a tiny random model with the
    tiny model's vocabulary (generated once into the model cache), else a path."""
    from servelab.target.models import models_dir, resolve_model, write_tiny_gguf
    from servelab.core.params import ParamError
    if draft == "self":
        return str(resolve_model(target.model))
    if draft.startswith("random:"):
        if target.model != "tiny":
            raise ParamError(f"draft '{draft}': a random draft shares only the tiny model's vocabulary "
                             f"(target model is {target.model!r})")
        seed = int(draft.split(":", 1)[1])
        p = models_dir() / f"tiny-random-llama-seed{seed}.gguf"
        return str(p if p.exists() else write_tiny_gguf(p, seed=seed))
    p = Path(draft).expanduser()
    if not p.exists():
        raise ParamError(f"draft model '{draft}' is neither 'self', 'random:<seed>' nor an existing file")
    return str(p)


def launch_changes(cfg: SpecConfig, target: Any) -> dict[str, Any]:
    """Launch settings for ``cfg`` on llama.cpp: extra argv items (see the module docstring for why not
    ``launch.spec``: the adapter emits ``--draft-max``, which this llama.cpp removed)."""
    from servelab.core.params import ParamError
    if target.engine != "llamacpp":
        raise ParamError(f"phase 9 runs speculative decoding on llama.cpp; for {target.engine} set launch.spec on "
                         "two targets and compare their runs with servelab.measure.abtest")
    base = [str(a) for a in (target.launch.get("extra_args") or [])]
    if not cfg.enabled:
        return {"extra_args": base or None}
    args = ["-md", draft_path(cfg.draft, target), "--spec-type", "draft-simple",
            "--spec-draft-n-max", str(cfg.num_draft_tokens), "--spec-draft-n-min", str(cfg.draft_min)]
    if cfg.synth_rates:
        args += ["--spec-synth-rates", ",".join(f"{r:g}" for r in cfg.synth_rates)]
    return {"extra_args": base + args}


# ---------------------------------------------------------------- acceptance from counter deltas

def acceptance(deltas: pd.DataFrame, metric_names: dict[str, str], engine: str) -> dict[str, Any]:
    """Acceptance rate, mean acceptance length and per-position acceptance from counter deltas."""
    drafts = delta_of(deltas, metric_names.get("spec_drafts_total", ""))
    draft_tokens = delta_of(deltas, metric_names.get("spec_draft_tokens_total", ""))
    accepted = delta_of(deltas, metric_names.get("spec_accepted_tokens_total", ""))
    out: dict[str, Any] = {"d_drafts": drafts, "d_draft_tokens": draft_tokens, "d_accepted": accepted,
                           "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                           "mean_accept_length": 1 + accepted / drafts if drafts else None}
    series = metric_names.get("spec_accepted_per_pos_total") or PER_POS_SERIES.get(engine, "")
    per_pos = {}
    if series and not deltas.empty and drafts:
        sel = deltas[deltas["name"] == series]
        for _, r in sel.iterrows():
            m = re.search(r"position=(\d+)", r["labels"])
            if m:
                per_pos[int(m.group(1))] = r["delta"] / drafts
    out["per_position"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def log_acceptance(log_text: str) -> dict[str, int]:
    """Σ accepted and Σ generated draft tokens from llama.cpp's per-request ``draft acceptance`` log lines."""
    acc = gen = n = 0
    for m in LOG_ACCEPT_RE.finditer(log_text):
        acc += int(m.group("acc"))
        gen += int(m.group("gen"))
        n += 1
    return {"log_requests": n, "log_accepted": acc, "log_generated": gen}


# ---------------------------------------------------------------- one point: a config at one concurrency

@dataclass
class SpecPoint:
    config: SpecConfig
    concurrency: int
    repeat: int
    case_dir: Path
    row: dict[str, Any]
    records: list[RequestRecord]
    before: Snapshot | None
    after: Snapshot | None


def run_spec_point(srv: RunningServer, run_dir: Path, cfg: SpecConfig, concurrency: int, input_tokens: int,
                   output_tokens: int, pool: list[int], seed: int = 0, repeat: int = 0, definition: str = "vllm",
                   case_id: str = "", phase: str = "phase9") -> SpecPoint:
    """Warm-up, flush, snapshot, ``concurrency`` decode requests, snapshot; raw data first, then the row.

    The measured requests use the same seed in every config, so speculation on and off decode the same prompts.
    Written through the case contract (:class:`servelab.measure.case_record.CaseFolder`): one folder per
    repeat, ``repeat_of`` = the config at this concurrency (``S9_<config>_c<C>``).
    """
    from servelab.measure.case_record import CaseFolder
    cid = case_id or f"S9_{_slug(cfg.label)}_c{concurrency}_r{repeat}"
    folder = CaseFolder(run_dir, cid, phase, "speculative", {
        "config": asdict(cfg), "concurrency": concurrency, "repeat": repeat, "engine": srv.target.engine,
        "launch": srv.target.launch, "definition": definition})
    cdir = folder.dir
    if not is_healthy(srv):
        folder.finish("ENGINE_CRASH", "engine unhealthy before the case")
        raise RuntimeError(f"{cid}: engine unhealthy before the case")
    env = CaseEnv(srv=srv, run_dir=Path(run_dir), pool=pool, seed=seed)
    ccfg = env.client_config(cid)
    wl_w = build_workload(cid + "-warmup", 1, input_tokens, min(output_tokens, 8), pool,
                          seed=case_seed(seed, f"S9-warmup-c{concurrency}", repeat), role="warmup", start_index=10**6)
    records = list(run_requests(wl_w.requests, ccfg, concurrency=1).records)
    folder.meta["cache_flush"] = flush_cache(env)
    # the same prompts for every config (seed independent of the config)
    wl = build_workload(cid, concurrency, input_tokens, output_tokens, pool,
                        seed=case_seed(seed, f"S9-c{concurrency}", repeat))
    log_off = settled_log_offset(env)
    before = metrics_snapshot(srv)
    cpu0 = server_cpu_s(srv)
    error = ""
    run = None
    try:
        run = run_requests(wl.requests, ccfg, concurrency=concurrency, repeat=repeat)
        records += run.records
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = metrics_snapshot(srv)
    cpu1 = server_cpu_s(srv)
    settled_log_offset(env)                      # the last requests' lines are written
    log_text, _ = read_log_since(env, log_off)
    folder.write_requests(records)
    folder.write_metrics(before=before, after=after)
    folder.write_log_excerpt(log_text)
    row = spec_row(srv, cfg, concurrency, repeat, records, run, before, after, cpu0, cpu1, log_text, definition, error)
    row["case_id"] = cid
    status = "success" if not error else "failed"
    repeat_of = case_id or f"S9_{_slug(cfg.label)}_c{concurrency}"
    folder.write_summary(spec_point_summary(cfg, row, records, run, status, definition, repeat, repeat_of))
    folder.finish(status, error)
    return SpecPoint(cfg, concurrency, repeat, cdir, row, records, before, after)


def spec_point_summary(cfg: SpecConfig, row: dict[str, Any], records: list[RequestRecord], run: Any, status: str,
                       definition: str, repeat: int, repeat_of: str) -> Any:
    """The case summary of a speculative point: the row's verdict, the measured requests' metrics (with the
    acceptance numbers beside them) as repeat ``repeat`` of ``repeat_of``, the row in ``details``."""
    from servelab.measure.case_record import INVALID, VALID, CaseSummary, request_counts, verdict
    measured = [r for r in records if r.role == "measure"]
    pooled = {definition: mx.summarize(measured, max(run.duration_s, 1e-9), definition)} if run and measured else {}
    reasons = [x for x in str(row.get("reasons") or "").split("; ") if x]
    ok = row.get("validity") == "VALID" and status == "success"
    if not ok and not reasons:
        reasons = [f"case status {status}"]
    rep = {definition: {**pooled[definition], **{k: row.get(k) for k in ACCEPTANCE_KEYS}}} if pooled else {}
    return CaseSummary(
        case_id=row["case_id"], phase="", kind="speculative", status=status,
        verdict=verdict(VALID if ok else INVALID, [] if ok else reasons), definition=definition, metrics=pooled,
        repeats=[{"repeat": repeat, "metrics": rep}] if rep else [], counts=request_counts(records),
        repeat_of=repeat_of, details={"config": asdict(cfg),
                                      "row": {k: v for k, v in row.items() if k not in ("validity", "reasons")}})


ACCEPTANCE_KEYS = ("acceptance_rate", "mean_accept_length", "tokens_per_target_forward", "step_ms",
                   "server_cpu_idle_pct")


def settled_log_offset(env: CaseEnv, quiet_s: float = 0.1, timeout_s: float = 2.0) -> int:
    """The engine log's length once it stopped growing for ``quiet_s`` (llama.cpp logs from a background
    thread: a request's last line can land a few ms after its response)."""
    import time
    _, off = read_log_since(env, 0)
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        time.sleep(quiet_s)
        _, new = read_log_since(env, 0)
        if new == off:
            break
        off = new
    return off


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
    row["per_position"] = acc.get("per_position", [])
    gen = delta_of(deltas, names.get("generation_tokens_total", "")) if not deltas.empty else None
    fwd = delta_of(deltas, names.get("decode_calls_total", "")) if not deltas.empty else None
    want = sum(int(r.completion_tokens or 0) for r in measured if r.ok)
    row["d_generated"] = gen
    row["window_matches_requests"] = (gen is not None and int(gen) == want)
    if gen is not None and int(gen) != want:
        reasons.append(f"counter window holds {gen:.0f} generated tokens, the measured requests {want}: "
                       "the window is not exact")
    if srv.target.engine == "llamacpp" and cfg.enabled:
        la = log_acceptance(log_text)
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
                    "p50_e2el_ms": s["p50_e2el_ms"], "duration_s": run.duration_s})
        if s["failed"]:
            reasons.append(f"{s['failed']} request(s) failed: {s['errors_by_kind']}")
        if s["token_check"]["mismatches"] and not cfg.synth_rates:
            reasons.append(f"achieved tokens off target in {s['token_check']['mismatches']} request(s)")
    row["validity"] = "INVALID" if reasons else "VALID"
    row["reasons"] = "; ".join(reasons)
    row["definition"] = definition
    return row


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9=.]+", "-", text).strip("-")


# ---------------------------------------------------------------- net gain vs the baseline

def net_gain(points: pd.DataFrame) -> pd.DataFrame:
    """Per speculative config and concurrency, against ``off`` at the same concurrency (means over repeats):
    output-TPS gain, TPOT change, draft overhead per target step, acceptance — never acceptance alone."""
    if points.empty:
        return pd.DataFrame()
    ok = points[points["validity"] == "VALID"]
    keys = ["output_throughput", "p50_tpot_ms", "p95_tpot_ms", "step_ms", "tokens_per_target_forward",
            "acceptance_rate", "mean_accept_length", "server_cpu_idle_pct"]
    mean = ok.groupby(["config", "concurrency"], sort=False)[[k for k in keys if k in ok.columns]].mean()
    rows = []
    for (config, c), r in mean.iterrows():
        if config == "off" or ("off", c) not in mean.index:
            continue
        b = mean.loc[("off", c)]
        reps = ok[(ok["config"] == config) & (ok["concurrency"] == c)]
        breps = ok[(ok["config"] == "off") & (ok["concurrency"] == c)]
        gain = 100.0 * (r["output_throughput"] / b["output_throughput"] - 1) if b["output_throughput"] else None
        spread = None
        if len(reps) > 1 and len(breps) > 1:
            spread = (f"spec {reps['output_throughput'].min():.3g}–{reps['output_throughput'].max():.3g}, "
                      f"off {breps['output_throughput'].min():.3g}–{breps['output_throughput'].max():.3g}")
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
                     "verdict": "gain" if gain is not None and gain > 0 else "loss"})
    return pd.DataFrame(rows)


def per_position_frame(points: pd.DataFrame) -> pd.DataFrame:
    """Per config, concurrency and draft position: Δaccepted_pos / Δdrafts (long format)."""
    rows = []
    for _, r in points[points["speculative"]].iterrows():
        for i, v in enumerate(r.get("per_position") or []):
            rows.append({"config": r["config"], "concurrency": r["concurrency"], "repeat": r["repeat"],
                         "position": i, "acceptance": v})
    return pd.DataFrame(rows, columns=["config", "concurrency", "repeat", "position", "acceptance"])


# ---------------------------------------------------------------- Phase 9 end to end

@dataclass
class Phase9Result:
    configs: list[SpecConfig]
    points: pd.DataFrame
    gain: pd.DataFrame
    per_position: pd.DataFrame
    ab: Any = None
    errors: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def headline(self) -> dict[str, Any]:
        out: dict[str, Any] = {"configs": [c.label for c in self.configs], "errors": len(self.errors)}
        for _, r in self.gain.iterrows():
            key = f"{r['config']} C={r['concurrency']}"
            out[key] = {"acceptance_rate": _rounded(r["acceptance_rate"], 3),
                        "mean_accept_length": _rounded(r["mean_accept_length"], 2),
                        "net_gain_pct": _rounded(r["net_gain_pct"], 1)}
        return out


def _rounded(v: Any, digits: int) -> float | None:
    return None if v is None or pd.isna(v) else round(float(v), digits)


def run_phase9(ctx: Any, drafts: list[str] | None = None, num_draft_tokens: int = 3,
               concurrencies: list[int] | None = None, input_tokens: int = 0, output_tokens: int = 0,
               repeats: int = 1, synth_rates: list[float] | None = None, seed: int = 0, definition: str = "vllm",
               health_timeout_s: float = 300.0, answers: dict[str, str] | None = None) -> Phase9Result:
    """Speculation off, then each draft config, each served once; every concurrency measured on each."""
    from servelab.measure.abtest import ab_compare
    from servelab.measure.launch_variants import serving, with_launch
    from servelab.core.params import ParamError
    from servelab.core.run import read_manifest
    from servelab.measure.workload import engine_tokenizer, token_pool
    target = ctx.target
    scale = dict(SCALES[getattr(target, "scale", "local")])
    if getattr(target, "scale", "local") == "local":
        scale.update(MODEL_SCALES.get(str(target.model), {}))
    cs = [int(c) for c in (concurrencies or scale["concurrencies"])]
    if len(cs) < 2:
        ctx.notes.append("only one concurrency: the seeds ask for the net gain at several (never only C=1)")
    isl = int(input_tokens or scale["input_tokens"])
    osl = int(output_tokens or scale["output_tokens"])
    limit = max_request_tokens(target)
    if limit is not None and isl + osl > limit:
        raise ParamError(f"input {isl} + output {osl} tokens exceed the {limit} a request may hold on this target")
    configs = parse_configs(list(drafts or []), num_draft_tokens, synth_rates, str(target.model))
    from servelab.measure.launch_variants import log_reproduce
    log_reproduce(ctx, "phase9")
    log_dir = ctx.phase_dir / "server"
    parent = read_manifest(ctx.run_dir)
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    records: list[Path] = []
    for cfg in configs:
        try:
            t = with_launch(target, launch_changes(cfg, target), cfg.label)
        except ParamError as exc:
            errors[cfg.label] = str(exc)
            continue
        srv_ref = None
        cfg_rows: list[dict[str, Any]] = []
        try:
            with serving(t, log_dir, ctx.run_dir, ctx.phase, health_timeout_s) as srv:
                srv_ref = srv
                pool = token_pool(engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path),
                                  seed=seed)
                for c in cs:
                    for rep in range(max(1, int(repeats))):
                        p = run_spec_point(srv, ctx.run_dir, cfg, c, isl, osl, pool, seed, rep, definition,
                                           phase=getattr(ctx, "phase", "phase9"))
                        cfg_rows.append(p.row)
        except Exception as exc:  # a config that cannot serve is recorded; the others go on
            errors[cfg.label] = f"{type(exc).__name__}: {exc}"
        rows += cfg_rows
        # every point enters the A/B as S9_c<C> (the same case on every side), its repeats from its summaries
        cases = [(f"S9_c{r['concurrency']}", ctx.run_dir / "cases" / r["case_id"], "") for r in cfg_rows]
        rec = write_run_record(ctx.phase_dir / "ab" / _slug(cfg.label),
                               f"{parent.get('run_id', 'run')}-{_slug(cfg.label)}", t, srv_ref,
                               cases or [("S9", None, errors.get(cfg.label, "no point ran"))], parent)
        records.append(rec)
    points = pd.DataFrame(rows)
    if points.empty:
        points = pd.DataFrame(columns=["config", "speculative", "concurrency", "repeat", "validity", "per_position"])
    gain = net_gain(points)
    ab = None
    if len(records) >= 2:
        try:
            ab = ab_compare(records, "extra_args", answers=answers,
                            metrics={"output_tps": True, "p95_tpot_ms": False})
        except Exception as exc:
            ctx.notes.append(f"A/B over the configs failed: {exc}")
    res = Phase9Result(configs, points, gain, per_position_frame(points), ab, errors, [])
    write_phase9_tables(ctx.phase_dir, res)
    return res


def write_phase9_tables(phase_dir: Path, res: Phase9Result) -> None:
    """``points.csv`` (every config × concurrency × repeat), ``net_gain.csv``, ``per_position.csv``,
    ``phase9.json``."""
    phase_dir.mkdir(parents=True, exist_ok=True)
    res.points.to_csv(phase_dir / "points.csv", index=False)
    res.gain.to_csv(phase_dir / "net_gain.csv", index=False)
    res.per_position.to_csv(phase_dir / "per_position.csv", index=False)
    write_json_atomic(phase_dir / "phase9.json", {"headline": res.headline(), "errors": res.errors,
                                                  "configs": [asdict(c) for c in res.configs]})


def acceptance_view(res: Phase9Result) -> pd.DataFrame:
    """Per config and concurrency: the counter deltas, the derived acceptance, and the window checks."""
    cols = ["config", "concurrency", "repeat", "d_drafts", "d_draft_tokens", "d_accepted", "acceptance_rate",
            "mean_accept_length", "d_generated", "window_matches_requests", "log_requests", "log_accepted",
            "log_generated", "log_matches_counters", "validity", "reasons"]
    p = res.points[res.points["speculative"].astype(bool)] if not res.points.empty else res.points
    return p[[c for c in cols if c in p.columns]].reset_index(drop=True)


def performance_view(res: Phase9Result) -> pd.DataFrame:
    """Every point: throughput, TPOT, target forwards, CPU use."""
    cols = ["config", "concurrency", "repeat", "output_throughput", "p50_tpot_ms", "p95_tpot_ms", "p50_ttft_ms",
            "target_forwards", "target_forwards_per_s", "tokens_per_target_forward", "step_ms",
            "server_cpu_util_cores", "server_cpu_idle_pct", "validity", "reasons"]
    return res.points[[c for c in cols if c in res.points.columns]].reset_index(drop=True)


# ---------------------------------------------------------------- figures

def gain_figure(gain: pd.DataFrame):
    """Net output-TPS gain per concurrency for each config, acceptance written on the bars."""
    import plotly.graph_objects as go
    fig = go.Figure()
    if gain.empty:
        return fig.update_layout(title="no speculative config measured against the baseline")
    for config, g in gain.groupby("config", sort=False):
        fig.add_trace(go.Bar(x=[f"C={c}" for c in g["concurrency"]], y=g["net_gain_pct"], name=str(config),
                             text=[f"acc {a:.0%}, len {l:.2f}" if a is not None and not pd.isna(a) else "no drafts"
                                   for a, l in zip(g["acceptance_rate"], g["mean_accept_length"])],
                             textposition="outside"))
    fig.add_hline(y=0, line_color="#7f8c8d")
    fig.update_layout(barmode="group", title="Net output-throughput gain vs speculation off, per concurrency "
                      "(acceptance alone says nothing about it)", yaxis_title="Δ output TPS (%)",
                      template="plotly_white")
    return fig


def per_position_figure(per_pos: pd.DataFrame):
    """Acceptance per draft position (Δaccepted_pos / Δdrafts) per config and concurrency."""
    import plotly.graph_objects as go
    fig = go.Figure()
    if per_pos.empty:
        return fig.update_layout(title="per-position acceptance: not exposed or no drafts")
    m = per_pos.groupby(["config", "concurrency", "position"], sort=False)["acceptance"].mean().reset_index()
    for (config, c), g in m.groupby(["config", "concurrency"], sort=False):
        fig.add_trace(go.Scatter(x=g["position"], y=g["acceptance"], mode="lines+markers", name=f"{config} C={c}"))
    fig.update_layout(title="Per-position acceptance (counter deltas over the measurement window)",
                      xaxis_title="draft position", yaxis_title="accepted / verification steps",
                      yaxis_range=[0, 1.05], template="plotly_white")
    return fig
