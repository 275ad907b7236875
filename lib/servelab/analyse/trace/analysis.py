"""Compose: load a capture, prepare every rank, compute every table once, write them for the report."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import polars as pl

from servelab.analyse.trace import exposed_comm as E
from servelab.analyse.trace import metrics as M
from servelab.analyse.trace import nccl as N
from servelab.analyse.trace import prepared as P
from servelab.analyse.trace import ranks as R
from servelab.analyse.trace import stages as S
from servelab.analyse.trace.load import Capture, load_capture
from servelab.analyse.trace.ops import RankOps, prepare_rank
from servelab.analyse.trace.subset import plan_subset
from servelab.analyse.trace.taxonomy import Rule, load_rules


@dataclass
class CaptureAnalysis:
    """Every table of the Phase 3 timeline analysis for one capture (all frames are polars)."""
    capture: Capture
    rops: list[RankOps]
    window_regex: str | None
    top_n: int
    ranks: pl.DataFrame
    windows: pl.DataFrame
    window_metrics: pl.DataFrame
    summary: pl.DataFrame
    breakdown: pl.DataFrame
    top_kernels: pl.DataFrame
    gaps: pl.DataFrame
    gap_summary: pl.DataFrame
    graph: pl.DataFrame
    launch: pl.DataFrame
    device_busy: pl.DataFrame
    cpu_threads: pl.DataFrame
    alignment: R.Alignment
    collective_skew: pl.DataFrame
    step_skew: pl.DataFrame
    slow_rank: dict
    pp: pl.DataFrame
    pp_compute: pl.DataFrame
    nccl: pl.DataFrame
    interference: pl.DataFrame
    census: pl.DataFrame = field(default_factory=pl.DataFrame)
    stage_steps: pl.DataFrame = field(default_factory=pl.DataFrame)
    stages: pl.DataFrame = field(default_factory=pl.DataFrame)
    comm_by_collective: pl.DataFrame = field(default_factory=pl.DataFrame)
    timings_s: dict[str, float] = field(default_factory=dict)
    # the controller process' CPU time per step (all its threads): beside timings_s, work told apart from waiting
    cpu_s: dict[str, float] = field(default_factory=dict)
    # analysed on a cluster (analyse.trace.cluster): where each rank file was parsed, and what the listing found
    placement: pl.DataFrame = field(default_factory=pl.DataFrame)
    cluster_notes: list[str] = field(default_factory=list)
    # max_capture_gb: every rank file, kept or left out of the analysis, and why (analyse.trace.subset)
    rank_subset: pl.DataFrame = field(default_factory=pl.DataFrame)

    @property
    def trace_files(self) -> list[str]:
        return [t.path.name for t in self.capture.ranks]

    def overlap_table(self) -> pl.DataFrame:
        """Exposed communication and overlap per (rank, window kind) — the table the notebook shows."""
        s = self.summary
        if s.height == 0:
            return s
        return s.select("rank", "kind", "windows", "gpu_span_ms", "compute_ms", "comm_ms", "exposed_comm_ms",
                        "comm_pct", "exposed_comm_pct", "overlap_pct")


def _concat(frames: Iterable[pl.DataFrame]) -> pl.DataFrame:
    frames = [f for f in frames if f is not None and f.height]
    return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()


def analyse(capture: Capture | str | Path, *, window_regex: str | None = None, top_n: int = 10,
            extra_rules: Sequence[Rule | Sequence[str] | dict] | None = None, min_gap_us: float = 0.0,
            cache: bool = True, cache_dir: str | Path | None = None, profile_id: str | None = None,
            nodes: dict[str, str] | None = None, workers: int | None = None,
            keep_events: bool = True, prepared_tables: Sequence[P.Prepared] | None = None,
            max_capture_gb: float = 0.0) -> CaptureAnalysis:
    """Analyse a capture folder (or an already loaded :class:`Capture`): every table of Phase 3.

    ``window_regex`` selects the step annotations (default: SGLang ``step[...]``, ``*_step_N``,
    ``*prefill_chunk*``, ``ProfilerStep#N``); ``extra_rules`` extend the kernel taxonomy;
    ``min_gap_us`` drops shorter idle gaps from the gap tables; ``workers`` bounds the parsing processes.

    ``keep_events=False`` streams a capture folder rank by rank: each rank is parsed (into its Parquet cache),
    prepared, its event-level tables (CPU threads, census) computed, and its event frame released before the
    next rank is parsed; the cross-rank steps then work on the per-rank op / window / runtime tables only.
    ``RankTrace.reload_events()`` reads a released frame back from the cache.

    With ``cache``, each rank's prepared tables (op table, windows, runtime calls, CPU thread busy, census) are
    cached beside its event cache (:mod:`~servelab.analyse.trace.prepared`); a rank found there is analysed
    without reading its events. Every metric is computed again on every call.

    ``prepared_tables``: the ranks' prepared tables already made elsewhere (one per rank of a :class:`Capture`,
    e.g. by cluster workers on the nodes that hold the files: :mod:`~servelab.analyse.trace.cluster`); the
    cross-rank steps then run on them exactly as on tables prepared here.

    ``max_capture_gb`` (> 0, a capture folder): over this many GB of rank files only a representative subset is
    loaded (:func:`~servelab.analyse.trace.subset.plan_subset`); ``rank_subset`` says which rank was left out and why.
    """
    clock = _Clock()
    rules = load_rules(extra_rules)
    prepared: dict[int, RankOps] = {}
    given = {id(p.rops.trace): p for p in prepared_tables or ()}
    per_rank: dict[int, tuple[pl.DataFrame, pl.DataFrame]] = {}
    timelines: dict[int, dict[str, pl.DataFrame]] = {}

    def prepare(tr, release: bool) -> RankOps:
        """The rank's op tables and event-level tables: from the prepared cache (its events never read), else
        built from its events and cached; ``release`` drops the events afterwards (streaming)."""
        hit = given.get(id(tr))
        key = P.prepared_key(tr, rules, window_regex) if cache and hit is None else None
        hit = hit or P.read_prepared(tr, key)
        if hit is None:
            rops = prepare_rank(tr, rules, window_regex)
            hit = P.Prepared(rops, M.cpu_thread_busy(rops), M.event_census(tr))
            P.write_prepared(tr, key, hit)
            if release:
                tr.release_events()
        per_rank[id(tr)] = (hit.cpu_threads, hit.census)
        if hit.timeline is not None:
            timelines[id(tr)] = hit.timeline
        return hit.rops

    def on_rank(tr) -> None:       # streaming: prepare now, keep the event-level tables, drop the events
        prepared[id(tr)] = prepare(tr, release=True)

    stream = not keep_events and not isinstance(capture, Capture)
    only, subset = (plan_subset(capture, max_capture_gb, profile_id, nodes)
                    if max_capture_gb > 0 and not isinstance(capture, Capture) else (None, pl.DataFrame()))
    cap = capture if isinstance(capture, Capture) else load_capture(capture, cache=cache, cache_dir=cache_dir,
                                                                    profile_id=profile_id, nodes=nodes,
                                                                    workers=workers, events=not cache,
                                                                    on_rank=on_rank if stream else None, only=only)
    clock.lap("load")
    rops = [prepared.pop(id(tr)) if id(tr) in prepared else prepare(tr, release=False) for tr in cap.ranks]
    clock.lap("prepare")
    tls = [timelines.get(id(r.trace)) or rank_timeline(r) for r in rops]
    wm = _concat(tl["window_metrics"] for tl in tls)
    summary = M.summarise_windows(wm) if wm.height else pl.DataFrame()
    gaps = _concat(tl["gaps"].filter(pl.col("gap_ns") > int(min_gap_us * 1e3)) for tl in tls)
    clock.lap("timeline")
    seqs = {r.rank: tl["comm_seq"] for r, tl in zip(rops, tls)}     # made with each rank's timeline
    al = R.align_ranks(rops, seqs=seqs)
    cskew = R.collective_skew(rops, al, seqs) if len(rops) > 1 else pl.DataFrame()
    sskew = R.step_skew(rops, al) if len(rops) > 1 else pl.DataFrame()
    slow = R.slow_rank(cskew, sskew, len(rops)) if len(rops) > 1 else {"slow_rank": None,
                                                                        "evidence": "one rank only"}
    st_steps = S.stage_steps(rops)
    st_table = S.stage_stretches(st_steps)
    stage = S.slow_stage(st_table, st_steps)
    # pipeline stages share no collective and no step end: the stage view names a stage that holds them back
    slow = {**slow, "slow_stage": stage["slow_stage"], "stage_evidence": stage["evidence"],
            "stage": {k: v for k, v in stage.items() if k not in ("slow_stage", "evidence")}}
    clock.lap("ranks")

    def part(name: str) -> list[pl.DataFrame]:      # each rank's share of a cross-rank table, made with its timeline
        return [tl[name] for tl in tls]
    result = CaptureAnalysis(
        capture=cap, rops=rops, window_regex=window_regex, top_n=top_n, ranks=cap.identities(),
        windows=_concat(r.windows for r in rops), window_metrics=wm, summary=summary,
        breakdown=M.breakdown_from(part("breakdown")), top_kernels=M.top_from(part("top"), top_n), gaps=gaps,
        gap_summary=M.gap_summary(gaps), graph=M.graph_from(part("graph")), launch=M.launch_from(part("launch")),
        device_busy=_concat(tl["device_busy"] for tl in tls),
        cpu_threads=_concat(per_rank[id(r.trace)][0] if id(r.trace) in per_rank
                                                   else M.cpu_thread_busy(r) for r in rops),
        alignment=al, collective_skew=cskew, step_skew=sskew, slow_rank=slow,
        pp=R.pp_overlap(rops, al), pp_compute=R.pp_overlap(rops, al, compute_only=True),
        nccl=N.forensics(rops), interference=_concat(tl["interference"] for tl in tls))
    result.census = census(cap, {k: v[1] for k, v in per_rank.items()})
    cbc = _concat(tl["comm_by_collective"] for tl in tls)       # per rank, made with its timeline
    result.comm_by_collective = cbc if cbc.height else M.comm_by_collective([])
    result.stage_steps, result.stages = st_steps, st_table
    result.rank_subset = subset
    clock.lap("tables")
    result.timings_s, result.cpu_s = clock.wall, clock.cpu
    return result


class _Clock:
    """Wall and process CPU time of each step since the previous one (or since made)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._t, self._c = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        t, c = time.perf_counter(), time.process_time()
        self.wall[name], self.cpu[name] = t - self._t, c - self._c
        self._t, self._c = t, c


