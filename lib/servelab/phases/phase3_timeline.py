"""What the Phase 3 notebook calls: analyse a capture folder (or the recorded sample), show each table,
and write every table into the phase folder (``trace_*.csv`` / ``.json``) for tests and reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import pandas as pd
import polars as pl

from servelab.core.params import PhaseParams, param
from servelab.core.paths import cache_root, samples_root
from servelab.analyse.trace.actions import evidence_actions
from servelab.analyse.topology.placement import with_group_placement, with_placement
from servelab.analyse.ceiling import ceiling_finding
from servelab.report.evidence_section import ceiling_table, placement_finding, rank_placement  # the evidence chain
from servelab.analyse.trace.analysis import CaptureAnalysis, analyse, write_tables
from servelab.analyse.trace.metrics import dominant_steps
from servelab.analyse.trace.scenarios import (ScenarioView, analyse_scenarios, answer_capture, case_clock,  # noqa: F401
                                              compare_findings, compare_table, split_q1)
from servelab.analyse.trace.stalls import OneClock, mixed_window_problem, stall_summary
from servelab.measure.capture import DEFAULT_STEPS
from servelab.measure.capture_point import CapturePoint
from servelab.measure.live_capture import ScenarioCapture, live_captures
from servelab.report.ledger import evidence_frame, record_evidence
from servelab.analyse.trace.cluster import analyse_on_cluster
from servelab.deploy.cluster import parse_cluster, require_dask, open_cluster
from servelab.deploy.hosts import ProcessTracker
from servelab.core.paths import project_root
from servelab.phases.context import PhaseContext
from servelab.report.nsys_section import NsysImport, nsys_howto, nsys_import, nsys_view  # noqa: F401 (the page's)
from servelab.report.scenario_section import (capture_point_note, scenario_sections, scenarios_table,  # noqa: F401
                                              subset_findings, subset_table)

SAMPLE_DIR = ("h200x2", "traces")
SAMPLE_TEXT = ("2 x NVIDIA H200 (NVLink), TP=2 torch-profiler traces of a random-weight 8-layer transformer, recorded "
               "2026-11-29: prefill_step_i (4096 tokens), decode_eager_step_i, decode_graph_step_i (CUDA graph), "
               "mixed_decode_step_i with one mixed_prefill_chunk_8192 injected; files data/samples/h200x2/traces/")


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 3's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase3 --cell``); ``-p`` and ``params/phase3.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase3"
    trace_dir: str = param("", "analyse an existing capture; empty: the bundled sample (data/samples/h200x2/traces)")
    capture: bool = param(True, "capture live when the target engine writes traces (vLLM, SGLang) and trace_dir is empty")
    capture_steps: int = param(10,
        "live capture: engine steps per capture (the method's first pass takes 5-10); the mixed one holds 22 "
        "more, at most 32 [min 5] [max 32]")
    scenarios: list = param([],
        "live capture: only these of the four scenarios; empty: all four [items one of decode_control, "
        "mixed_treatment, long_prefill, prefix_hit]")
    capture_at: str = param("",
        "live capture at a Phase 1 point: a case id of this run (or <run_id>:<case_id>), max_tps, slo_max or "
        "a search point by its concurrency (docs/method.md#capture-at); the decode and mixed captures take "
        "its lengths and concurrency; empty: the scale's own")
    profile_id: str = param("", "when the folder holds several SGLang captures, the profile id to analyse")
    window_regex: str = param("",
        "step annotations that define windows; empty: SGLang step[...], *_step_N, *prefill_chunk*, "
        "ProfilerStep N")
    top_n: int = param(10, "top kernels listed per window kind [min 1]")
    min_gap_us: float = param(0.0, "GPU idle gaps shorter than this (µs) are left out of the gap tables")
    timeline_bins: int = param(600, "time bins per row of the timeline figure (rows with fewer ops draw every op) [min 1]")
    cluster: str = param("",
        "parse each rank on the node that holds it: local[:N] (workers here), nodes[:N] (N workers on every "
        "node of the target) or tcp://HOST:PORT (an existing Dask scheduler); trace_dir is the folder as each"
        " node sees it; empty: parse in this process")
    max_capture_gb: float = param(0.0,
        "over this many GB of rank files, analyse only the first and last TP rank of each node and stage and "
        "every rank with cross-node collectives or send/recv (the page lists the ranks left out and why); 0: "
        "every rank [min 0]")
    nsys_dir: str = param("",
        "folder of nsys stats CSVs (nsys stats --report cuda_gpu_kern_sum --format csv --output DIR/report "
        "...) to import; empty: the section says how to make them")


def sample_dir() -> Path:
    return samples_root().joinpath(*SAMPLE_DIR)


@dataclass
class Phase3:
    """The analysis plus the two verdict tables, as shown on the page."""
    analysis: CaptureAnalysis
    questions: pl.DataFrame
    actions: pl.DataFrame
    files: dict[str, str]
    clock: OneClock | None = None
    # what :func:`run` adds (the phase contract): the live capture's table, the nsys import, the page's settings
    captured: pd.DataFrame = field(default_factory=pd.DataFrame)
    captures: list[ScenarioCapture] = field(default_factory=list)    # every scenario the live capture wrote
    capture_point: CapturePoint | None = None      # the Phase 1 point the capture ran at (``capture_at``)
    nsys: NsysImport | None = None
    timeline_bins: int = 600
    from_samples: bool = False
    scenarios: list[ScenarioView] = field(default_factory=list)     # every captured scenario, analysed on its own
    rank_placement: pd.DataFrame = field(default_factory=pd.DataFrame)   # :func:`rank_placement`
    ceiling: pd.DataFrame = field(default_factory=pd.DataFrame)          # :func:`ceiling_table`
    ceiling_source: str = ""

    def headline(self) -> dict[str, Any]:
        return headline(self)

    def findings(self) -> list[str]:
        return findings(self, self.from_samples)


def check_cluster(cluster: str) -> str:
    """The ``cluster`` parameter, checked before anything starts: "" (none), ``local[:N]``, ``nodes[:N]`` or an
    existing scheduler's ``tcp://HOST:PORT``; a one-line error otherwise or when Dask distributed is missing."""
    spec = parse_cluster(cluster)
    if spec is not None:
        require_dask()
    return (cluster or "").strip()


