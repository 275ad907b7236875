"""Phase 9 — speculative decoding: acceptance from counter deltas, draft overhead, net gain per concurrency.

``docs/method.md#speculative``: record accept rate, mean accept length, target forward TPS, draft/MTP overhead, CPU scheduling
bubbles and the net gain at several concurrencies — never only the accept length, never only C = 1.

**Acceptance** comes from the engine's counters over the exact measurement window (a ``/metrics`` snapshot
taken at idle right before the measured requests and one right after they all finished), as ``vllm bench
serve`` does it (``docs/metrics.md#acceptance``) — never from a running average such as SGLang's
``avg_spec_accept_length``. The configs are served and their points measured by
:mod:`servelab.measure.spec_points`; the formulas, the window checks, a point's row and case summary, the net gain
and the figures are in :mod:`servelab.analyse.speculative`; this module judges each measured point with them
(:func:`judge_spec_point`: row, case closed with its summary), writes the phase tables and holds the page's views.

**llama.cpp locally**: real draft-model speculative decoding, ``-md <draft.gguf> --spec-type draft-simple
--spec-draft-n-max N`` (the draft must share the target's vocabulary). With the model as its own draft
(``self``) greedy decoding accepts every draft token by construction — an upper bound that also pays a draft as
large as the target; with an independent random model of the same vocabulary (``random:<seed>``, tiny target
only) nearly nothing is accepted — the lower bound, pure overhead. ``--spec-synth-rates`` (llama.cpp's
benchmarking-only synthetic acceptance; the generated text is not valid) gives known per-position rates.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from servelab.analyse.speculative import net_gain, per_position_frame, spec_point_row, spec_point_summary
from servelab.measure import request_metrics as mx
from servelab.measure.case import max_request_tokens
from servelab.measure.launch_variants import log_reproduce
from servelab.measure.spec_points import PointShape, RawSpecPoint, SpecConfig, SpecPoint, measure_configs
from servelab.core.facts import make, plain
from servelab.core.run import write_json_atomic, PhaseUnsupported
from servelab.deploy.engines import engine_for
from servelab.core.params import param, ParamError, PhaseParams
from servelab.measure.abtest import ab_compare
from servelab.report.findings import ab_findings
from servelab.measure.abtest import answers_from_params, write_ab_tables
from servelab.report.answers import record_correctness
from servelab.measure.correctness import greedy_summary
from servelab.measure.correctness import prompts_view
from servelab.measure.correctness import verdict_sentences
from servelab.report import crosscheck
from servelab.phases.context import PhaseContext

SCALES: dict[str, dict[str, Any]] = {
    "cluster": {"input_tokens": 1024, "output_tokens": 1024, "concurrencies": [1, 16, 32]},
    # local: Phase 1's decode shape (64 → 64, scale "local" of measure.matrix.SCALES), so the baseline with speculation
    # off at C=4 answers the same question as D2_c4 and the run cross-checks the two (report.crosscheck)
    "local": {"input_tokens": 64, "output_tokens": 64, "concurrencies": [1, 4]},
}
MODEL_SCALES: dict[str, dict[str, Any]] = {"tiny": {"output_tokens": 256}}


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 9's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase9 --cell``); ``-p`` and ``params/phase9.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase9"
    drafts: list = param([],
        "draft models: self, random:SEED (tiny only) or a GGUF path; empty: self (tiny: self and random:1)")
    num_draft_tokens: int = param(3, "tokens drafted per step (llama.cpp --spec-draft-n-max) [min 1]")
    concurrencies: list = param([],
        "decode concurrencies; empty: the scale's (1 and 4 locally; 1, 16, 32 on a cluster) [items min 1]")
    input_tokens: int = param(0, "prompt length; 0: the scale's (32 locally)")
    output_tokens: int = param(0, "output length; 0: the scale's (32 locally, 256 for the tiny model)")
    repeats: int = param(1, "repeats per point (2 or more give a spread for the net gain) [min 1]")
    synth_rates: list = param([],
        "llama.cpp synthetic per-position acceptance for one extra config (benchmarking only) [items min 0] "
        "[items max 1]")
    definition: str = param(mx.VLLM_BENCH, "metric definition: vllm or sglang [one of vllm, sglang]")
    seed: int = param(0, "workload seed; the same prompts with speculation on and off")
    ab_why: str = param("", "A/B question 2: why should speculation touch the current bottleneck")
    ab_profile_change: str = param("", "A/B question 5: how did the profile evidence change")
    ab_risk: str = param("", "A/B question 6: accuracy, stability or memory risk")
    ab_keep: str = param("", "A/B question 7: keep it")


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


# ---------------------------------------------------------------- one point judged

def judge_spec_point(raw: RawSpecPoint) -> SpecPoint:
    """A measured point (:func:`servelab.measure.spec_points.measure_spec_point`) judged: its row, the case closed
    with its summary (``success``, or ``failed`` where the block recorded an error), the point."""
    row = spec_point_row(raw)
    status = "success" if not raw.error else "failed"
    raw.case.close(spec_point_summary(raw.config, row, raw.records, raw.run, status, raw.definition, raw.repeat,
                                      raw.repeat_of), status)
    return SpecPoint(raw.config, raw.concurrency, raw.repeat, raw.case.dir, row, raw.records, raw.before, raw.after)


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
    run_dir: Path | None = None      # the run whose Phase 1 baseline the findings cross-check

    def findings(self) -> list[str]:
        return findings(self, self.run_dir)

    def headline(self) -> dict[str, Any]:
        """Per speculative config and concurrency: acceptance (its sample, the draft tokens proposed over the VALID
        points), mean accept length, and the net gain (its sample, the fewer completed requests of the two sides) —
        each a fact with its points, below its sample rule marked indicative (``core.facts``)."""
        out: dict[str, Any] = {"configs": [c.label for c in self.configs], "errors": len(self.errors)}
        for _, r in self.gain.iterrows():
            key = f"{r['config']} C={r['concurrency']}"     # flat keys: one labelled number each on the page
            spec, off = self._valid(r["config"], r["concurrency"]), self._valid("off", r["concurrency"])
            src = ", ".join(spec.get("case_id", pd.Series(dtype=str)).astype(str))
            proposed = int(spec["d_draft_tokens"].sum()) if "d_draft_tokens" in spec.columns else None
            out[f"{key} acceptance_rate"] = make(f"phase9/{key} acceptance_rate", _rounded(r["acceptance_rate"], 3),
                                                 source=src, samples=proposed, kind="acceptance_rate")
            out[f"{key} mean_accept_length"] = _rounded(r["mean_accept_length"], 2)
            gain = _rounded(r["net_gain_pct"], 1)
            if gain is None:
                out[f"{key} net_gain_pct"] = None
                continue
            done = [int(x["completed"].sum()) for x in (spec, off) if "completed" in x.columns]
            out[f"{key} net_gain_pct"] = make(f"phase9/{key} net_gain_pct", gain, unit="%", kind="throughput",
                                              source=f"{src} vs speculation off",
                                              samples=min(done) if len(done) == 2 else None)
        return out

    def _valid(self, config: str, c: Any) -> pd.DataFrame:
        """The VALID points of ``config`` at concurrency ``c``."""
        p = self.points
        if p.empty or "validity" not in p.columns:
            return pd.DataFrame()
        return p[(p["validity"] == "VALID") & (p["config"] == config) & (p["concurrency"] == c)]


def _rounded(v: Any, digits: int) -> float | None:
    return None if v is None or pd.isna(v) else round(float(v), digits)


AS_SERVED_NOTE = ("attached target: the server is measured as served, one config — servelab restarts nothing "
                  "there, so there is no speculation-off baseline and no net gain; whether it speculates and its "
                  "acceptance come from its /metrics counters over each point's window")


def run(ctx: PhaseContext) -> Phase9Result:
    """Phase 9's entry (the phase contract), from the notebook's parameters (``ctx.params``): speculation off, then
    each draft config, each served once; every concurrency measured on each; the net gain per concurrency, the
    per-position acceptance and the A/B over the configs (the A/B answers from the parameters). A target whose
    engine cannot speculate raises :class:`PhaseUnsupported` with the reason, before anything starts. An attached
    target (a server servelab did not start) is measured as served: one config (``SpecConfig.AS_SERVED``), its
    acceptance from its counters, no baseline (``drafts`` and ``synth_rates`` are refused there before anything
    starts, ``deploy.attach.phase_refusal``)."""
    p = ctx.params
    shape = point_shape(ctx, p)
    if getattr(ctx.target, "attached", False):
        # a server servelab did not start: measured as served (no restart, so no off baseline and no drafts)
        configs = [SpecConfig(SpecConfig.AS_SERVED, as_served=True)]
        ctx.notes.append(AS_SERVED_NOTE)
    else:
        require_speculation(ctx)
        configs = parse_configs(list(p.drafts), p.num_draft_tokens, p.synth_rates, str(ctx.target.model))
    log_reproduce(ctx, "phase9")
    measured = measure_configs(ctx, configs, shape, judge_spec_point, seed=p.seed, definition=p.definition)
    points = _points_frame(measured.rows)
    ab = _ab_over_configs(ctx, measured.records, answers_from_params(p.as_dict()))
    res = Phase9Result(configs, points, net_gain(points), per_position_frame(points), ab, measured.errors, [],
                       run_dir=ctx.run_dir)
    write_phase9_tables(ctx.phase_dir, res)
    record_correctness(ctx.run_dir, ctx.phase)        # each config's greedy-output verdict, for M4 and the index
    return res


def require_speculation(ctx: PhaseContext) -> None:
    """Raise :class:`PhaseUnsupported` with the engine adapter's reason when the target cannot speculate."""
    why = engine_for(ctx.target.engine).speculation_unsupported(ctx.target)
    if why:
        raise PhaseUnsupported(why)