def rank_timeline(r: RankOps) -> dict[str, pl.DataFrame]:
    """One rank's timeline tables — idle gaps (unfiltered), per-window metrics, device busy, decode
    interference, communication per collective, its collective kernels in order (what the cross-rank matching
    reads) — and its shares of the cross-rank tables (kernel breakdown, top kernels, graph coverage, launch delays),
    which the controller merges exactly: each needs that rank alone, so a cluster worker makes
    them beside the rank's op tables (in parallel, not in the controller one rank after another)."""
    g = M.gap_intervals(r)
    return {"gaps": g, "window_metrics": E.window_metrics(r, g), "device_busy": M.device_busy(r),
            "interference": M.decode_interference(r), "comm_by_collective": M.comm_by_collective([r]),
            "comm_seq": R.comm_seq(r),
            # its shares of the cross-rank tables, merged exactly over ranks by the controller (metrics.*_from)
            "breakdown": M.breakdown_part(r), "top": M.top_part(r), "graph": M.graph_part(r),
            "launch": M.launch_part(r)}


def census(cap: Capture, done: dict[int, pl.DataFrame] | None = None) -> pl.DataFrame:
    """Event census per rank: events and total duration (ms) per (phase type, Kineto category) — what the
    trace holds before any interpretation (a census: read it before trusting any derived number). ``done``: ranks
    already counted while
    streaming (keyed by ``id(trace)``)."""
    done = done or {}
    parts = [done[id(t)] if id(t) in done else M.event_census(t) for t in cap.ranks]
    # ties broken by name: the order of categorical codes (how the per-rank counts come out) is per process
    return (_concat(parts).sort("rank", "events", "ph", "cat", descending=[False, True, False, False])
            .select("rank", "ph", "cat", "events", "total_ms"))