def run(ctx: PhaseContext) -> Phase3:
    """Phase 3's entry (the phase contract), from the notebook's parameters (``ctx.params``): the ``cluster`` checked,
    the live capture (``measure.live_capture.live_captures``), the analysis of the captured (or given, or sample) traces
    (:func:`run_analysis`) and the nsys import (:func:`nsys_import`)."""
    p = ctx.params
    cluster = check_cluster(p.cluster)
    live = live_captures(ctx, p.capture, p.trace_dir, p.capture_at, scenarios=tuple(p.scenarios) or None,
                         steps=p.capture_steps or DEFAULT_STEPS, check=mixed_window_check)
    res = run_analysis(ctx, live.folder, p.window_regex, p.top_n, p.min_gap_us, p.profile_id, cluster=cluster,
                       max_capture_gb=float(p.max_capture_gb), captures=live.captures)
    res.captured, res.captures, res.capture_point = live.table, live.captures, live.point
    run_scenarios(ctx, res, window_regex=p.window_regex or None, top_n=int(p.top_n),
                  min_gap_us=float(p.min_gap_us), profile_id=p.profile_id or None,
                  max_capture_gb=float(p.max_capture_gb))
    res.timeline_bins = int(p.timeline_bins)
    res.from_samples = ctx.from_samples
    res.nsys = nsys_import(ctx, res, p.nsys_dir, p.top_n)
    res.rank_placement = rank_placement(res.analysis, ctx.run_dir)
    res.ceiling, res.ceiling_source = ceiling_table(res.analysis, ctx.run_dir, ctx.phase_dir)
    return res


def run_analysis(ctx: PhaseContext, trace_dir: str = "", window_regex: str = "", top_n: int = 10, min_gap_us: float = 0.0,
                 profile_id: str = "", cluster: str = "", max_capture_gb: float = 0.0,
                 captures: Sequence[ScenarioCapture] = ()) -> Phase3:
    """Analyse ``trace_dir`` (empty: the recorded H200 sample, and ``ctx.from_samples`` is set), answer the
    ten questions, apply the evidence → action table and write every table into ``ctx.phase_dir``.

    ``cluster`` (``local[:N]``, ``nodes[:N]``, ``tcp://HOST:PORT``): each rank is parsed and reduced by a worker on
    the node that holds it (``trace_dir`` is the folder as each node sees it), the cross-rank steps here;
    what servelab starts for it is stopped before this returns (docs/scaling.md#beyond-one-machine)."""
    if not trace_dir:
        folder, ctx.from_samples = sample_dir(), True
        cache_dir = cache_root() / "traces"      # never write caches into the repository's data/samples
    else:
        folder, cache_dir = Path(trace_dir).expanduser(), None
    kw = dict(window_regex=window_regex or None, top_n=int(top_n), min_gap_us=float(min_gap_us),
              profile_id=profile_id or None)
    if check_cluster(cluster):
        a = _analyse_on_cluster(ctx, cluster, folder, cache_dir, kw)
    else:      # over max_capture_gb: a representative rank subset, every left-out rank said (analyse.trace.subset)
        a = analyse(folder, cache_dir=cache_dir, max_capture_gb=0.0 if ctx.from_samples else max_capture_gb, **kw)
    q, clock, extra = answer_capture(a, folder, _capture_label(ctx, folder, captures))   # Q10 also from the one clock
    act = evidence_actions(a, run_dir=ctx.run_dir)
    extra["actions"] = act
    files = write_tables(a, ctx.phase_dir, extra)
    if ctx.from_samples:
        ctx.add_source("samples", f"2 × H200 torch-profiler traces ({_rel(folder)}), not this run's engine")
    else:
        ctx.add_source("live", f"the capture in {folder}")
    return Phase3(a, q, act, files, clock)