def point_shape(ctx: PhaseContext, p: Params) -> PointShape:
    """The points' shape from the parameters and the target's scale; a single concurrency is noted (the net gain
    must be measured at several), a request longer than the target may hold is refused."""
    target = ctx.target
    scale = dict(SCALES[getattr(target, "scale", "local")])
    if getattr(target, "scale", "local") == "local":
        scale.update(MODEL_SCALES.get(str(target.model), {}))
    cs = [int(c) for c in (p.concurrencies or scale["concurrencies"])]
    if len(cs) < 2:
        ctx.notes.append("only one concurrency: the net gain must be measured at several (never only C=1)")
    isl = int(p.input_tokens or scale["input_tokens"])
    osl = int(p.output_tokens or scale["output_tokens"])
    limit = max_request_tokens(target)
    if limit is not None and isl + osl > limit:
        raise ParamError(f"input {isl} + output {osl} tokens exceed the {limit} a request may hold on this target")
    return PointShape(cs, isl, osl, max(1, int(p.repeats)))


def _points_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Every point's row; the columns the views and the net gain read even when no point ran."""
    points = pd.DataFrame(rows)
    if points.empty:
        points = pd.DataFrame(columns=["config", "speculative", "concurrency", "repeat", "validity", "per_position"])
    return points


