"""Phase 6 — kernel deep-dive: rank the kernels of a Phase 3 capture, plan ``ncu`` on a small reproduction of the
top ones (recorded as planned, never run here), import ``ncu`` CSVs and place the kernels on the roofline.

The compute and the figures live in :mod:`servelab.analyse.kernels` (ranking, ncu_command, ncu_csv, roofline,
figures); this module picks the sources (or the shipped samples), records the planned commands, writes the phase
tables and holds the page's views.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import pandas as pd

from servelab.core.params import PhaseParams, param
from servelab.analyse.kernels import (KernelTableError, default_repro_argv, derived_metrics, load_kernel_table,
                                      peaks_table, planned_ncu_commands, rank_kernels, read_ncu_csv, roofline,
                                      stall_reasons, top_kernels)
from servelab.core.paths import samples_root
from servelab.phases.context import PhaseContext
from servelab.report.banner import banner, sample_banner
from servelab.report.ledger import evidence_frame, record_evidence, target_has_gpu
from servelab.core.paths import project_root
from servelab.core.run import read_manifest


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 6's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase6 --cell``); ``-p`` and ``params/phase6.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase6"
    target: str = param("local", "params/targets/<name>.yaml: the engine whose one-batch benchmark ncu wraps")
    kernel_source: str = param("", "Phase 3 kernel table (.csv or .parquet) or a Kineto trace; empty: the shipped H200 trace")
    ncu_csv: list = param([], "ncu --csv outputs to import; empty: the shipped H200 captures in data/samples/ncu")
    top_n: int = param(3, "kernels per window to deep-dive (the method: 1 to 3) [min 1]")
    repro: list = param([], "argv of the small reproduction ncu wraps; empty: the engine's one-batch benchmark")
    launch_skip: int = param(20, "matching launches skipped before profiling (warm-up, graph capture)")
    launch_count: int = param(3, "matching launches profiled per kernel [min 1]")
    gpu: str = param("H200", "roofline ceilings (spec sheet and measured here)")


@dataclass
class Phase6Result:
    """What the Phase 6 notebook shows."""
    source: str                       # where the kernel table came from
    ranked: pd.DataFrame
    top: pd.DataFrame
    commands: pd.DataFrame
    ncu_files: list[str] = field(default_factory=list)
    ncu_metrics: pd.DataFrame = field(default_factory=pd.DataFrame)
    derived: pd.DataFrame = field(default_factory=pd.DataFrame)
    stalls: pd.DataFrame = field(default_factory=pd.DataFrame)
    rules: pd.DataFrame = field(default_factory=pd.DataFrame)
    roof: pd.DataFrame = field(default_factory=pd.DataFrame)
    peaks: pd.DataFrame = field(default_factory=pd.DataFrame)
    gpu: str = "H200"                 # the roofline ceilings' GPU
    from_samples: bool = False        # kernels or counters from the shipped samples
    run_dir: Path | None = None       # the run whose Phase 3 capture the findings compare with

    def headline(self) -> dict[str, Any]:
        return headline(self)

    def findings(self) -> list[str]:
        return findings(self, self.from_samples, self.run_dir)


# the shipped real captures (2 × H200, 2026-11-29) Phase 6 falls back to
SAMPLE_TRACES = ("h200x2-pp2/traces/20261129215256-TP-0-PP-0.trace.json.gz",)
SAMPLE_NCU = ("ncu/h200_toy_layer_raw.csv", "ncu/ncu_raw.csv")


def run(ctx: PhaseContext) -> Phase6Result:
    """Phase 6's entry (the phase contract), from the notebook's parameters (``ctx.params``): the kernel table
    (:func:`_kernel_source`) ranked and its top ``top_n`` per window picked; ``ncu`` on a small reproduction of each
    planned (:func:`_plan_ncu`, recorded as ``planned``); the ``ncu`` CSVs (:func:`_ncu_files`) imported and placed on
    the roofline (:func:`_import_ncu`); the phase tables written.

    ``kernel_source``: a Phase 3 table or trace; empty = the shipped sample (``data/samples/``), and the
    phase is marked ``from_samples``. ``ncu_csv``: ``ncu --csv`` outputs to import; empty = the shipped
    ``data/samples/ncu/*.csv`` when present (also ``from_samples``).
    """
    p = ctx.params
    source = _kernel_source(ctx, p.kernel_source)
    table = load_kernel_table(source)
    ranked = rank_kernels(table)
    top = top_kernels(table, n=p.top_n)
    if set(top["window"]) - {"unannotated"}:     # step windows exist: kernels outside them are not the target
        top = top[top["window"] != "unannotated"].reset_index(drop=True)
    cmds = _plan_ncu(ctx, p, top)
    files = _ncu_files(ctx, p.ncu_csv)
    res = Phase6Result(source=source, ranked=ranked, top=top, commands=cmds, ncu_files=files, peaks=peaks_table(p.gpu),
                       gpu=p.gpu, run_dir=ctx.run_dir)
    _import_ncu(ctx, res)
    _record_sources(ctx, res)
    ranked.to_csv(ctx.phase_dir / "kernels_ranked.csv", index=False)
    top.to_csv(ctx.phase_dir / "top_kernels.csv", index=False)
    res.from_samples = ctx.from_samples
    return res


def _kernel_source(ctx: PhaseContext, kernel_source: str) -> str:
    """``kernel_source`` when given, else the first shipped sample trace (``ctx.from_samples`` set)."""
    if kernel_source:
        return str(kernel_source)
    cands = [samples_root() / p for p in SAMPLE_TRACES if (samples_root() / p).is_file()]
    if not cands:
        raise KernelTableError(f"no kernel_source given and none of the sample traces {SAMPLE_TRACES} exists "
                               f"under {samples_root()}")
    ctx.from_samples = True
    return str(cands[0])


def _plan_ncu(ctx: PhaseContext, p: Params, top: pd.DataFrame) -> pd.DataFrame:
    """``ncu`` on the reproduction (``repro``) for each top kernel, recorded as ``planned`` (never run here)."""
    # kernels recorded elsewhere (the samples) ran on another engine and GPU: their filters never wrap this target's
    # engine — the reproduction is a fill-in value (core.run.FILL_IN) unless the user gives one (repro)
    app = list(p.repro) or (["REPRO_COMMAND"] if ctx.from_samples else default_repro_argv(ctx.target))
    cmds = planned_ncu_commands(top, app, launch_skip=p.launch_skip, launch_count=p.launch_count,
                                export_dir=str(ctx.phase_dir / "ncu"))
    for _, c in cmds.iterrows():
        ctx.log_command("planned", c["argv"], title=f"ncu {c['window']} #{c['rank']} {c['function']}",
                    note="small reproduction under Nsight Compute; not executed by servelab")
    return cmds


def _ncu_files(ctx: PhaseContext, ncu_csv: Sequence[str]) -> list[str]:
    """The ``ncu`` CSVs given, else the shipped ones that exist (``ctx.from_samples`` set when there are some)."""
    files = [str(f) for f in ncu_csv]
    if not files:
        files = [str(samples_root() / p) for p in SAMPLE_NCU if (samples_root() / p).is_file()]
        if files:
            ctx.from_samples = True
    return files


def _import_ncu(ctx: PhaseContext, res: Phase6Result) -> None:
    """Every ``ncu`` CSV of ``res`` read: metrics, derived metrics, stall reasons, rules and the roofline on
    ``res.gpu``'s ceilings (``ncu_metrics.csv``, ``ncu_derived.csv``, ``roofline.csv``)."""
    reports = [read_ncu_csv(f) for f in res.ncu_files]
    if not reports:
        return
    res.ncu_metrics = pd.concat([r.metrics.assign(file=Path(r.path).name) for r in reports], ignore_index=True)
    res.derived = pd.concat([derived_metrics(r).assign(file=Path(r.path).name) for r in reports], ignore_index=True)
    res.stalls = pd.concat([stall_reasons(r).assign(file=Path(r.path).name) for r in reports], ignore_index=True)
    rules = [r.rules.assign(file=Path(r.path).name) for r in reports if not r.rules.empty]
    res.rules = pd.concat(rules, ignore_index=True) if rules else pd.DataFrame()
    res.roof = roofline(res.derived, gpu=res.gpu)
    res.roof.insert(0, "file", res.derived["file"].to_numpy())
    res.ncu_metrics.to_csv(ctx.phase_dir / "ncu_metrics.csv", index=False)
    res.derived.to_csv(ctx.phase_dir / "ncu_derived.csv", index=False)
    res.roof.to_csv(ctx.phase_dir / "roofline.csv", index=False)


def _record_sources(ctx: PhaseContext, res: Phase6Result) -> None:
    """Where the page's kernels and counters come from: the shipped samples, or the given source."""
    if ctx.from_samples:
        ctx.add_source("samples", f"kernels of {Path(res.source).name} and ncu CSVs "
                       f"({', '.join(Path(f).name for f in res.ncu_files) or 'none'}): 2 × H200 random-weight toy "
                       "models (data/samples/h200x2-pp2, data/samples/ncu), not this run's engine")
    else:
        ctx.add_source("live", f"kernels of {res.source}")


def derived_view(derived: pd.DataFrame) -> pd.DataFrame:
    """The derived kernel table as a reader wants it: one row per kernel launch, rounded, units in the headers."""
    if derived.empty:
        return derived
    cols = {"function": "kernel", "duration_ns": "duration_us", "sm_throughput_pct": "SM %", "tensor_pipe_pct": "tensor pipe %",
            "dram_throughput_pct": "DRAM %", "l2_hit_rate_pct": "L2 hit %", "achieved_occupancy_pct": "achieved occ. %",
            "theoretical_occupancy_pct": "theoretical occ. %", "registers_per_thread": "regs/thread",
            "shared_mem_bytes": "smem/block (B)", "block_threads": "block", "grid_blocks": "grid", "top_stalls": "top stalls"}
    df = derived[[c for c in ("file", "id", *cols) if c in derived.columns]].rename(columns=cols).copy()
    df["kernel"] = df["kernel"].map(lambda k: k if len(k) <= 48 else k[:47] + "…")
    df["duration_us"] = df["duration_us"] / 1e3
    return df.round(2)


def source_banner(ctx: PhaseContext, res: Phase6Result):
    """Where this page's kernels and counters come from: a sample banner when from ``data/samples``."""
    files = ", ".join(Path(f).name for f in res.ncu_files) or "none"
    text = f"Kernel table: {res.source}. ncu CSVs: {files}."
    if ctx.from_samples:
        return sample_banner(text + " Recorded on a 2 × H200 machine (2026-11-29) with random-weight toy models "
                                    "(data/samples/h200x2-pp2, data/samples/ncu; see capture.sh there) — not this "
                                    "run's engine.")
    return banner(text, "info", "Sources")


def ncu_view(res: Phase6Result, what: str = "derived"):
    """``derived`` (the kernel table), ``stalls``, ``rules`` or ``roofline`` — or a banner when no ncu CSV was imported."""
    if not res.ncu_files:
        return banner("No ncu CSV was imported: run the planned commands above on the GPU node (or pass ncu_csv) "
                      "and re-run this phase.", "warning", "No Nsight Compute data yet")
    stalls = res.stalls.groupby(["file", "id"], sort=False).head(3) if not res.stalls.empty else res.stalls
    roof = res.roof.assign(function=res.roof["function"].map(lambda k: k if len(k) <= 48 else k[:47] + "…")).round(3) \
        if not res.roof.empty else res.roof
    table = {"derived": derived_view(res.derived), "stalls": stalls, "rules": res.rules, "roofline": roof}[what]
    return table


def _shown_path(path: str) -> str:
    """A path relative to the project when it is one of its sample folders, else as given."""
    try:
        return str(Path(path).resolve().relative_to(project_root()))
    except ValueError:
        return str(path)


def _short_name(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def phase3_trace(run_dir: Path | None) -> str | None:
    """The trace folder Phase 3 analysed in this run (its headline), or None when Phase 3 did not run."""
    if run_dir is None:
        return None
    e = (read_manifest(Path(run_dir)).get("phases") or {}).get("phase3") or {}
    return (e.get("headline") or {}).get("from_trace_dir")


def same_capture(source: str, trace_dir: str | None) -> bool:
    """Whether Phase 6's kernel source is (in) Phase 3's capture folder."""
    if not trace_dir:
        return False
    src, d = Path(source).resolve(), Path(trace_dir).resolve()
    return src == d or d in src.parents or (src.parent / "traces").resolve() == d


def headline(res: Phase6Result) -> dict[str, Any]:
    """The key numbers the manifest and the run index keep: the kernel source, the top kernels per window, the ncu
    launches imported and the best tensor throughput on the roofline."""
    return {"kernel source": res.source.split("/")[-1],
            "top kernels": "; ".join(w + ": " + ", ".join(g["function"].map(_short_name))
                                     for w, g in res.top.groupby("window")),
            "ncu launches imported": len(res.derived),
            "best tensor TFLOP/s": round(float(res.roof["achieved_tflops"].max()), 1) if not res.roof.empty else None}


def findings(res: Phase6Result, from_samples: bool = False, run_dir: Path | None = None) -> list[str]:
    """What Phase 6 found, in sentences for the page's findings box: the top kernels per window with their share
    and suspect, what bounds them on the roofline (where ``ncu`` data exists), and the planned ``ncu`` commands —
    and, when this run's Phase 3 analysed another capture, that it did (their shares are not comparable)."""
    src = " (from recorded sample data, 2 × H200 toy models)" if from_samples else ""
    out = []
    if from_samples:         # applicability first: what this page is not about
        target = read_manifest(Path(run_dir)).get("target") if run_dir is not None else None
        gpu = target_has_gpu(Path(run_dir)) if run_dir is not None else None
        out.append(("Not applicable on this target: " if gpu is False else "Not this target's kernels: ")
                   + (f"{target} " if target else "this target ") + ("has no GPU to profile; " if gpu is False else
                                                                     "was not profiled here; ")
                   + "everything below is recorded sample data (2 × H200), shown to teach the method, and says "
                     "nothing about this target.")
    out.append(f"Kernel table{src}: {Path(res.source).name}; {len(res.ranked):,} kernels ranked.")
    p3 = phase3_trace(run_dir)
    if p3 and not same_capture(res.source, p3):
        traces = sorted(x for x in Path(p3).glob("*.json*") if x.is_file())
        redo = ""
        if traces and run_dir is not None:
            target = read_manifest(Path(run_dir)).get("target") or "local"
            redo = (" To rank Phase 3's capture: " + shlex.join(["servelab", "run", "phase6", "--target", str(target),
                                                                 "--run-id", Path(run_dir).name, "-p",
                                                                 f"kernel_source={traces[0]}"]) + ".")
        out.append(f"Not the capture of Phase 3: this page ranks the kernels of {_shown_path(res.source)}, Phase 3 of "
                   f"this run analysed {_shown_path(p3)} — kernel shares here and there are of different runs." + redo)
    for window, g in res.top.groupby("window", sort=False):
        out.append(f"Top kernels of {window} (share of the window's kernel time): " + "; ".join(
            f"{_short_name(str(r.function))} ({r.suspect}, {r.share_pct:.1f} %"
            + (", small kernel" if bool(getattr(r, "small_kernel", False)) else "") + ")"
            for r in g.itertuples()) + ".")
    if not res.roof.empty:
        top = set(res.top["function"])
        per = res.roof.sort_values("pct_of_roof", ascending=False).drop_duplicates("function")
        per = pd.concat([per[per["function"].isin(top)], per[~per["function"].isin(top)]]).head(4)
        out.append(f"Bound under Nsight Compute, best launch per kernel{src}: " + "; ".join(
            f"{_short_name(str(r.function))} {r.bound}-bound, {r.achieved_tflops:,.1f} TFLOP/s = "
            f"{r.pct_of_roof:.0f} % of its {r.precision} roof (intensity {r.intensity_flop_per_byte:,.1f} flop/B)"
            for r in per.itertuples()) + ".")
    else:
        out.append("No ncu CSV was imported: the kernels' bound is not measured yet.")
    if len(res.commands):
        out.append(f"{len(res.commands)} ncu command(s) for a small reproduction are planned, not executed: run them on "
                   "the GPU node and import the CSVs.")
    return out


# ---------------------------------------------------------------- evidence for the ledger (H2, H3)

ROOF_EFFICIENT_PCT = 50.0     # a kernel reaching this share of its roofline ceiling is not the inefficiency
MATTERS_SHARE_PCT = 10.0      # a suspect kernel below this share of every window's time is too small to matter
H_SUSPECTS = {"H2": ("NSA indexer / top-k", "sparse MLA / attention"), "H3": ("MoE grouped GEMM",)}
# labels of the same family that are not the hypothesis' suspects (named so a verdict never reads as denying them)
NEAR_SUSPECTS = {"H2": ("MLA / attention",), "H3": ("MoE gate", "MoE dispatch", "MoE combine")}


def kernel_evidence(res: Phase6Result, hypothesis: str) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) of H2 (indexer / sparse attention) or H3 (MoE grouped GEMM) from the ranked
    kernels and the ncu roofline: no suspect kernel → *inconclusive*; suspects below 10 % of every window →
    *refuted* (too small to matter); otherwise the profiled suspects' fraction of their roofline ceiling decides —
    below 50 % *supported*, at or above *refuted*; suspects never profiled → *inconclusive*."""
    labels = H_SUSPECTS[hypothesis]
    r = res.ranked
    sus = r[r["suspect"].isin(labels)] if not r.empty and "suspect" in r.columns else pd.DataFrame()
    what = " or ".join(f"'{x}'" for x in labels)
    if sus.empty:
        # say what the table does hold of the same family, so "no sparse attention" never reads "no attention"
        near = r[r["suspect"].isin(NEAR_SUSPECTS.get(hypothesis, ()))] if not r.empty and "suspect" in r.columns \
            else pd.DataFrame()
        held = ""
        if not near.empty:
            share = near.groupby("window")["share_pct"].sum()
            held = (f"; the table's {', '.join(sorted(set(near['suspect'])))} kernels ({near['function'].nunique()}, up "
                    f"to {share.max():.1f} % of the {share.idxmax()} window) are not {hypothesis}'s suspects")
        return "inconclusive", (f"no kernel labelled {what} in the kernel table ({Path(res.source).name}){held}"), \
            {"denied_suspects": list(labels)}
    share = sus.groupby("window")["share_pct"].sum()
    nums: dict[str, Any] = {"suspect_kernels": int(sus["function"].nunique()),
                            "max_window_share_pct": round(float(share.max()), 2), "window": str(share.idxmax())}
    if share.max() < MATTERS_SHARE_PCT:
        return "refuted", (f"{what} kernels take at most {share.max():.1f}% of a window's time ({share.idxmax()}): "
                           f"below {MATTERS_SHARE_PCT:g}%, not where the time goes"), nums
    roof = res.roof[res.roof["function"].isin(set(sus["function"]))] if not res.roof.empty else pd.DataFrame()
    roof = roof[roof["pct_of_roof"].notna()] if not roof.empty else roof
    if roof.empty:
        return "inconclusive", (f"{what} kernels take {share.max():.1f}% of the {share.idxmax()} window but none was "
                                "profiled under ncu yet (run the planned commands)"), nums
    pct = float(roof["pct_of_roof"].median())
    nums.update(pct_of_roof_median=round(pct, 1), profiled_launches=int(len(roof)))
    verdict = "supported" if pct < ROOF_EFFICIENT_PCT else "refuted"
    return verdict, (f"{what} kernels take {share.max():.1f}% of the {share.idxmax()} window and reach "
                     f"{pct:.0f}% of their roofline ceiling (median of {len(roof)} profiled launches; "
                     f"threshold {ROOF_EFFICIENT_PCT:g}%)"), nums


def _record_kernel(ctx: PhaseContext, res: Phase6Result, hypothesis: str) -> pd.DataFrame:
    verdict, summary, nums = kernel_evidence(res, hypothesis)
    tables = ["kernels_ranked.csv"] + (["roofline.csv"] if (Path(ctx.phase_dir) / "roofline.csv").is_file() else [])
    return evidence_frame([record_evidence(ctx, hypothesis, verdict, summary, anchor="Roofline", table=tables,
                                           numbers=nums)])


def record_h2(ctx: PhaseContext, res: Phase6Result) -> pd.DataFrame:
    """H2 (NSA indexer or sparse-attention kernels inefficient) from this phase's kernels; see :func:`kernel_evidence`."""
    return _record_kernel(ctx, res, "H2")


def record_h3(ctx: PhaseContext, res: Phase6Result) -> pd.DataFrame:
    """H3 (MoE grouped GEMM inefficient) from this phase's kernels; see :func:`kernel_evidence`."""
    return _record_kernel(ctx, res, "H3")