def _capture_label(ctx: PhaseContext, folder: Path, captures: Sequence[ScenarioCapture] = ()) -> str:
    """How an answer names the capture it comes from: the scenario and its case for a live capture, the sample, or
    the folder given."""
    for c in captures:
        if Path(c.profiles).resolve() == Path(folder).resolve():
            return f"{c.scenario.name} ({Path(c.case_dir).name})"
    return f"recorded sample ({_rel(folder)})" if ctx.from_samples else str(folder)


def run_scenarios(ctx: PhaseContext, res: Phase3, **kw: Any) -> None:
    """Every scenario the live capture wrote, analysed on its own (``analyse.trace.scenarios``; the main capture's
    analysis reused), its tables under ``<phase>/scenarios/<scenario>/``, the side-by-side table as
    ``scenarios/trace_scenario_compare.csv``; the page's Q1 then answers prefill from the long-prefill capture and
    decode from the decode control. Nothing without a live capture (``trace_dir``, the sample)."""
    caps = [{"scenario": c.scenario.name, "case_id": Path(c.case_dir).name, "bound_case_id": c.scenario.case_id,
             "folder": c.profiles} for c in res.captures if c.result is not None]
    if not caps:
        return
    out = ctx.phase_dir / "scenarios"
    res.scenarios = analyse_scenarios(caps, out, {Path(res.analysis.capture.trace_dir): res.analysis}, **kw)
    compare_table(res.scenarios).write_csv(out / "trace_scenario_compare.csv")
    q1 = split_q1(res.scenarios)
    if q1 is not None:
        res.questions = pl.concat([pl.DataFrame([q1]).select(res.questions.columns),
                                   res.questions.filter(pl.col("id") != "Q1")])
        write_tables(res.analysis, ctx.phase_dir, {"questions": res.questions}, only_extra=True)


def _rel(folder: Path) -> str:
    """``data/samples/…`` for a folder of the shipped samples, the path itself otherwise."""
    try:
        return str(Path(folder).resolve().relative_to(project_root()))
    except ValueError:
        return str(folder)


def _analyse_on_cluster(ctx: PhaseContext, cluster: str, folder: Path, cache_dir: Path | None, kw: dict) -> CaptureAnalysis:
    """Open the cluster (joined, or started and tracked), analyse on it, close it — on every exit path."""
    with ProcessTracker() as tracker:
        c = open_cluster(cluster, tracker, ctx.phase_dir / "cluster", target=ctx.target, run_id=ctx.run_id)
        try:
            a = analyse_on_cluster(c, str(folder), cache_dir=str(cache_dir) if cache_dir else None, **kw)
        finally:
            c.close()
    a.cluster_notes = [f"Cluster: {c.spec.describe() if c.spec else cluster} ({c.address}).", *a.cluster_notes]
    return a


def placement_table(p: Phase3) -> pd.DataFrame:
    """Where each rank file was parsed (node, worker), in how many attempts, and why a rank is missing; a note when
    the capture was parsed in this process."""
    a = p.analysis
    if a.placement.height == 0:
        return pd.DataFrame({"note": ["parsed in this process (no cluster parameter)"]})
    t = _pd(a.placement.select("rank", "file", "node", "worker", "status", "attempts", "reduce_s", "from_cache",
                               "reason"))
    missing = a.placement.filter(pl.col("status") == "missing")
    t.attrs["caption"] = (f"{a.placement.height - missing.height} of {a.placement.height} rank files parsed on "
                          f"{a.placement.filter(pl.col('status') == 'parsed')['node'].n_unique()} node(s); "
                          + (f"MISSING: {', '.join(missing['file'])} (left out of every table below). "
                             if missing.height else "none missing. ")
                          + " ".join(a.cluster_notes))
    return t


def _pd(df: pl.DataFrame, round_to: int = 3) -> pd.DataFrame:
    if df is None or df.height == 0:
        return pd.DataFrame()
    out = df.to_pandas()
    num = out.select_dtypes("float").columns
    out[num] = out[num].round(round_to)
    return out




def ranks_table(p: Phase3) -> pd.DataFrame:
    """One row per rank trace: file, role, global rank, TP/DP/PP/EP, node, events, kernels, load time."""
    cols = ["file", "role", "rank", "world_size", "tp", "dp", "pp", "ep", "stage", "node", "engine", "source", "events",
            "kernels", "gpu", "load_s", "from_cache"]
    r = p.analysis.ranks
    return _pd(r.select([c for c in cols if c in r.columns]))


def windows_table(p: Phase3) -> pd.DataFrame:
    """Per (rank, window kind): steps, median step, GPU time, busy %, comm %, exposed comm %, host-bound idle %,
    graph share (all columns in trace_summary.csv)."""
    s = p.analysis.summary
    if s.height == 0:
        return pd.DataFrame()
    return _pd(s.select("rank", "kind", "windows", "median_step_ms", "gpu_span_ms", "busy_pct", "comm_pct",
                        "exposed_comm_pct", "overlap_pct", "idle_ms", "host_bound_idle_pct", "gaps", "graph_op_pct"))


def breakdown_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.breakdown)


