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

The case and the sweep are measured in :mod:`servelab.measure.interference_case` (the wave, the raw files, each
value's engine and run-like record); the windows around each injection, the damage, the case summary, the ranking of
a sweep and the figures are computed in :mod:`servelab.analyse.interference` from those raw records. This module
composes them (:func:`finish_case`: analyse a raw case, then close it with its summary), runs the A/B, writes the
phase tables and holds the page's views and the H4 ledger entry.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import plotly.graph_objects as go

from servelab.analyse.interference import (InterferenceResult, analyse_case, h4_evidence, interference_summary,
                                           sweep_table, sweep_verdict)
from servelab.analyse.interference_figures import timeline_figure
from servelab.measure import request_metrics as mx
from servelab.measure.case import max_request_tokens
from servelab.measure.interference_case import InterferenceSpec, RawInterference, SweepPoint, knob_sweep, run_variant
from servelab.measure.records import read_records
from servelab.measure.launch_variants import log_reproduce
from servelab.core.run import read_manifest, write_json_atomic as wj
from servelab.deploy.engines import engine_for
from servelab.analyse.serverside import case_serverside
from servelab.core.facts import plain
from servelab.core.params import did_you_mean, param, ParamError, PhaseParams
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


# ---------------------------------------------------------------- one case: measured, analysed, closed

def finish_case(raw: RawInterference) -> InterferenceResult:
    """Analyse a raw case (its tables after its raw data) and close it with its summary (last): what the sweep
    makes of each value's case (:func:`servelab.measure.interference_case.knob_sweep`)."""
    res = analyse_case(raw)
    raw.close(interference_summary(res, raw.status, raw.definition, raw.records, raw.repeat_of))
    return res


# ---------------------------------------------------------------- Phase 7 end to end

@dataclass
class Phase7Result:
    knob: str
    values: list[Any]
    sweep: list[SweepPoint[InterferenceResult]]
    table: pd.DataFrame
    ab: Any                                  # abtest.ABResult over the sweep records (or None)
    confound: SweepPoint[InterferenceResult] | None
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
                       finish_case, phase=ctx.phase, seed=p.seed, definition=p.definition, parent_manifest=plan.parent)
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
                                plan.log_dir, finish_case, phase=ctx.phase, seed=p.seed, definition=p.definition,
                                parent_manifest=plan.parent)
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
    wj(phase_dir / "phase7.json", {"headline": plain(res.headline()), "notes": res.notes})


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
