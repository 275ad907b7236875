"""Phase 4 — parallel topology: the memory and communication model of every layout, feasibility before any
launch, the planned launch commands, and the measured comparison of runs.

The model and its figures live in :mod:`servelab.analyse.topology` (model, layout, memory, comm, measured,
figures); this module reads the targets, records the planned commands, writes the phase tables and holds the
page's views.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import pandas as pd

from servelab.analyse.topology import (Cluster, CommInputs, MemoryInputs, ModelConfig, cluster_from_target, comm_summary,
                                       comm_table, feasibility, launch_commands, layout_problems, load_model_config,
                                       measured_comparison, memory_table, param_summary, parse_layout, reference_layouts)
from servelab.core.params import param, ParamError, PhaseParams
from servelab.core.paths import path_slug
from servelab.core.run import read_manifest
from servelab.deploy.engines import engine_for
from servelab.deploy.targets import load_target
from servelab.measure.case import make_env, run_case
from servelab.measure.matrix import quick_matrix
from servelab.measure.launch_variants import serving, with_launch, write_run_record
from servelab.phases.context import PhaseContext
from servelab.report.banner import banner
from servelab.report.ledger import evidence_frame, record_evidence
from servelab.measure.matrix import SCALES


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 4's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase4 --cell``); ``-p`` and ``params/phase4.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase4"
    target: str = param("local", "params/targets/<name>.yaml where this notebook runs (nothing is launched)")
    model_config: str = param("deepseek-v3", "params/models/<name>.yaml or a path to an HF config.json")
    cluster_target: str = param("example-2node", "the cluster whose layouts are modelled (its YAML is only read)")
    layouts: list = param([], "e.g. TP16, TP8+PP2, TP16+DP2+EP16; empty: the three reference layouts for the cluster")
    gpu_memory_gib: float = param(95.6, "memory per GPU in GiB (RTX PRO 6000 Blackwell Server 96 GB; H200 141 GB) [above 0]")
    mem_fraction: float = param(0.0, "share of GPU memory for weights and KV; 0: the cluster target's mem_fraction [max 1]")
    context_length: int = param(0, "context per request for the KV demand; 0: the cluster target's context_length")
    concurrency: int = param(16, "requests at full context (KV demand) and tokens per decode step (communication) [min 1]")
    internode_gbps: float = param(800.0, "rail bandwidth per node in Gbit/s (reference cluster: 2 x 400G RoCE) [above 0]")
    runs: list = param([], "run ids or folders measured with each layout, the TP16 baseline first")
    measure_layouts: list = param([],
        "measure these layouts live on `target` (e.g. TP1, TP2, PP2 on local-sglang), the first is the "
        "baseline; empty: runs or the model only")
    measure_cases: list = param([],
        "quick-matrix cases measured per layout; empty: D1, then D2 at the scale's concurrencies (16, 32, 64 "
        "on a cluster; 4, 8, 16 locally), the method's test order")
    measure_repeats: int = param(3, "repeats of each measured case per layout (the noise band needs at least 2) [min 2]")


@dataclass
class Phase4Result:
    model: ModelConfig
    cluster: Cluster
    params: pd.DataFrame
    memory: pd.DataFrame
    feasibility: pd.DataFrame
    comm: list[pd.DataFrame]
    comm_summary: pd.DataFrame
    launch: pd.DataFrame
    measured: pd.DataFrame = field(default_factory=pd.DataFrame)
    verdicts: pd.DataFrame = field(default_factory=pd.DataFrame)
    model_note: str = ""                 # what the model stands for, against what the target serves
    runs: list[str] = field(default_factory=list)     # the measured runs compared (ids or folders)

    def headline(self) -> dict[str, Any]:
        return headline(self)

    def findings(self) -> list[str]:
        return findings(self)

    @property
    def comm_all(self) -> pd.DataFrame:
        return pd.concat(self.comm, ignore_index=True) if self.comm else pd.DataFrame()


def run(ctx: PhaseContext) -> Phase4Result:
    """Phase 4's entry (the phase contract), from the notebook's parameters (``ctx.params``): the layouts measured
    live first when ``measure_layouts`` names some (else the given ``runs``); the model and the cluster's target
    YAML read (never connected to); every layout's memory per GPU and feasibility, and its communication per decode
    step; each valid layout's launch commands recorded as ``planned`` (never executed here); the measured runs
    compared when there are some; the phase tables written.

    ``mem_fraction`` and ``context_length`` left at 0 take the cluster target's launch settings; the tokens per
    decode step are ``concurrency``. Writes ``feasibility.csv``, ``memory.csv``, ``comm.csv``,
    ``comm_summary.csv`` and ``launch_commands.csv`` (and ``measured.csv``, ``verdicts.csv``) in the phase folder.
    """
    p = ctx.params
    runs = p.runs or (measure_layouts(ctx, p.measure_layouts, p.measure_cases, repeats=p.measure_repeats)
                      if p.measure_layouts else [])
    cfg = load_model_config(p.model_config)
    base = load_target(p.cluster_target)
    cluster = cluster_from_target(base)
    lays = [parse_layout(x) for x in p.layouts] if p.layouts else reference_layouts(cluster)
    memory = memory_table(cfg, lays, cluster, _memory_inputs(p, base))
    feas = feasibility(memory)
    comm_in = CommInputs(tokens=p.concurrency, internode_gbps_per_node=p.internode_gbps)     # one decode step
    comms = [comm_table(cfg, lay, cluster, comm_in) for lay in lays]
    summary = comm_summary(comms, comm_in)
    launch = _plan_launches(ctx, base, [lay for lay in lays if not layout_problems(cfg, lay, cluster)])
    res = Phase4Result(cfg, cluster, param_summary(cfg), memory, feas, comms, summary, launch)
    res.model_note = model_label(cfg, base, ctx.target)
    res.runs = [str(r) for r in runs]
    _record_sources(ctx, res.model_note, runs)
    if runs:
        _compare(ctx, res, runs)
    _write_tables(ctx, res)
    return res


def _memory_inputs(p: Params, base: Any) -> MemoryInputs:
    """The memory model's inputs: the parameters, ``mem_fraction`` and ``context_length`` left at 0 taking the
    cluster target's launch settings (``base``)."""
    return MemoryInputs(gpu_memory_gib=p.gpu_memory_gib,
                        mem_fraction=p.mem_fraction or float(base.launch.get("mem_fraction", 0.88)),
                        context_tokens=p.context_length or int(base.launch.get("context_length", 32768)),
                        concurrency=p.concurrency, kv_cache_dtype=str(base.launch.get("kv_cache_dtype", "auto")))