def top_kernels_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.top_kernels.drop("name"))


def overlap_table(p: Phase3) -> pd.DataFrame:
    """Exposed communication and overlap per rank and window kind, with where each rank runs."""
    return with_placement(_pd(p.analysis.overlap_table()), p.rank_placement)


def gaps_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.gap_summary)


def graph_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.graph)


def ceiling_view(p: Phase3) -> pd.DataFrame:
    """The collectives-against-the-ceiling table, its ceiling's source as the caption."""
    if p.ceiling.empty:
        return pd.DataFrame({"note": ["no collective with a message size in this capture"]})
    t = p.ceiling.round(3)
    t.attrs["caption"] = f"ceiling: {p.ceiling_source or 'none measured (run Phase 5)'}"
    return t


def alignment_table(p: Phase3) -> pd.DataFrame:
    """Clock offsets per rank with the alignment notes, the skew per step and the slow-rank verdict."""
    a = p.analysis
    t = _pd(a.alignment.table)
    notes = "; ".join(a.alignment.notes)
    slow = a.slow_rank.get("evidence", "")
    rank = a.slow_rank.get("slow_rank")              # words, never a repr ("alignment ok: True", "Slow rank: None")
    caption = (f"clocks {'aligned' if a.alignment.alignment_ok else 'not aligned'}. {notes}. Slow rank: "
               + (f"{rank} — {slow}" if rank is not None else f"none — {slow}" if slow else "none"))
    if a.slow_rank.get("slow_stage") is not None:
        caption += f". Slow pipeline stage: {a.slow_rank['slow_stage']} (see Which stage holds the pipeline back)"
    if not len(t):
        return pd.DataFrame({"note": [caption]})
    if not p.rank_placement.empty and "rank" in t.columns:        # where each rank runs
        t = with_placement(t, p.rank_placement)
    t.attrs["caption"] = caption            # drawn above the table by the page's table display (escaped)
    return t


def skew_table(p: Phase3, worst: int = 15) -> pd.DataFrame:
    """Steps with the largest end-time skew across ranks (µs), which rank finished last; every step is in
    trace_step_skew.csv."""
    s = p.analysis.step_skew
    if s.height == 0:
        return pd.DataFrame({"note": ["fewer than two ranks share a step window"]})
    return _pd(s.sort("end_skew_us", descending=True).head(worst)
               .select("window", "name", "kind", "ranks", "end_skew_us", "start_skew_us", "last_rank", "first_rank"))


def collective_skew_table(p: Phase3) -> pd.DataFrame:
    return _pd(p.analysis.collective_skew)


def pp_table(p: Phase3) -> pd.DataFrame:
    """PP stage busy / bubble / both-stages-busy; empty when the ranks carry no PP identity."""
    a = p.analysis
    both = pl.concat([a.pp, a.pp_compute], how="diagonal_relaxed") if a.pp.height else a.pp
    if both.height == 0:
        return pd.DataFrame({"note": ["no PP identity in the trace file names (…-PP-<n>…): a single pipeline stage"]})
    return _pd(both)


def stage_table(p: Phase3) -> pd.DataFrame:
    """Per stretch of steps, window kind and pipeline stage: GPU ms per step, the stage ratio, which stage holds
    the pipeline back and the SendRecv wait on the others (docs/metrics.md#stages); every step in
    trace_stage_steps.csv."""
    a = p.analysis
    t = a.stages
    if t.height == 0:
        return pd.DataFrame({"note": ["one pipeline stage: no per-stage view (no …-PP-<n>… identity with two stages)"]})
    multi = t["pipeline"].n_unique() > 1
    out = _pd(t.select(*(["pipeline"] if multi else []), "first_step", "last_step", "kind",
                       pl.col("steps").alias("steps_of_kind"), "verdict", "stage", "ranks", "role",
                       "gpu_ms_per_step", pl.col("stage_ratio").alias("stage_ratio_x"), "sendrecv_ms_per_step",
                       pl.col("sendrecv_ms").alias("sendrecv_stretch_ms"),
                       pl.col("baseline_sendrecv_ms_per_step").alias("balanced_sendrecv_ms_per_step"),
                       pl.col("excess_sendrecv_ms").alias("wait_caused_ms")))
    out.attrs["caption"] = f"Slow stage: {a.slow_rank.get('slow_stage')} — {a.slow_rank.get('stage_evidence', '')}"
    return with_group_placement(out, p.rank_placement)


def nccl_table(p: Phase3) -> pd.DataFrame:
    """One row per (collective, kernel, dtype, size, group); all columns in trace_nccl_forensics.csv."""
    n = p.analysis.nccl
    if n.height == 0:
        return pd.DataFrame({"note": ["no communication kernels in this capture"]})
    return _pd(n.select("collective", "subclass", "dtype", "msg_mib", "group_size", "count", "ranks", "kinds",
                        "in_graph_pct", "total_ms", "p50_us", "p95_us", "min_us", "busbw_p50_gbps", "busbw_best_gbps",
                        "name_algo", "name_proto"))


