"""Phase 8's measurement: the prefix-cache hit-rate points, each on a cache that holds nothing of the previous one.

:func:`measure_hit_point` runs one point (:class:`HitPoint`) through :class:`servelab.measure.case_runner.CaseRun`
— the workload (``groups`` shared prefixes of ``round(rate · ISL)`` tokens, ``workload.build_workload``), each
group's prefix pre-warmed once, the counter window, then every group's requests one after another, the groups
concurrently (:func:`run_streams`) — and returns what it recorded (:class:`RawHitPoint`) with the case still open:
the phase judges it (the matrix row and the case summary are :mod:`servelab.analyse.prefix_cache`'s) and closes the
case. :func:`measure_points` runs every point, the engine restarted before each where it has no flush endpoint
(llama.cpp), else one engine flushed before each, the judging step a callable the phase hands in.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import pandas as pd

from servelab.core.scope import RunScope
from servelab.deploy.engines import engine_for
from servelab.deploy.server import RunningServer
from servelab.measure import request_metrics as mx
from servelab.measure.case import case_seed
from servelab.measure.case_runner import CaseRun, flush_cache, head_log
from servelab.measure.client import ClientConfig, run_async, run_sync
from servelab.measure.launch_variants import Snapshot, serving
from servelab.measure.loop_monitor import LoopMonitor
from servelab.measure.records import ClientRun, RequestRecord
from servelab.measure.workload import RequestSpec, build_workload, engine_tokenizer, token_pool

PURPOSES = {0.0: "pure compute baseline", 0.2: "low-reuse traffic", 0.5: "medium shared prefix",
            0.8: "agent / coding, high reuse"}

# how long a freshly started engine (one per point where it has no flush endpoint) may take to answer its health check
HEALTH_TIMEOUT_S = 300.0

T = TypeVar("T")


@dataclass
class HitPoint:
    """One point of the matrix: target hit rate, lengths, and the stream layout."""
    target_rate: float
    input_tokens: int
    output_tokens: int
    groups: int                        # concurrent streams; one shared prefix per stream (when rate > 0)
    requests_per_group: int
    cache_prompt: bool = True          # llama.cpp request flag; False = a deliberately bad point (no reuse)
    prewarm: bool = True
    label: str = ""

    @property
    def case_id(self) -> str:
        return self.label or f"H8_hit{round(self.target_rate * 100):02d}"

    @property
    def prefix_tokens(self) -> int:
        return int(round(self.target_rate * self.input_tokens)) if self.target_rate > 0 else 0

    @property
    def purpose(self) -> str:
        return PURPOSES.get(round(self.target_rate, 2), "")


def run_streams(streams: list[list[RequestSpec]], cfg: ClientConfig) -> ClientRun:
    """Every stream's requests one after another, the streams concurrently; one ClientRun over all of them, with
    the samples of the loop's one loop-lag monitor (``measure.loop_monitor``; not one per request in flight:
    docs/metrics.md#integrity) — what the point's integrity record judges."""
    async def stream(specs: list[RequestSpec]) -> list[RequestRecord]:
        out: list[RequestRecord] = []
        for spec in specs:
            out += (await run_async([spec], cfg, concurrency=1, monitor_interval_s=None)).records
        return out

    async def go() -> tuple[list[RequestRecord], LoopMonitor]:
        async with LoopMonitor() as mon:
            recs = await asyncio.gather(*(stream(s) for s in streams))
        return [r for rs in recs for r in rs], mon

    records, mon = run_sync(go)
    return mon.client_run(records, concurrency=len(streams),
                          wall_offset_ns=records[0].wall_offset_ns if records else 0)


# ---------------------------------------------------------------- one point

@dataclass
class RawHitPoint:
    """What one point recorded, before it is judged: the case (still open: the judge closes it with its summary),
    the point, the metric definition, the records (pre-warm and measured), the measured streams' client run (None
    when the block failed before it), the counter window's snapshots, the ``/slots`` and ``/metrics`` series, the
    clock at the point's start (``perf_counter_ns``), how the cache was emptied before it and the error the block
    recorded ("" when none)."""
    case: CaseRun
    point: HitPoint
    definition: str
    records: list[RequestRecord]
    run: ClientRun | None
    before: Snapshot | None
    after: Snapshot | None
    slots: pd.DataFrame
    scrape: pd.DataFrame
    t0_ns: int
    flush: dict[str, Any]
    error: str

    @property
    def status(self) -> str:
        """The case's status: ``success``, or ``failed`` where the block recorded an error."""
        return "success" if not self.error else "failed"