def _plan_launches(ctx: PhaseContext, base: Any, layouts: list[Any]) -> pd.DataFrame:
    """The launch commands of each valid layout on the cluster target, recorded as ``planned`` (never executed)."""
    launch = launch_commands(base, layouts)
    for _, r in launch.iterrows():
        ctx.log_command("planned", r["argv"], title=f"launch {r['layout']} on {r['node']}", host=r["node"],
                    env=r["env"], note="Phase 4 layout candidate; not executed by this notebook")
    return launch


def _record_sources(ctx: PhaseContext, model_note: str, runs: Sequence[str]) -> None:
    """Where the page's numbers come from: the model, and the measured runs when given."""
    ctx.add_source("model", model_note)
    if runs:
        ctx.add_source("live", "the measured runs " + ", ".join(map(str, runs)))


def _compare(ctx: PhaseContext, res: Phase4Result, runs: Sequence[str]) -> None:
    """The measured comparison of ``runs`` against the model (``measured.csv``) and the verdicts (``verdicts.csv``)."""
    res.measured, res.verdicts = measured_comparison(runs, res.feasibility, res.comm_summary)
    res.measured.to_csv(ctx.phase_dir / "measured.csv", index=False)
    res.verdicts.to_csv(ctx.phase_dir / "verdicts.csv", index=False)


def _write_tables(ctx: PhaseContext, res: Phase4Result) -> None:
    """``feasibility.csv``, ``memory.csv``, ``comm.csv``, ``comm_summary.csv`` and ``launch_commands.csv``."""
    res.feasibility.to_csv(ctx.phase_dir / "feasibility.csv", index=False)
    res.memory.to_csv(ctx.phase_dir / "memory.csv", index=False)
    res.comm_all.to_csv(ctx.phase_dir / "comm.csv", index=False)
    res.comm_summary.to_csv(ctx.phase_dir / "comm_summary.csv", index=False)
    res.launch.drop(columns=["argv", "env"]).to_csv(ctx.phase_dir / "launch_commands.csv", index=False)


def model_label(cfg: ModelConfig, target: Any, run_target: Any = None) -> str:
    """Which model the arithmetic is about, against what the cluster target would serve (the same, or a stand-in
    said so) — and, where the run's own target is another, the model that one really serves: a plan for a cluster
    never claims the run's target is that cluster."""
    served = str(getattr(target, "model", "") or "")
    text = f"memory / communication model of {cfg.name} (config: {getattr(cfg, 'source', '') or 'given'}) on " \
           f"{target.name}"
    if served and cfg.name.lower().replace("-", "") not in served.lower().replace("-", ""):
        text += (f"; {target.name} would serve {Path(served).name}, so {cfg.name} stands in for it (same family "
                 f"assumed) and the planned commands launch {Path(served).name}")
    if run_target is not None and getattr(run_target, "name", None) != target.name:
        model = Path(str(getattr(run_target, "model", "") or "its model")).name
        text += (f"; this run's target {run_target.name} serves {model} ({run_target.engine}) — {target.name} is "
                 "planned here, not measured")
    return text