def interference_table(p: Phase3) -> pd.DataFrame:
    """Decode steps that followed prefill work, worst first (the evidence of Q10)."""
    it = p.analysis.interference
    if it.height == 0:
        return pd.DataFrame({"note": ["no decode steps in this capture"]})
    return _pd(it.sort("delay_ms", descending=True).head(10)
               .select("rank", "window", "name", "interval_ms", "baseline_ms", "delay_ms", "prefill_span_ms",
                       "prefill_between_ms", "prefill_windows", "queued_ms"))


def _ms_from(clock: OneClock, ns: Any) -> pd.Series:
    return (pd.Series(ns, dtype="float64") - clock.t0_ns) / 1e6


def stall_table(p: Phase3) -> pd.DataFrame:
    """Every client-observed stall (a gap between two chunks of one stream above the steady-state P99 ITL) that
    overlapped the traced steps, with those steps named by what they computed and how long they took, worst first;
    ``at_ms`` is the gap's start on the case's one timeline (0 = first traced step or first send)."""
    c = p.clock
    if c is None:
        return pd.DataFrame({"note": ["no client records beside this trace (not a live profiled case): no one-clock "
                                      "view"]})
    if not c.clock.get("joined", True):
        return pd.DataFrame({"note": [f"one clock not joined: {c.clock.get('method', '')}"]})
    if c.stalls.height == 0:
        return pd.DataFrame({"note": [f"no gap above the steady-state P99 ITL ({c.p99_itl_ms} ms) overlapped the "
                                      f"{c.steps.height} traced steps"]})
    t = c.stalls.sort("gap_ms", descending=True).to_pandas()
    t.insert(3, "at_ms", _ms_from(c, t.pop("gap_start_ns")).round(3))
    t = t.rename(columns={"gap_ms": "gap_ms", "threshold_ms": "p99_itl_ms", "prefill_tokens": "prefill_tokens_in_gap",
                          "steps": "overlapping_steps"})
    t.attrs["caption"] = (f"steady-state P99 ITL {c.p99_itl_ms:.3f} ms from {c.steady_gaps} {c.steady_basis}; "
                          f"clock: {'' if c.clock.get('shared_clock', True) else c.clock.get('method', '') + '; '}"
                          f"{c.clock.get('bound', '')}")
    return t


def ttft_split_table(p: Phase3) -> pd.DataFrame:
    """Each request's TTFT split into queueing (send → its prefill step starts), prefill (the step) and delivery
    (step end → first chunk at the client), where the trace identifies the prefill step."""
    c = p.clock
    if c is None:
        return pd.DataFrame({"note": ["no client records beside this trace: no TTFT split"]})
    return _pd(c.ttft)


def questions_table(p: Phase3) -> pd.DataFrame:
    """The ten questions with their answers, evidence and sources: a plain table, every cell escaped and shown in
    full by the page's table display (trace file and kernel names are data, never markup)."""
    return _pd(p.questions.select("id", "question_en", "question", "answerable", "answer", "capture", "evidence",
                                  "source"))


def actions_table(p: Phase3) -> pd.DataFrame:
    """The evidence → next A/B table (plain, escaped by the page's table display)."""
    return _pd(p.actions)


def headline(p: Phase3) -> dict[str, Any]:
    """A few key numbers for the manifest; where one step dominates a kind's exposed communication
    (:func:`dominant_steps`), the kind's share without that step beside it."""
    a = p.analysis
    out: dict[str, Any] = {"ranks": len(a.rops), "from_trace_dir": str(a.capture.trace_dir)}
    dom = {d["kind"]: d for d in dominant_steps(a.window_metrics, a.step_skew)}
    for k in ("prefill", "decode", "mixed", "all"):
        s = a.summary.filter(pl.col("kind") == k) if a.summary.height else a.summary
        if s.height:
            span = s["gpu_span_ms"].sum()
            out[f"{k}_exposed_comm_pct"] = round(100 * s["exposed_comm_ms"].sum() / span, 2) if span else None
            if k in dom and dom[k]["without_pct"] is not None:
                out[f"{k}_exposed_comm_without_{dom[k]['step']}_pct"] = round(dom[k]["without_pct"], 2)
            out[f"{k}_busy_pct"] = round(100 * s["busy_ms"].sum() / span, 2) if span else None
    if a.step_skew.height:
        out["step_end_skew_p50_us"] = round(float(a.step_skew["end_skew_us"].median()), 2)
    out["slow_rank"] = a.slow_rank.get("slow_rank")
    out["slow_stage"] = a.slow_rank.get("slow_stage")
    if p.clock is not None:
        st = stall_summary(p.clock)
        out.update({"p99_itl_ms": None if st["p99_itl_ms"] is None else round(st["p99_itl_ms"], 3),
                    "stalls": st["stalls"], "prefill_stalls": st["prefill_stalls"]})
    out["questions_answered"] = int(p.questions["answerable"].sum())
    out["actions_triggered"] = int((p.actions["status"] == "triggered").sum())
    return out