def _ab_over_configs(ctx: PhaseContext, records: list[Path], answers: dict[str, str]) -> Any:
    """The A/B over the configs' records (the launch's extra arguments the declared variable), None with fewer than
    two; a failure goes to the phase's notes."""
    if len(records) < 2:
        return None
    try:
        return ab_compare(records, "extra_args", answers=answers, metrics={"output_tps": True, "p95_tpot_ms": False})
    except Exception as exc:
        ctx.notes.append(f"A/B over the configs failed: {exc}")
        return None


def write_phase9_tables(phase_dir: Path, res: Phase9Result) -> None:
    """``points.csv`` (every config × concurrency × repeat), ``net_gain.csv``, ``per_position.csv``, the A/B's
    ``ab_*.csv`` (differences, comparison, the greedy outputs compared, the seven questions), ``phase9.json``."""
    phase_dir.mkdir(parents=True, exist_ok=True)
    res.points.to_csv(phase_dir / "points.csv", index=False)
    res.gain.to_csv(phase_dir / "net_gain.csv", index=False)
    res.per_position.to_csv(phase_dir / "per_position.csv", index=False)
    if res.ab is not None:
        write_ab_tables(res.ab, phase_dir)
    write_json_atomic(phase_dir / "phase9.json", {"headline": plain(res.headline()), "errors": res.errors,
                                                  "configs": [asdict(c) for c in res.configs]})