def measure_hit_point(srv: RunningServer, run_dir: Path, point: HitPoint, pool: list[int], seed: int = 0,
                      definition: str = mx.VLLM_BENCH, flush: dict[str, Any] | None = None,
                      poll_interval_s: float = 0.1, phase: str = "phase8") -> RawHitPoint:
    """One hit-rate point on a freshly flushed engine: pre-warm, measure; the raw data written, the case left open.

    Files: ``cases/<case_id>/{meta.json, requests.jsonl, server/metrics_{before,after}.prom, server/slots.parquet,
    server/metrics.parquet}``, written through the case contract (:class:`servelab.measure.case_runner.CaseRun`);
    ``summary.json`` when the judge closes the case.
    """
    engine = srv.target.engine
    n = point.groups * point.requests_per_group
    groups = point.groups if point.prefix_tokens else 0
    wl = build_workload(point.case_id, n, point.input_tokens, point.output_tokens, pool,
                        seed=case_seed(seed, point.case_id, 0), prefix_groups=groups,
                        target_prefix_hit_rate=point.target_rate if groups else 0.0)
    case = CaseRun(srv, run_dir, point.case_id, phase, "prefix_cache", {
        "point": asdict(point), "engine": engine, "base_url": srv.base_url, "prefix_tokens": point.prefix_tokens,
        "workload_notes": wl.notes, "flush": flush or {}, "definition": definition}, definition=definition)
    # group g's requests in order (request i belongs to group i % G)
    streams = [[r for r in wl.requests if (r.index % point.groups) == g] for g in range(point.groups)]
    extra: dict[str, Any] = {}
    if srv.engine.request_cache_switch:        # the per-request prefix-reuse flag, where the engine has one
        extra[srv.engine.request_cache_switch] = bool(point.cache_prompt)
    run: ClientRun | None = None
    t0 = time.perf_counter_ns()
    with case:
        cfg = case.client_config(extra_body=extra)
        case.watch(scrape_interval_s=max(poll_interval_s, 0.25), poll_interval_s=poll_interval_s)
        if point.prewarm and groups:       # each group's prefix once: the cache holds it before the window
            warm = [RequestSpec(index=10**6 + g, input_tokens=point.prefix_tokens, output_tokens=1,
                                prompt_ids=list(streams[g][0].prompt_ids[:point.prefix_tokens]), group=g,
                                shared_prefix_tokens=point.prefix_tokens, role="prewarm")
                    for g in range(point.groups)]
            case.add(run_streams([[w] for w in warm], cfg).records)
        case.open_window()
        run = run_streams(streams, cfg)
        case.add(run.records)
    return RawHitPoint(case, point, definition, case.records, run, case.before, case.after, case.slots, case.scrape,
                       t0, flush or {}, case.error)


# ---------------------------------------------------------------- every point, on an emptied cache

@dataclass
class MeasuredPoints(Generic[T]):
    """What the points measured: each point as the judge returned it, and the first engine's log as it stood once
    the engine was up (its start-up lines: the memory breakdown; None when no engine started)."""
    results: list[T] = field(default_factory=list)
    startup_log: str | None = None


def measure_points(scope: RunScope, served: Any, points: list[HitPoint], judge: Callable[[RawHitPoint], T],
                   seed: int = 0, definition: str = mx.VLLM_BENCH) -> MeasuredPoints[T]:
    """Every point on a cache that holds nothing of the previous one, each judged (``judge``) as soon as it is
    measured: the engine restarted before each point where it has no flush endpoint (llama.cpp), else one engine
    flushed before each point. The engines' logs go to ``<phase_dir>/server``."""
    out: MeasuredPoints[T] = MeasuredPoints()
    log_dir = scope.phase_dir / "server"
    if engine_for(served.engine).flush_cache_path is None:
        for i, pt in enumerate(points):
            with serving(served, log_dir, scope.run_dir, scope.phase, HEALTH_TIMEOUT_S) as srv:
                if i == 0:
                    out.startup_log = head_log_text(srv)
                out.results.append(judge(_measure_on(scope, srv, pt, seed, definition, {
                    "method": "engine restarted before the point", "flushed": True,
                    "reason": f"{srv.target.engine} has no cache flush endpoint"})))
    else:
        with serving(served, log_dir, scope.run_dir, scope.phase, HEALTH_TIMEOUT_S) as srv:
            out.startup_log = head_log_text(srv)
            for pt in points:
                out.results.append(judge(_measure_on(scope, srv, pt, seed, definition, flush_cache(srv))))
    return out


def _measure_on(scope: RunScope, srv: RunningServer, pt: HitPoint, seed: int, definition: str,
                flush: dict[str, Any]) -> RawHitPoint:
    """One point on ``srv`` (``flush``: how its cache was emptied), with the engine's own tokens."""
    pool = token_pool(engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path,
                                       headers=srv.auth_headers), seed=seed)
    return measure_hit_point(srv, scope.run_dir, pt, pool, seed, definition, flush, phase=scope.phase)


def head_log_text(srv: RunningServer) -> str:
    """The head node's engine log as it stands now, read from this machine's file system ("" when there is none or
    it cannot be read)."""
    _, path = head_log(srv)
    try:
        return Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return ""