def mixed_window_check(cap: Any) -> str:
    """Why a captured mixed scenario cannot show its injected prefill delaying decode (``analyse.trace.stalls.
    mixed_window_problem`` on its trace's steps; "" when it can, for every other scenario, and for a trace that
    cannot be read — the page's own analysis reports that). The analysis caches the trace's columns, so the page's
    own analysis of the same capture reads them back."""
    if cap.scenario.name != "mixed_treatment":
        return ""
    try:
        windows = analyse(cap.profiles).windows
    except (OSError, ValueError):
        return ""
    return mixed_window_problem(windows, cap.scenario.isl_tokens, cap.scenario.inject_isl_tokens)


def _short(text: str, limit: int = 400) -> str:
    """An answer cut for one line: per window kind only its first item when the kinds are ``|``-separated, then at
    most ``limit`` characters, cut at a ``;`` (or a space)."""
    text = " ".join(str(text).split())
    if len(text) > limit and " | " in text:
        text = " | ".join(part.split("; ")[0] for part in text.split(" | "))
    if len(text) <= limit:
        return text
    cut = text.rfind("; ", 0, limit)
    cut = cut if cut > limit // 2 else text.rfind(" ", 0, limit)
    return text[:cut].rstrip(";, ") + " …"


def findings(p: Phase3, from_samples: bool | None = None) -> list[str]:
    """What Phase 3 found, for the page's findings box: one line per timeline question with its answer (the
    questions table), then the evidence → next A/B rows that triggered."""
    a = p.analysis
    if from_samples is None:
        from_samples = Path(a.capture.trace_dir).resolve() == sample_dir().resolve()
    src = "from recorded sample data (2 × H200 traces)" if from_samples else f"from the capture in {a.capture.trace_dir}"
    out = [f"{len(a.rops)} rank(s) analysed {src}; {int(p.questions['answerable'].sum())} of {p.questions.height} "
           f"questions answerable."]
    if p.scenarios:
        out.append(f"{len(p.scenarios)} captured scenarios analysed, each on its own (see Every captured scenario): "
                   + ", ".join(v.label + (f" NOT analysed: {v.error}" if v.error else "") for v in p.scenarios) + ".")
        out += compare_findings(p.scenarios)
    if a.rops and all(r.device == "cpu" for r in a.rops):
        out.append("An engine on CPU: its trace holds no GPU op, so on this page the device work ('GPU' in the table "
                   "headers) is the forward's torch ops on the step thread, and communication is torch's gloo "
                   "collectives on their own threads (docs/metrics.md#cpu-engines); CUDA-graph coverage does not apply.")
    out += subset_findings(a.rank_subset)
    if a.placement.height:
        parsed = a.placement.filter(pl.col("status") == "parsed")
        out.append(f"Parsed on a cluster: {parsed.height} rank file(s) on {parsed['node'].n_unique()} node(s), each on "
                   f"the node that holds it (see Where each rank was parsed).")
        for r in a.placement.filter(pl.col("status") == "missing").iter_rows(named=True):
            out.append(f"Rank file {r['file']} on node {r['node']} is MISSING from every table after {r['attempts']} "
                       f"attempt(s): {r['reason']}.")
    if a.slow_rank.get("slow_stage") is not None:
        out.append("Slow pipeline stage: " + a.slow_rank.get("stage_evidence", "") + ".")
    if (shared := placement_finding(p.analysis, p.rank_placement)) is not None:     # shared NIC/NUMA
        out.append(shared)
    if not p.ceiling.empty and (ceil := ceiling_finding(p.ceiling, f"ceiling ({p.ceiling_source})")):
        out.append(ceil)
    for d in dominant_steps(a.window_metrics, a.step_skew):
        wait = ""
        if d["start_skew_us"] is not None and d["start_skew_us"] >= 1000:
            wait = (f": the ranks started it {d['start_skew_us'] / 1e3:.1f} ms apart (rank {d['first_rank']} waited "
                    f"for rank {d['late_rank']})")
        out.append(f"Flag: {d['kind']}'s exposed communication ({d['exposed_pct']:.1f} % of GPU step time) is mostly one "
                   f"step — {d['step']} holds {d['exposed_ms']:.2f} of {d['total_ms']:.2f} ms ({d['share_pct']:.0f} %)"
                   f"{wait}. Without that step it is "
                   + (f"{d['without_pct']:.1f} %" if d["without_pct"] is not None else "-")
                   + ": quote that, and read the step's wait as start-up, not as communication cost.")
    if p.clock is not None:
        st = stall_summary(p.clock)
        tt = p.clock.ttft.filter(pl.col("identified")) if p.clock.ttft.height else p.clock.ttft
        split = "; ".join(f"{r['request_id'].rsplit('-', 2)[-2]} {r['input_tokens']} tok: TTFT {r['ttft_ms']:.1f} ms = "
                          f"queueing {r['queueing_ms']:.1f} + prefill {r['prefill_ms']:.1f} + delivery "
                          f"{r['delivery_ms']:.1f} ms" for r in tt.iter_rows(named=True))
        p99 = "-" if st["p99_itl_ms"] is None else f"{st['p99_itl_ms']:.1f} ms"
        ck = p.clock.clock
        if not ck.get("joined", True):
            out.append(f"One clock: not joined — {ck.get('method', '')}.")
        else:
            where = ("the host's wall clock" if ck.get("shared_clock", True) else
                     f"the client's clock ({ck.get('method', '')}; causality: {ck.get('bound', '')})")
            out.append(f"One clock: {p.clock.steps.height} engine steps and {p.clock.gaps.height} client inter-chunk "
                       f"gaps on {where}; {st['stalls']} stalls above the steady-state P99 ITL ({p99}), "
                       f"{st['prefill_stalls']} of them overlapping a prefill step. "
                       f"{split or 'No prefill step identified.'}")
    for r in p.questions.iter_rows(named=True):
        why = "" if r["answerable"] else f" ({str(r['evidence']).split(' — ')[0]})"
        src = f" [from {r['capture']}]" if r.get("capture") else ""       # answers made outside a phase name none
        out.append(f"{r['id']} {r['question_en']} {_short(r['answer'])}{why}{src}")
    act = p.actions.filter(pl.col("status") == "triggered") if p.actions.height else p.actions
    if act.height:
        out.append("Next A/B, triggered by the evidence: " + "; ".join(
            f"{r['metric']} {r['measured']} (threshold {r['threshold']}) → {r['next_ab']}"
            for r in act.iter_rows(named=True)) + ".")
    else:
        out.append("No evidence → next A/B rule triggered on this capture.")
    return out