def measure_cases(target: Any) -> tuple[str, ...]:
    """The cases each layout is measured with live by default — the method's test order for a layout after its
    smoke test: C=1 decode latency (D1), then throughput at the scale's decode concurrencies (D2 at C=16/32/64 on
    the cluster, 4/8/16 locally)."""
    cs = SCALES.get(getattr(target, "scale", "cluster"), SCALES["cluster"])["D2_c"]
    return ("D1", *(f"D2_c{c}" for c in cs))


def measure_layouts(ctx: PhaseContext, layouts: Sequence[str], cases: Sequence[str] = (), repeats: int = 3,
                    health_timeout_s: float = 900.0) -> list[str]:
    """Measure each layout live on the phase's own target (``ctx.target``, e.g. ``local-sglang``): the target with the
    layout's launch settings (the engine adapter's notation) and nothing else changed, served once, the ``cases``
    of the quick matrix measured ``repeats`` times (``cases/<layout>-<case>/``), then stopped; each layout becomes a
    run-like record (``phase4/layouts/<layout>/``) that the measured comparison reads as a run — the first layout is
    the baseline, and only the layout keys may differ between records (the one-variable rule). ``cases`` empty:
    :func:`measure_cases`. Returns the record folders, in the order given."""
    target = ctx.target
    eng = engine_for(target.engine)
    lays = [parse_layout(x) for x in layouts]
    if len({lay.label for lay in lays}) != len(lays):
        raise ParamError(f"measure_layouts names a layout twice: {list(layouts)}")
    specs = quick_matrix(target, list(cases or measure_cases(target)))
    parent = read_manifest(ctx.run_dir)
    records: list[str] = []
    for lay in lays:
        t = with_launch(target, eng.layout_launch_settings(lay), lay.label)
        tag = path_slug(lay.label)
        done: list[tuple[str, Any, str]] = []
        with serving(t, ctx.phase_dir / "server" / tag, ctx.run_dir, ctx.phase, health_timeout_s) as srv:
            env = make_env(srv, ctx.run_dir, repeats=repeats, phase=ctx.phase, progress=False)
            for spec in specs:
                own = type(spec)(**{**spec.__dict__, "case_id": f"{tag}-{spec.case_id}", "notes": list(spec.notes)})
                res = run_case(env, own)
                done.append((spec.case_id, res.case_dir, ""))
            rec = write_run_record(ctx.phase_dir / "layouts" / tag, f"{ctx.run_id}-{tag}", t, srv, done, parent,
                                   extra={"layout": lay.label})
        records.append(str(rec))
    return records


def launch_table(res: Phase4Result) -> pd.DataFrame:
    """The planned launch commands per layout and node (recorded as ``planned``; never executed here)."""
    return res.launch[["layout", "node", "command"]].assign(label="planned (not executed)")


def measured_view(res: Phase4Result):
    """The measured comparison table, or a banner saying that no measurement exists yet."""
    if res.measured.empty:
        return banner("No measured run was given (parameter runs), so this page holds the model only: no layout is "
                      "recommended or rejected on evidence yet. Launch each feasible layout with the planned commands "
                      "above, run Phase 1 on it, and pass the run ids here (the TP16 baseline first).", "warning",
                      "No measurement exists yet")
    return res.measured


def verdicts_view(res: Phase4Result):
    """Recommended / not recommended per layout with the evidence, or the banner when nothing was measured."""
    return res.verdicts if not res.verdicts.empty else measured_view(res)


def headline(res: Phase4Result) -> dict[str, Any]:
    """The key numbers the manifest and the run index keep: the model, the cluster, the layouts that fit, each
    layout's cross-node traffic per decode step, and how many measured runs were compared."""
    fits = res.feasibility[res.feasibility["verdict"] == "fits"]["layout"].tolist()
    return {"model": res.model.name, "cluster": f"{res.cluster.nodes} x {res.cluster.gpus_per_node} GPUs",
            "layouts that fit": ", ".join(fits) or "none",
            **{f"{r.layout} cross-node per step_mib": round(r.cross_node_mib_per_step, 2)
               for r in res.comm_summary.itertuples()},
            "measured runs": len(res.runs)}