def write_tables(a: CaptureAnalysis, out_dir: str | Path, extra: dict[str, pl.DataFrame] | None = None,
                 only_extra: bool = False) -> dict[str, str]:
    """Write the key tables as CSV (and the small ones also as JSON) into ``out_dir``; returns name → path.

    Files: ranks, windows, window_metrics, summary, kernel_breakdown, top_kernels, gap_summary,
    graph_coverage, launch, alignment, collective_skew, step_skew, pp_overlap, nccl_forensics, interference,
    stage_steps and stages (the per-stage view, empty without two PP stages),
    plus ``extra`` (e.g. questions, actions) and ``trace_analysis.json`` (headline numbers, slow rank,
    alignment notes, timings). ``only_extra``: write only ``extra`` (a table replaced after the first write)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = {
        "ranks": a.ranks, "windows": a.window_metrics, "summary": a.summary, "kernel_breakdown": a.breakdown,
        "top_kernels": a.top_kernels, "gap_summary": a.gap_summary, "graph_coverage": a.graph, "launch": a.launch,
        "device_busy": a.device_busy, "alignment": a.alignment.table, "collective_skew": a.collective_skew,
        "step_skew": a.step_skew, "pp_overlap": _concat([a.pp, a.pp_compute]), "nccl_forensics": a.nccl,
        "interference": a.interference, "overlap": a.overlap_table(), "census": a.census,
        "comm_by_collective": a.comm_by_collective, "stage_steps": a.stage_steps, "stages": a.stages,
        **({"rank_subset": a.rank_subset} if a.rank_subset.height else {}),
    }
    tables = dict(extra or {}) if only_extra else {**tables, **(extra or {})}
    paths = {}
    for name, df in tables.items():
        if df is None:
            continue
        p = out / f"trace_{name}.csv"
        _csv_safe(df).write_csv(p)
        paths[name] = str(p)
        if df.height <= 2000:
            pj = out / f"trace_{name}.json"
            pj.write_text(json.dumps(_csv_safe(df).to_dicts(), default=str, indent=1))
    if only_extra:
        return paths
    summary = {
        "trace_dir": str(a.capture.trace_dir), "trace_files": a.trace_files, "ranks": len(a.rops),
        "window_regex": a.window_regex, "slow_rank": a.slow_rank,
        "truncated": {r.trace.path.name: {**r.trace.meta["truncated"], "steps_read": r.steps_read,
                                          "steps_seen": r.windows.height}
                      for r in a.rops if r.trace.meta.get("truncated")},
        "alignment": {"ok": a.alignment.alignment_ok, "residual_us": a.alignment.residual_us,
                      "notes": a.alignment.notes},
        "timings_s": a.timings_s, "cpu_s": a.cpu_s,
    }
    (out / "trace_analysis.json").write_text(json.dumps(summary, default=str, indent=1))
    paths["analysis"] = str(out / "trace_analysis.json")
    return paths


def _csv_safe(df: pl.DataFrame) -> pl.DataFrame:
    """Nested / object columns as text so CSV and JSON writers accept them."""
    casts = [pl.col(c).cast(pl.String) for c, t in df.schema.items()
             if isinstance(t, (pl.List, pl.Struct, pl.Object, pl.Categorical, pl.Enum))]
    return df.with_columns(casts) if casts else df