def acceptance_view(res: Phase9Result) -> pd.DataFrame:
    """Per config and concurrency: the counter deltas, the derived acceptance, and the window checks."""
    cols = ["config", "concurrency", "repeat", "d_drafts", "d_draft_tokens", "d_accepted", "acceptance_rate",
            "mean_accept_length", "d_generated", "window_matches_requests", "log_requests", "log_accepted",
            "log_generated", "log_matches_counters", "validity", "reasons"]
    p = res.points[res.points["speculative"].astype(bool)] if not res.points.empty else res.points
    return p[[c for c in cols if c in p.columns]].reset_index(drop=True)


def ab_correctness(res: Phase9Result) -> pd.DataFrame:
    """Per config against speculation off: the greedy outputs of the same fixed prompts compared token for token
    (speculative decoding that verifies greedily should leave them identical), the verdict with its counts."""
    if res.ab is None:
        return pd.DataFrame({"note": ["no A/B: fewer than two configs ran"]})
    return greedy_summary(res.ab.correctness)


def ab_correctness_prompts(res: Phase9Result) -> pd.DataFrame:
    """The same comparison prompt by prompt (every row in ``phase9/ab_correctness.csv``)."""
    return prompts_view(res.ab.correctness if res.ab is not None else None)


def performance_view(res: Phase9Result) -> pd.DataFrame:
    """Every point: throughput, TPOT, target forwards, CPU use."""
    cols = ["config", "concurrency", "repeat", "output_throughput", "p50_tpot_ms", "p95_tpot_ms", "p50_ttft_ms",
            "target_forwards", "target_forwards_per_s", "tokens_per_target_forward", "step_ms",
            "server_cpu_util_cores", "server_cpu_idle_pct", "validity", "reasons", "n_tpot", "max_tpot_ms", "n_ttft",
            "max_ttft_ms"]
    view = res.points[[c for c in cols if c in res.points.columns]].reset_index(drop=True)
    # each percentile with its count, or "max of N" where too few values hold it (points.csv keeps the numbers)
    return mx.labelled_percentiles(view).drop(columns=["max_tpot_ms", "max_ttft_ms"], errors="ignore")