def findings(res: Phase4Result) -> list[str]:
    """What Phase 4 found, in sentences for the page's findings box: which layouts fit (memory per GPU against
    the budget), the cross-node traffic per decode step of each, and what the measured runs say (or that none
    exists yet)."""
    f = res.feasibility
    out = []
    if not f.empty:
        budget = float(f["budget_gib"].iloc[0])
        out.append(f"Model only, nothing measured here: {res.model_note or res.model.name}; "
                   f"{res.cluster.nodes} × {res.cluster.gpus_per_node} GPUs, memory budget {budget:.1f} GiB per GPU."
                   if res.verdicts.empty else
                   f"Model {res.model.name} on {res.cluster.nodes} × {res.cluster.gpus_per_node} GPUs "
                   f"({res.cluster.name}), memory budget {budget:.1f} GiB per GPU; {res.model_note}.")
        fits = f[f["verdict"] == "fits"]
        rest = f[f["verdict"] != "fits"]
        out.append("Layouts that fit: " + ("; ".join(
            f"{r.layout} ({r.need_gib:.1f} GiB per GPU, {int(r.max_concurrency_at_context)} requests at full context)"
            for r in fits.itertuples()) or "none") + ".")
        if not rest.empty:
            out.append("Do not fit or invalid: " + "; ".join(f"{r.layout} ({r.verdict})" for r in rest.itertuples())
                       + ".")
    c = res.comm_summary
    if not c.empty:
        tokens = int(c["tokens_per_step"].iloc[0])
        out.append(f"Cross-node traffic per decode step ({tokens} tokens): " + "; ".join(
            f"{r.layout} {r.cross_node_mib_per_step:,.2f} MiB in {int(r.cross_node_collectives_per_step)} "
            f"collective(s), ≥ {r.cross_node_ms_lower_bound:.3f} ms" for r in c.itertuples()) + ".")
    if res.verdicts.empty:
        out.append("No measured run was given: this is the model only, no layout is recommended on evidence yet; "
                   "the launch commands are planned, not executed.")
    else:
        out.append("Measured: " + "; ".join(f"{r.layout} {r.verdict} ({r.evidence})"
                                            for r in res.verdicts.itertuples()) + ".")
    return out


# ---------------------------------------------------------------- evidence for the ledger (H7)

def h7_evidence(res: Phase4Result) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H7 (the current layout is not the best) from the measured verdicts:
    another layout *recommended* over the baseline → *supported*; every other layout measured and *not
    recommended* → *refuted*; no measurement, or only "no evidence" / confounded comparisons → *inconclusive*
    (the memory model alone says which layouts fit, not which is faster)."""
    feas = res.feasibility
    fits = feas[feas["verdict"] == "fits"]["layout"].tolist() if not feas.empty else []
    nums: dict[str, Any] = {"layouts_that_fit": ", ".join(fits) or "none", "measured_runs": int(len(res.verdicts))}
    v = res.verdicts
    others = v[v["verdict"] != "baseline"] if not v.empty else v
    if others.empty:
        base = feas.iloc[0] if not feas.empty else None
        note = f"; the model says {base['layout']} {base['verdict']}" if base is not None else ""
        return "inconclusive", (f"model only, nothing measured: layouts that fit {nums['layouts_that_fit']}{note} — "
                                "run Phase 1 on each feasible layout and pass the runs"), nums
    baseline = v[v["verdict"] == "baseline"]["layout"].tolist()
    nums["baseline"] = baseline[0] if baseline else "-"
    rec = others[others["verdict"] == "recommended"]
    if not rec.empty:
        r = rec.iloc[0]
        return "supported", f"{r['layout']} is recommended over the baseline {nums['baseline']}: {r['evidence']}", nums
    if (others["verdict"] == "not recommended").all():
        return "refuted", (f"every measured alternative is not recommended against {nums['baseline']}: "
                           + "; ".join(f"{r.layout}: {r.evidence}" for r in others.itertuples())), nums
    return "inconclusive", "; ".join(f"{r.layout}: {r.verdict} ({r.evidence})" for r in others.itertuples()), nums


def record_h7(ctx: PhaseContext, res: Phase4Result) -> pd.DataFrame:
    """Record this phase's evidence about H7 (see :func:`h7_evidence`), linking the verdicts or the feasibility."""
    verdict, summary, nums = h7_evidence(res)
    measured = not res.verdicts.empty
    tables = ["verdicts.csv", "measured.csv", "feasibility.csv"] if measured else ["feasibility.csv", "comm_summary.csv"]
    return evidence_frame([record_evidence(ctx, "H7", verdict, summary,
                                           anchor="Recommended-/-not-recommended,-with-evidence" if measured
                                           else "Feasibility-before-launch", table=tables, numbers=nums)])