# ---------------------------------------------------------------- evidence for the ledger (H1–H5)
#
# Each rule reads this phase's own tables (the evidence → action rows, the window summary, the kernel breakdown,
# CUDA-graph coverage) and records one piece of evidence linking the section and the CSVs it rests on. A capture
# read from data/samples is recorded as such (never more than inconclusive for the live target).

def _action_row(p: Phase3, metric_part: str) -> dict[str, Any]:
    """The evidence → action row whose metric names ``metric_part`` (empty dict when absent)."""
    rows = [r for r in p.actions.iter_rows(named=True) if metric_part in str(r["metric"])]
    return rows[0] if rows else {}


def _verdict_of(row: dict[str, Any]) -> str:
    st = str(row.get("status", ""))
    return "supported" if st == "triggered" else "refuted" if st == "not triggered" else "inconclusive"


def _nodes(p: Phase3) -> int:
    r = p.analysis.ranks
    if r.height == 0 or "node" not in r.columns:
        return 0
    return int(r.filter(pl.col("role") == "rank")["node"].drop_nulls().n_unique()) if "role" in r.columns \
        else int(r["node"].drop_nulls().n_unique())


def _share(p: Phase3, cls: str, kind: str | None = None) -> float:
    """Share (%) of a kernel class in GPU op time, summed over window kinds (or of one kind)."""
    b = p.analysis.breakdown
    if b.height == 0:
        return 0.0
    if kind is not None:
        b = b.filter(pl.col("kind") == kind)
    tot = float(b["total_ms"].sum())
    return 100 * float(b.filter(pl.col("cls") == cls)["total_ms"].sum()) / tot if tot else 0.0


def _record(ctx: PhaseContext, hid: str, verdict: str, summary: str, anchor: str, tables: list[str],
            nums: dict[str, Any]) -> pd.DataFrame:
    return evidence_frame([record_evidence(ctx, hid, verdict, summary, anchor=anchor, table=tables, numbers=nums)])


def record_h1(ctx: PhaseContext, p: Phase3) -> pd.DataFrame:
    """H1 (TP cross-node communication exposed): the decode exposed TP-collective share of the GPU step (the
    evidence → action row, threshold 15 %). *supported* at or above it, *refuted* below — but only when the
    capture's ranks span more than one node; a one-node capture is *inconclusive* (H1 is about cross-node)."""
    row = _action_row(p, "exposed TP-collective time")
    nodes = _nodes(p)
    nums = {"measured": row.get("measured", "-"), "threshold": row.get("threshold", "-"), "nodes": nodes,
            "decode_comm_share_pct": round(_share(p, "communication", "decode"), 2)}
    verdict = _verdict_of(row)
    summary = f"{row.get('metric', 'decode exposed TP-collective time')}: {row.get('measured', '-')} " \
              f"(threshold {row.get('threshold', '-')}, {row.get('status', 'not evaluable')})"
    if verdict != "inconclusive" and nodes <= 1:
        summary += f"; the capture's ranks are on {nodes or 'one'} node — no cross-node collective to judge"
        verdict = "inconclusive"
    return _record(ctx, "H1", verdict, summary, "Exposed-communication-and-overlap-(Q2,-Q3)",
                   ["trace_actions.csv", "trace_summary.csv", "trace_ranks.csv"], nums)