def findings(res: Phase9Result, run_dir: Path | None = None) -> list[str]:
    """What Phase 9 found, in sentences for the page's findings box: acceptance per draft, the net gain against
    speculation off per concurrency and the best config — a verdict (pays / does not pay) only where the A/B has a
    noise band, else said as a measurement —, the A/B's verdict and whether it is valid, what did not run, and the
    cross-check of the baseline against Phase 1 (``report.crosscheck``)."""
    out = []
    g = res.gain
    as_served = [c for c in res.configs if c.as_served]
    if as_served:
        out += as_served_findings(res.points, g)
    elif g.empty or (g["verdict"] == "invalid").all():
        out.append("No speculative config has a VALID point next to a VALID speculation-off point: no net gain.")
    if not g.empty and not as_served:
        for config, rows in g.groupby("config", sort=False):
            acc = rows["acceptance_rate"].astype(float).dropna()
            ln = rows["mean_accept_length"].astype(float).dropna()
            head = (f"{config}: acceptance {100 * acc.mean():.1f} %, mean acceptance length {ln.mean():.2f}; "
                    if len(acc) and len(ln) else f"{config}: ")
            out.append(head + "net output-TPS gain against off "
                       + ", ".join(f"{r.net_gain_pct:+.1f} % at C={r.concurrency}" if not pd.isna(r.net_gain_pct)
                                   else f"none at C={r.concurrency} ({r.reasons or 'no VALID pair'})"
                                   for r in rows.itertuples()) + ".")
        best = g.dropna(subset=["net_gain_pct"])
        if not best.empty:
            b = best.loc[best["net_gain_pct"].astype(float).idxmax()]
            comp = res.ab.comparison if res.ab is not None else None
            tps = comp[comp["metric"] == "output_tps"] if comp is not None and not comp.empty else None
            noise = tps is not None and not tps.empty and not set(tps["verdict"]) <= {"no repeats", "no data",
                                                                                        "invalid"}
            what = (f"{b['config']} at C={b['concurrency']} ({b['net_gain_pct']:+.1f} % output TPS, "
                    f"{b['output_tps_off']:,.1f} → {b['output_tps_spec']:,.1f} tok/s)")
            if not noise:
                # one repeat per side: the A/B below has no noise band, so no gain or loss is a verdict yet
                out.append(("Measured, not yet a verdict: the best config is " + what if b["net_gain_pct"] > 0 else
                            "Measured, not yet a verdict: every config had less output TPS than off (best "
                            + what + ")")
                           + " — one repeat per side, so the noise is unknown; run with repeats ≥ 2 to decide.")
            elif b["net_gain_pct"] > 0:
                out.append(f"The best config is {what}; the A/B below says whether that is outside the noise.")
            elif set(tps["verdict"]) <= {"worse"}:
                out.append(f"Speculation does not pay here: every config loses output TPS against off beyond the "
                           f"noise (best {what}).")
            else:
                out.append(f"No config gains output TPS against off (best {what}); the A/B below says which losses "
                           "are outside the noise.")
    if res.ab is not None:
        out += ab_findings(res.ab, {"output_tps": "output TPS", "p95_tpot_ms": "P95 TPOT"})
        out += verdict_sentences(res.ab.correctness, res.ab.runs[0].label)
    elif not as_served:
        out.append("No A/B: fewer than two configs ran.")
    if res.errors:
        out.append("Not executed: " + "; ".join(f"{k} ({v})" for k, v in res.errors.items()) + ".")
    if run_dir is not None and Path(run_dir, "cases").is_dir():
        out += crosscheck.findings(run_dir, phases=("phase9",))
    return out


def as_served_findings(points: pd.DataFrame, gain: pd.DataFrame) -> list[str]:
    """An attached server measured as served: whether it speculates (its draft counters moved, did not move, or
    do not exist), its acceptance and output TPS per concurrency from the VALID points, and how to get the net
    gain (a second server with speculation off, the two runs compared with ``abtest.ab_compare``)."""
    out = []
    valid = points[points["validity"] == "VALID"] if not points.empty else points
    if valid.empty:
        return ["The attached server as served has no VALID point: " + "; ".join(
            sorted({str(r) for r in points.get("reasons", pd.Series(dtype=str)).dropna() if str(r)})) + "."]
    tps = ", ".join(f"{r.output_throughput:,.1f} tok/s at C={r.concurrency}"
                    for r in valid.groupby("concurrency", as_index=False)["output_throughput"].mean().itertuples())
    drafts = valid["d_drafts"] if "d_drafts" in valid.columns else pd.Series(dtype=float)
    if drafts.isna().all():
        out.append(f"As served, output {tps}. Whether the server speculates cannot be read from outside: it exposes "
                   "no draft counter at its metrics endpoint, so no acceptance is measured.")
    elif not (drafts.fillna(0) > 0).any():
        out.append(f"As served, output {tps}. The server does not speculate: its draft counters did not move over "
                   f"{int(valid['completed'].sum())} measured requests.")
    else:
        g = gain[gain["verdict"] == "no baseline"] if not gain.empty else gain
        acc = ", ".join(f"{100 * r.acceptance_rate:.1f} % (mean acceptance length {r.mean_accept_length:.2f}) at "
                        f"C={r.concurrency}" for r in g.itertuples()
                        if not pd.isna(r.acceptance_rate) and not pd.isna(r.mean_accept_length))
        out.append(f"As served, the server speculates: acceptance {acc or 'not computed'} from its counters over "
                   f"each point's window; output {tps}.")
    out.append("No net gain: a server servelab did not start is not restarted with speculation off. To measure "
               "it, serve the same model with speculation off as a second attached target, run Phase 9 on each "
               "and compare the two runs (servelab.measure.abtest.ab_compare([off_run, spec_run])).")
    return out