def record_h2(ctx: PhaseContext, p: Phase3) -> pd.DataFrame:
    """H2 (indexer / sparse attention inefficient): indexer time / the attention it serves (threshold 0.8×);
    *inconclusive* when the capture has no indexer kernels."""
    row = _action_row(p, "indexer time")
    nums = {"measured": row.get("measured", "-"), "threshold": row.get("threshold", "-"),
            "attention_share_pct": round(_share(p, "attention"), 2)}
    summary = f"indexer time / attention time: {row.get('measured', '-')} (threshold {row.get('threshold', '-')}, " \
              f"{row.get('status', 'not evaluable')}); attention is {nums['attention_share_pct']:.1f}% of GPU op time"
    return _record(ctx, "H2", _verdict_of(row), summary, "Kernel-breakdown-per-window-kind",
                   ["trace_actions.csv", "trace_kernel_breakdown.csv"], nums)


def record_h3(ctx: PhaseContext, p: Phase3) -> pd.DataFrame:
    """H3 (MoE grouped GEMM or routing imbalance): with MoE kernels in the capture, a fixed slow rank (last at
    collectives ≥ 75 % and ≥ 10 µs late) *supports* routing imbalance; without one it stays *inconclusive*
    (grouped-GEMM efficiency is Phase 6's); no MoE kernels: *inconclusive*."""
    moe = _share(p, "moe")
    row = _action_row(p, "last arrival")
    nums = {"moe_share_pct": round(moe, 2), "slow_rank": p.analysis.slow_rank.get("slow_rank"),
            "slow_rank_status": row.get("status", "-")}
    if moe == 0:
        verdict, summary = "inconclusive", "no MoE kernels in this capture (kernel breakdown): H3 cannot be judged here"
    elif row.get("status") == "triggered":
        verdict, summary = "supported", (f"MoE kernels take {moe:.1f}% of GPU op time and rank "
                                         f"{nums['slow_rank']} is a fixed slow rank: {row.get('measured', '')}")
    else:
        verdict, summary = "inconclusive", (f"MoE kernels take {moe:.1f}% of GPU op time; no fixed slow rank "
                                            f"({row.get('status', 'not evaluable')}); grouped-GEMM efficiency is "
                                            "Phase 6's to judge")
    return _record(ctx, "H3", verdict, summary, "Across-ranks:-clock-alignment,-skew,-slow-rank-(Q6,-Q7)",
                   ["trace_kernel_breakdown.csv", "trace_collective_skew.csv", "trace_actions.csv"], nums)


def record_h4(ctx: PhaseContext, p: Phase3) -> pd.DataFrame:
    """H4 (long prefill interferes with decode): the worst decode token interval after prefill work over the
    steady interval (threshold 2×): *supported* at or above, *refuted* below, *inconclusive* without prefill
    between decode steps."""
    row = _action_row(p, "worst decode token interval")
    nums = {"measured": row.get("measured", "-"), "threshold": row.get("threshold", "-")}
    summary = f"worst decode token interval / steady interval: {row.get('measured', '-')} " \
              f"(threshold {row.get('threshold', '-')}, {row.get('status', 'not evaluable')})"
    return _record(ctx, "H4", _verdict_of(row), summary, "Decode-steps-delayed-by-prefill-(Q10)",
                   ["trace_interference.csv", "trace_actions.csv"], nums)


def record_h5(ctx: PhaseContext, p: Phase3) -> pd.DataFrame:
    """H5 (CPU scheduler / launch leaves GPU gaps): host-bound GPU idle inside steps (threshold 10 % of step time,
    worst window kind) or an under-used GPU beside a saturated launching thread *supports* it; neither refutes it.
    The decode CUDA-graph coverage is reported with it."""
    host, cpu = _action_row(p, "host-bound GPU idle"), _action_row(p, "launching thread busy")
    g = p.analysis.graph
    dec = g.filter(pl.col("kind") == "decode") if g.height else g
    graphed = round(float(dec["graph_op_pct"].mean()), 1) if dec.height else None
    verdicts = {_verdict_of(host), _verdict_of(cpu)}
    verdict = "supported" if "supported" in verdicts else "refuted" if verdicts == {"refuted"} else "inconclusive"
    nums = {"host_bound_idle": host.get("measured", "-"), "gpu_vs_cpu_thread": cpu.get("measured", "-"),
            "decode_graph_op_pct": graphed}
    summary = (f"host-bound GPU idle {host.get('measured', '-')} (threshold {host.get('threshold', '-')}, "
               f"{host.get('status', 'not evaluable')}); {cpu.get('measured', '-')} ({cpu.get('status', '-')}); "
               f"decode kernels from CUDA graphs: {'-' if graphed is None else f'{graphed:.0f}%'}")
    return _record(ctx, "H5", verdict, summary, "GPU-idle-gaps:-host-bound-or-not-(Q4)",
                   ["trace_actions.csv", "trace_summary.csv", "trace_graph_coverage.csv"], nums)


def record_evidence_all(ctx: PhaseContext, p: Phase3) -> pd.DataFrame:
    """H1–H5 from this capture, one row each (what the page shows under "Evidence for H1–H5")."""
    return pd.concat([f(ctx, p) for f in (record_h1, record_h2, record_h3, record_h4, record_h5)], ignore_index=True)


# ---------------------------------------------------------------- Nsight Systems stats next to the trace
