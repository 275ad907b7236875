"""Phase 8 — memory and caches: KV usage over time, memory breakdown, the prefix-cache hit-rate matrix.

**KV usage over time.** vLLM (``vllm:kv_cache_usage_perc``) and SGLang (``sglang:token_usage``) expose a KV
gauge, scraped from ``/metrics`` during every point. llama.cpp has no KV gauge: its ``/slots`` endpoint gives,
per slot, ``n_ctx`` and the tokens the slot's KV holds (``n_prompt_tokens`` = prompt + generated so far, also
for an idle slot that keeps its last prompt for reuse). :class:`SlotsPoller` samples it; *active* usage counts
the processing slots, *held* usage every slot (idle slots keep their cached prompt). Both are token counts over
the slots' capacity, not allocator bytes — the page says so.

**Memory breakdown.** From the engine's startup log: llama.cpp at ``-lv 4`` prints its memory breakdown
(model / context / compute MiB), the model buffers, the KV cache size per layer group and K/V dtype, the output
and compute buffers; SGLang and vLLM through the adapter's ``weights_loaded`` / ``kv_allocated`` /
``cuda_graph`` markers. Nothing found is shown as not exposed.

**Prefix-cache hit-rate matrix** (seeds §13: 0 % pure compute baseline, 20 % low reuse, 50 % shared prefix,
80 % agent/coding). SGLang's ``generated-shared-prefix`` layout with SG-PC's discipline
(``../shared/research/bench_clients.md`` §3): each point uses ``groups`` shared prefixes of
``round(rate · ISL)`` random token ids followed by a unique head and random ids (``workload.build_workload``);
the cache is flushed before the point (llama.cpp has no flush endpoint: the engine is restarted), each group's
prefix is pre-warmed once, then every group sends its requests one after another, the groups concurrently (a
group's next request finds its prefix in the slot its previous one used — llama.cpp keeps one prompt per slot).
The achieved hit rate is measured twice, over the exact measurement window:

- server counters — llama.cpp ``Δprompt_tokens_cached_total / (Δprompt_tokens_total +
  Δprompt_tokens_cached_total)`` (its ``prompt_tokens_total`` *excludes* cached tokens, per its own HELP text),
  vLLM ``Δprefix_cache_hits_total / Δprefix_cache_queries_total``, SGLang ``Δcached_tokens_total /
  Δprompt_tokens_total``;
- per request — ``Σ usage.prompt_tokens_details.cached_tokens / Σ usage.prompt_tokens``.

A point whose achieved rate (either source) misses the target by more than ``max(0.5 pp, page_size / ISL)`` is
**REJECTED**: shown with its reason, never used as a result (no TTFT/throughput comparison uses it).
"""
from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from servelab.measure import request_metrics as mx
from servelab.measure.client import ClientConfig, ClientRun, RequestRecord, run_async, run_sync
from servelab.measure.launch_variants import Snapshot, delta_of, metrics_snapshot, snapshot_deltas
from servelab.core.run import write_json_atomic
from servelab.target.server import RunningServer, http_json
from servelab.measure.workload import RequestSpec, build_workload

TARGET_RATES = (0.0, 0.2, 0.5, 0.8)
PURPOSES = {0.0: "pure compute baseline", 0.2: "low-reuse traffic", 0.5: "medium shared prefix",
            0.8: "agent / coding, high reuse"}
MIN_TOLERANCE = 0.005                  # 0.5 percentage points (SG-PC)
DEFAULT_PAGE_TOKENS = {"llamacpp": 1, "vllm": 16, "sglang": 1}


# ---------------------------------------------------------------- llama.cpp /slots sampling

@dataclass
class SlotsPoller:
    """Poll llama.cpp ``GET /slots`` every ``interval_s`` in a thread; one row per slot and sample.

    Columns: ``ts_ns`` (perf_counter), ``slot``, ``n_ctx``, ``is_processing``, ``id_task``, ``n_prompt_tokens``
    (tokens the slot's KV holds: prompt + generated so far), ``n_prompt_tokens_processed``,
    ``n_prompt_tokens_cache``, ``n_decoded``, ``n_predict``. A failed poll is a row in ``errors``, never a zero.
    """
    base_url: str
    interval_s: float = 0.1
    timeout_s: float = 2.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        t = time.perf_counter_ns()
        status, body = http_json(self.base_url + "/slots", timeout=self.timeout_s)
        if status != 200 or not isinstance(body, list):
            self.errors.append({"ts_ns": t, "status": status, "error": str(body)[:200]})
            return False
        for s in body:
            nt = (s.get("next_token") or [{}])[0] if isinstance(s.get("next_token"), list) else {}
            self.rows.append({"ts_ns": t, "slot": s.get("id"), "n_ctx": s.get("n_ctx"),
                              "is_processing": bool(s.get("is_processing")), "id_task": s.get("id_task"),
                              "n_prompt_tokens": s.get("n_prompt_tokens", 0),
                              "n_prompt_tokens_processed": s.get("n_prompt_tokens_processed"),
                              "n_prompt_tokens_cache": s.get("n_prompt_tokens_cache"),
                              "n_decoded": nt.get("n_decoded"),
                              "n_predict": (s.get("params") or {}).get("n_predict")})
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.poll_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def start(self) -> "SlotsPoller":
        self._thread = threading.Thread(target=self._loop, name="servelab-slots-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> pd.DataFrame:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self.interval_s + 1)
        self.poll_once()
        return self.frame()

    def frame(self) -> pd.DataFrame:
        cols = ["ts_ns", "slot", "n_ctx", "is_processing", "id_task", "n_prompt_tokens", "n_prompt_tokens_processed",
                "n_prompt_tokens_cache", "n_decoded", "n_predict"]
        return pd.DataFrame(self.rows, columns=cols)


def has_slots_endpoint(srv: RunningServer) -> bool:
    return srv.target.engine == "llamacpp"


# ---------------------------------------------------------------- KV usage over time

def kv_usage_series(slots: pd.DataFrame | None, scrape: pd.DataFrame | None, engine: str,
                    metric_names: dict[str, str], t0_ns: int, label: str = "") -> pd.DataFrame:
    """KV usage over time as ``t_s, metric, value, source, point`` rows (value: fraction 0–1).

    llama.cpp: ``kv_active`` (tokens of processing slots / total slot capacity) and ``kv_held`` (all slots,
    idle ones keep their last prompt) from ``/slots``; others: the engine's KV gauge from ``/metrics``.
    """
    rows: list[pd.DataFrame] = []
    if engine == "llamacpp" and slots is not None and not slots.empty:
        g = slots.groupby("ts_ns")
        cap = g["n_ctx"].sum()
        active = slots[slots["is_processing"]].groupby("ts_ns")["n_prompt_tokens"].sum().reindex(cap.index,
                                                                                                fill_value=0)
        held = g["n_prompt_tokens"].sum()
        for name, s in (("kv_active", active / cap), ("kv_held", held / cap)):
            rows.append(pd.DataFrame({"t_s": (s.index.to_numpy() - t0_ns) / 1e9, "metric": name,
                                      "value": s.to_numpy(dtype=float),
                                      "source": "llama.cpp /slots token counts (no KV gauge exposed)"}))
    elif scrape is not None and not scrape.empty and metric_names.get("kv_usage"):
        series = metric_names["kv_usage"]
        s = scrape[scrape["name"] == series].groupby("ts_ns")["value"].sum()
        if not s.empty:
            rows.append(pd.DataFrame({"t_s": (s.index.to_numpy() - t0_ns) / 1e9, "metric": "kv_usage",
                                      "value": s.to_numpy(dtype=float), "source": f"{series} (/metrics gauge)"}))
    if not rows:
        return pd.DataFrame(columns=["t_s", "metric", "value", "source", "point"])
    out = pd.concat(rows, ignore_index=True)
    out["point"] = label
    return out


# ---------------------------------------------------------------- memory breakdown from the startup log

_LLAMA_MEM = [
    ("breakdown (model + context + compute)",
     re.compile(r"memory_breakdown_print: \|\s+-\s+(?P<dev>\S+)\s+\|\s+(?P<total>\d+) = +(?P<model>\d+) \+ +"
                r"(?P<context>\d+) \+ +(?P<compute>\d+)")),
    ("model buffer", re.compile(r"load_tensors:\s+(?P<dev>\S+) model buffer size = +(?P<mib>[\d.]+) MiB")),
    ("KV cache", re.compile(r"llama_kv_cache: size = +(?P<mib>[\d.]+) MiB \( *(?P<cells>\d+) cells, +(?P<layers>\d+) "
                            r"layers, +(?P<seqs>[\d/]+) seqs\), K \((?P<kdt>\w+)\): +(?P<k>[\d.]+) MiB, "
                            r"V \((?P<vdt>\w+)\): +(?P<v>[\d.]+) MiB")),
    ("output buffer", re.compile(r"llama_context: +(?P<dev>\S+) +output buffer size = +(?P<mib>[\d.]+) MiB")),
    ("compute buffer", re.compile(r"(?:sched_reserve|llama_context): +(?P<dev>\S+) compute buffer size = +"
                                  r"(?P<mib>[\d.]+) MiB")),
]


def memory_breakdown(log_text: str, engine: str, log_markers: dict[str, str] | None = None) -> pd.DataFrame:
    """Memory components the engine printed at startup: ``component, device, mib, detail, line``.

    Empty components are listed as ``not exposed`` (llama.cpp needs ``-lv 4`` for these lines).
    """
    rows: list[dict[str, Any]] = []
    if engine == "llamacpp":
        for comp, rx in _LLAMA_MEM:
            for line in log_text.splitlines():
                m = rx.search(line)
                if not m:
                    continue
                d = m.groupdict()
                if comp.startswith("breakdown"):
                    for part in ("model", "context", "compute"):
                        rows.append({"component": f"{part} (breakdown)", "device": d["dev"], "mib": float(d[part]),
                                     "detail": f"total {d['total']} MiB", "line": line.strip()[-200:]})
                    continue
                detail = ""
                if comp == "KV cache":
                    detail = (f"{d['cells']} cells per sequence, {d['layers']} layers, {d['seqs']} seqs, "
                              f"K {d['kdt']} {d['k']} MiB, V {d['vdt']} {d['v']} MiB")
                rows.append({"component": comp, "device": d.get("dev", "-"), "mib": float(d["mib"]),
                             "detail": detail, "line": line.strip()[-200:]})
    else:
        for key, comp, unit in (("weights_loaded", "weights", "mem_gb"), ("kv_allocated", "KV cache", "tokens"),
                                ("cuda_graph", "CUDA graphs", "mem_gb")):
            rx = (log_markers or {}).get(key)
            if not rx:
                continue
            for line in log_text.splitlines():
                m = re.search(rx, line)
                if m:
                    v = m.groupdict().get(unit)
                    rows.append({"component": comp, "device": "-",
                                 "mib": float(v) * 1024 if unit == "mem_gb" and v else None,
                                 "detail": f"{unit}={v}", "line": line.strip()[-200:]})
    if not rows:
        return pd.DataFrame([{"component": "all", "device": "-", "mib": None,
                              "detail": "not exposed in the engine log" +
                                        (" (llama.cpp prints it at -lv 4)" if engine == "llamacpp" else ""),
                              "line": ""}])
    return pd.DataFrame(rows).drop_duplicates(subset=["component", "device", "mib", "detail"]).reset_index(drop=True)


# ---------------------------------------------------------------- hit-rate points

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


def tolerance(page_tokens: int, input_tokens: int) -> float:
    """SG-PC's rejection bound: ``max(0.5 pp, page_size / ISL)`` as a fraction."""
    return max(MIN_TOLERANCE, page_tokens / max(input_tokens, 1))


def page_tokens(target: Any) -> int:
    """Cache granularity in tokens: ``launch.page_size`` where set, else the engine's default."""
    la = target.launch or {}
    return int(la.get("page_size") or la.get("block_size") or DEFAULT_PAGE_TOKENS.get(target.engine, 1))


def counter_hit_rate(engine: str, deltas: pd.DataFrame, metric_names: dict[str, str]) -> dict[str, Any]:
    """Achieved hit rate from counter deltas (see the module docstring for each engine's formula)."""
    if engine == "llamacpp":
        cached = delta_of(deltas, metric_names["cached_tokens_total"])
        computed = delta_of(deltas, metric_names["prompt_tokens_total"])
        total = cached + computed if cached is not None and computed is not None else None
        formula = "Δprompt_tokens_cached / (Δprompt_tokens + Δprompt_tokens_cached)"
    elif engine == "vllm":
        cached = delta_of(deltas, metric_names["prefix_cache_hits_total"])
        total = delta_of(deltas, metric_names["prefix_cache_queries_total"])
        formula = "Δprefix_cache_hits / Δprefix_cache_queries"
    else:
        cached = delta_of(deltas, metric_names["cached_tokens_total"])
        total = delta_of(deltas, metric_names["prompt_tokens_total"])
        formula = "Δcached_tokens / Δprompt_tokens"
    rate = cached / total if cached is not None and total else None
    return {"counter_cached_tokens": cached, "counter_prompt_tokens": total, "counter_hit_rate": rate,
            "counter_formula": formula}


def usage_hit_rate(records: list[RequestRecord]) -> dict[str, Any]:
    """Σ cached_tokens / Σ prompt_tokens of the measured requests' usage; None when the server gave none."""
    ok = [r for r in records if r.ok and r.role == "measure"]
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens is not None]
    if not reported:
        return {"usage_cached_tokens": None, "usage_prompt_tokens": None, "usage_hit_rate": None,
                "usage_reported": 0}
    c = sum(int(r.cached_tokens) for r in reported)
    p = sum(int(r.prompt_tokens) for r in reported)
    return {"usage_cached_tokens": c, "usage_prompt_tokens": p, "usage_hit_rate": c / p if p else None,
            "usage_reported": len(reported)}


def judge_point(target_rate: float, counter_rate: float | None, usage_rate: float | None, tol: float,
                usage_reported: int, measured: int) -> tuple[str, list[str]]:
    """ACCEPTED or REJECTED with reasons: each available source must lie within ``tol`` of the target."""
    reasons = []
    if counter_rate is None:
        reasons.append("server counters give no hit rate (counters absent or no prompt tokens in the window)")
    elif abs(counter_rate - target_rate) > tol:
        reasons.append(f"counter hit rate {counter_rate:.2%} misses the target {target_rate:.0%} by "
                       f"{abs(counter_rate - target_rate) * 100:.2f} pp > {tol * 100:.2f} pp")
    if usage_rate is not None:
        if abs(usage_rate - target_rate) > tol:
            reasons.append(f"per-request hit rate {usage_rate:.2%} misses the target {target_rate:.0%} by "
                           f"{abs(usage_rate - target_rate) * 100:.2f} pp > {tol * 100:.2f} pp")
        if usage_reported < measured:
            reasons.append(f"only {usage_reported} of {measured} requests reported cached tokens")
    elif measured:
        reasons.append("no request reported usage.prompt_tokens_details.cached_tokens (second source missing)")
    return ("REJECTED" if reasons else "ACCEPTED"), reasons


def run_streams(streams: list[list[RequestSpec]], cfg: ClientConfig) -> ClientRun:
    """Every stream's requests one after another, the streams concurrently; one ClientRun over all of them."""
    async def go() -> list[ClientRun]:
        return list(await asyncio.gather(*(run_async(s, cfg, concurrency=1) for s in streams)))
    runs = run_sync(go)
    records = [r for run in runs for r in run.records]
    return ClientRun(records, min(r.window_start_ns for r in runs), max(r.window_end_ns for r in runs),
                     runs[0].wall_offset_ns, "closed", len(streams), None, sum(r.client_cpu_s for r in runs))


@dataclass
class PointResult:
    point: HitPoint
    case_dir: Path
    row: dict[str, Any]                      # one row of the matrix table
    records: list[RequestRecord]
    slots: pd.DataFrame
    scrape: pd.DataFrame
    t0_ns: int
    flush: dict[str, Any] = field(default_factory=dict)


def run_hit_point(srv: RunningServer, run_dir: Path, point: HitPoint, pool: list[int], seed: int = 0,
                  definition: str = "vllm", flush: dict[str, Any] | None = None,
                  poll_interval_s: float = 0.1, phase: str = "phase8") -> PointResult:
    """Run one hit-rate point on a freshly flushed engine: pre-warm, measure, judge; raw data written first.

    Files: ``cases/<case_id>/{meta.json, requests.jsonl, server/metrics_{before,after}.prom, server/slots.parquet,
    server/metrics.parquet, summary.json}``, written through the case contract
    (:class:`servelab.measure.case_record.CaseFolder`); ACCEPTED is the summary's VALID, REJECTED its INVALID.
    """
    from servelab.measure.case import case_seed
    from servelab.measure.case_record import CaseFolder
    from servelab.measure.engine_metrics import Scraper
    engine = srv.target.engine
    n = point.groups * point.requests_per_group
    groups = point.groups if point.prefix_tokens else 0
    wl = build_workload(point.case_id, n, point.input_tokens, point.output_tokens, pool,
                        seed=case_seed(seed, point.case_id, 0), prefix_groups=groups,
                        target_prefix_hit_rate=point.target_rate if groups else 0.0)
    folder = CaseFolder(run_dir, point.case_id, phase, "prefix_cache", {
        "point": asdict(point), "engine": engine, "base_url": srv.base_url, "prefix_tokens": point.prefix_tokens,
        "workload_notes": wl.notes, "flush": flush or {}, "definition": definition})
    cdir = folder.dir
    # group g's requests in order (request i belongs to group i % G)
    streams = [[r for r in wl.requests if (r.index % point.groups) == g] for g in range(point.groups)]
    extra: dict[str, Any] = {}
    if engine == "llamacpp":
        extra["cache_prompt"] = bool(point.cache_prompt)
    cfg = ClientConfig(srv.base_url, srv.target.served_model_name or "default", engine=engine, extra_body=extra,
                       request_id_prefix=f"{Path(run_dir).name}-{point.case_id}")
    poller = SlotsPoller(srv.base_url, interval_s=poll_interval_s) if has_slots_endpoint(srv) else None
    scraper = Scraper(srv.base_url + srv.engine.metrics_path, interval_s=max(poll_interval_s, 0.25))
    t0 = time.perf_counter_ns()
    if poller is not None:
        poller.start()
    scraper.start()
    records: list[RequestRecord] = []
    error = ""
    before = after = None
    run: ClientRun | None = None
    try:
        if point.prewarm and groups:
            warm = [RequestSpec(index=10**6 + g, input_tokens=point.prefix_tokens, output_tokens=1,
                                prompt_ids=list(streams[g][0].prompt_ids[:point.prefix_tokens]), group=g,
                                shared_prefix_tokens=point.prefix_tokens, role="prewarm")
                    for g in range(point.groups)]
            wrun = run_streams([[w] for w in warm], cfg)
            records += wrun.records
        before = metrics_snapshot(srv)
        run = run_streams(streams, cfg)
        records += run.records
        after = metrics_snapshot(srv)
    except Exception as exc:  # recorded; the point is rejected below
        error = f"{type(exc).__name__}: {exc}"
    finally:
        slots = poller.stop() if poller is not None else pd.DataFrame()
        scrape = scraper.stop()
    # raw data first
    folder.write_requests(records)
    folder.write_metrics(scrape, before, after)
    if not slots.empty:
        slots.to_parquet(cdir / "server" / "slots.parquet")
    row = point_row(point, srv, records, run, before, after, definition, error)
    status = "success" if not error else "failed"
    folder.write_summary(hit_point_summary(point, row, records, run, status, definition))
    folder.finish(status, error)
    return PointResult(point, cdir, row, records, slots, scrape, t0, flush or {})


def hit_point_summary(point: HitPoint, row: dict[str, Any], records: list[RequestRecord], run: ClientRun | None,
                      status: str, definition: str) -> Any:
    """The case summary of a hit-rate point: the verdict (ACCEPTED → VALID, REJECTED → INVALID, with the
    row's reasons), the measured requests' metrics as the one repeat, the matrix row in ``details``."""
    from servelab.measure.case_record import INVALID, VALID, CaseSummary, request_counts, verdict
    measured = [r for r in records if r.role == "measure"]
    pooled = {definition: mx.summarize(measured, max(run.duration_s, 1e-9), definition)} if run and measured else {}
    reasons = [x for x in str(row.get("reasons") or "").split("; ") if x]
    ok = row.get("verdict") == "ACCEPTED" and status == "success"
    if not ok and not reasons:
        reasons = [f"case status {status}"]
    return CaseSummary(
        case_id=point.case_id, phase="", kind="prefix_cache", status=status,
        verdict=verdict(VALID if ok else INVALID, [] if ok else reasons), definition=definition, metrics=pooled,
        repeats=[{"repeat": 0, "metrics": pooled}] if pooled else [], counts=request_counts(records),
        details={"point": asdict(point), "row": {k: v for k, v in row.items() if k not in ("verdict", "reasons")}})


def point_row(point: HitPoint, srv: RunningServer, records: list[RequestRecord], run: ClientRun | None,
              before: Snapshot | None, after: Snapshot | None, definition: str, error: str = "") -> dict[str, Any]:
    """The matrix row of a point: target, achieved (both sources), tolerance, verdict, TTFT and throughput."""
    tol = tolerance(page_tokens(srv.target), point.input_tokens)
    row: dict[str, Any] = {"case_id": point.case_id, "target_rate": point.target_rate, "purpose": point.purpose,
                           "input_tokens": point.input_tokens, "output_tokens": point.output_tokens,
                           "prefix_tokens": point.prefix_tokens, "groups": point.groups,
                           "requests": point.groups * point.requests_per_group, "cache_prompt": point.cache_prompt,
                           "tolerance_pp": tol * 100, "page_tokens": page_tokens(srv.target)}
    measured = [r for r in records if r.role == "measure"]
    counters: dict[str, Any] = {"counter_cached_tokens": None, "counter_prompt_tokens": None,
                                "counter_hit_rate": None, "counter_formula": ""}
    window_check = None
    if before is not None and after is not None and before.ok and after.ok:
        deltas = snapshot_deltas(before, after)
        counters = counter_hit_rate(srv.target.engine, deltas, srv.engine.metric_names)
        if counters["counter_prompt_tokens"] is not None:
            window_check = int(counters["counter_prompt_tokens"]) == sum(int(r.prompt_tokens or 0)
                                                                          for r in measured if r.ok)
    usage = usage_hit_rate(records)
    row.update(counters)
    row.update(usage)
    row["counter_window_matches_requests"] = window_check
    expected = point.prefix_tokens / point.input_tokens
    row["expected_rate"] = expected
    verdict, reasons = judge_point(point.target_rate, counters["counter_hit_rate"], usage["usage_hit_rate"], tol,
                                   usage["usage_reported"], sum(r.ok for r in measured))
    if error:
        verdict, reasons = "REJECTED", [f"error: {error}", *reasons]
    if run is not None and measured:
        s = mx.summarize(measured, max(run.duration_s, 1e-9), definition)
        tc = s["token_check"]
        if tc["mismatches"]:
            verdict = "REJECTED"
            reasons.append(f"achieved tokens off target in {tc['mismatches']} of {tc['checked']} requests")
        if s["failed"]:
            verdict = "REJECTED"
            reasons.append(f"{s['failed']} request(s) failed: {s['errors_by_kind']}")
        row.update({"duration_s": run.duration_s, "completed": s["completed"], "failed": s["failed"],
                    "p50_ttft_ms": s["p50_ttft_ms"], "p95_ttft_ms": s["p95_ttft_ms"], "p50_tpot_ms": s["p50_tpot_ms"],
                    "input_throughput": s["input_throughput"], "output_throughput": s["output_throughput"],
                    "total_token_throughput": s["total_token_throughput"]})
        cached = row.get("counter_cached_tokens")
        if cached is not None and row.get("counter_prompt_tokens") is not None:
            row["computed_prefill_tok_s"] = (row["counter_prompt_tokens"] - cached) / max(run.duration_s, 1e-9)
    row["verdict"], row["reasons"] = verdict, "; ".join(reasons)
    row["definition"] = definition
    return row


def matrix_frame(points: list[PointResult]) -> pd.DataFrame:
    """One row per point (both achieved rates, tolerance, verdict, TTFT and throughput)."""
    cols = ["case_id", "target_rate", "purpose", "verdict", "counter_hit_rate", "usage_hit_rate", "expected_rate",
            "tolerance_pp", "prefix_tokens", "input_tokens", "output_tokens", "groups", "requests", "cache_prompt",
            "p50_ttft_ms", "p95_ttft_ms", "p50_tpot_ms", "input_throughput", "output_throughput",
            "computed_prefill_tok_s", "counter_cached_tokens", "counter_prompt_tokens", "usage_cached_tokens",
            "usage_prompt_tokens", "counter_window_matches_requests", "counter_formula", "page_tokens", "definition",
            "reasons"]
    df = pd.DataFrame([p.row for p in points])
    for c in cols:
        if c not in df.columns:
            df[c] = None
    return df[cols]


def matrix_view(res: "Phase8Result") -> pd.DataFrame:
    """The matrix's deciding columns (the full table is ``phase8/hit_rate_matrix.csv``)."""
    cols = ["case_id", "target_rate", "verdict", "counter_hit_rate", "usage_hit_rate", "expected_rate",
            "tolerance_pp", "prefix_tokens", "requests", "counter_window_matches_requests", "reasons"]
    return res.matrix[cols]


def memory_view(res: "Phase8Result") -> pd.DataFrame:
    """The memory breakdown without the raw log lines (kept in ``phase8/memory.csv``)."""
    return res.memory.drop(columns=["line"], errors="ignore")


def record_h6(ctx: Any, res: "Phase8Result") -> pd.DataFrame:
    """Record this phase's evidence about H6 in the run's ledger; returns it as a one-row table."""
    from servelab.report.ledger import record_evidence
    verdict, summary, nums = h6_evidence(res)
    ev = record_evidence(ctx, "H6", verdict, summary, anchor="KV-usage-over-time", numbers=nums)
    return pd.DataFrame([{"hypothesis": ev.hypothesis, "verdict": ev.verdict, "summary": ev.summary, **nums}])


def accepted_results(matrix: pd.DataFrame) -> pd.DataFrame:
    """Only the ACCEPTED points, with TTFT / throughput relative to the 0 % baseline (if it was accepted)."""
    ok = matrix[matrix["verdict"] == "ACCEPTED"].copy()
    base = ok[ok["target_rate"] == 0.0]
    cols = ["case_id", "target_rate", "purpose", "counter_hit_rate", "p50_ttft_ms", "p95_ttft_ms",
            "input_throughput", "computed_prefill_tok_s"]
    if ok.empty:
        return pd.DataFrame(columns=cols + ["ttft_vs_0pct", "input_tps_vs_0pct"])
    if not base.empty:
        b = base.iloc[0]
        ok["ttft_vs_0pct"] = ok["p50_ttft_ms"] / b["p50_ttft_ms"] if b["p50_ttft_ms"] else None
        ok["input_tps_vs_0pct"] = ok["input_throughput"] / b["input_throughput"] if b["input_throughput"] else None
    else:
        ok["ttft_vs_0pct"] = None
        ok["input_tps_vs_0pct"] = None
    return ok[cols + ["ttft_vs_0pct", "input_tps_vs_0pct"]].reset_index(drop=True)


# ---------------------------------------------------------------- Phase 8 end to end

SCALES: dict[str, dict[str, Any]] = {
    "cluster": {"input_tokens": 8192, "output_tokens": 64, "groups": 16, "requests_per_group": 4},
    "local": {"input_tokens": 128, "output_tokens": 4, "groups": 4, "requests_per_group": 2},
}


@dataclass
class Phase8Result:
    matrix: pd.DataFrame
    kv: pd.DataFrame
    memory: pd.DataFrame
    points: list[PointResult]
    engine: str
    notes: list[str] = field(default_factory=list)

    def headline(self) -> dict[str, Any]:
        acc = self.matrix[self.matrix["verdict"] == "ACCEPTED"]
        out: dict[str, Any] = {"points": len(self.matrix), "accepted": len(acc),
                               "rejected": int((self.matrix["verdict"] == "REJECTED").sum())}
        for _, r in self.matrix.iterrows():
            key = f"hit{round(r['target_rate'] * 100)}%"
            if r["case_id"].endswith("_bad"):
                key += "_bad"
            out[f"{key}_achieved"] = None if r["counter_hit_rate"] is None or pd.isna(r["counter_hit_rate"]) \
                else round(float(r["counter_hit_rate"]), 4)
            out[f"{key}_verdict"] = r["verdict"]
        kv = self.kv[self.kv["metric"].isin(["kv_active", "kv_usage"])]
        out["kv_peak_active"] = round(float(kv["value"].max()), 4) if not kv.empty else None
        return out


def run_phase8(ctx: Any, rates: list[float] | None = None, input_tokens: int = 0, output_tokens: int = 0,
               groups: int = 0, requests_per_group: int = 0, bad_point: bool = True, seed: int = 0,
               definition: str = "vllm", swa_full: bool = True, health_timeout_s: float = 300.0) -> Phase8Result:
    """The hit-rate matrix on ``ctx.target``: a fresh engine (or a flush) per point, plus an optional
    deliberately bad point (the 50 % workload sent with ``cache_prompt: false`` on llama.cpp — the engine
    reuses nothing, so the achieved rate misses and the point must be REJECTED)."""
    from servelab.measure.case import CaseEnv, flush_cache
    from servelab.measure.launch_variants import serving, with_launch
    from servelab.core.params import ParamError
    from servelab.measure.workload import engine_tokenizer, token_pool
    from servelab.measure.launch_variants import log_reproduce
    target = ctx.target
    scale = SCALES[getattr(target, "scale", "local")]
    rates = list(rates) if rates else list(TARGET_RATES)
    for r in rates:
        if not 0.0 <= float(r) < 1.0:
            raise ParamError(f"hit rates must be in [0, 1): got {r}")
    isl = int(input_tokens or scale["input_tokens"])
    osl = int(output_tokens or scale["output_tokens"])
    g = int(groups or scale["groups"])
    rpg = int(requests_per_group or scale["requests_per_group"])
    from servelab.measure.case import max_request_tokens
    limit = max_request_tokens(target)
    notes: list[str] = []
    if limit is not None and isl + osl > limit:
        notes.append(f"input clamped from {isl} to {limit - osl}: a request may hold {limit} tokens on this target")
        isl = limit - osl
    points = [HitPoint(float(r), isl, osl, g, rpg) for r in rates]
    if bad_point:
        if target.engine != "llamacpp":
            notes.append("deliberately bad point skipped: only llama.cpp has a per-request cache switch")
        else:
            # one request per group is enough to show the rule at work (and costs half a point)
            points.append(HitPoint(0.5, isl, osl, g, 1, cache_prompt=False, label="H8_hit50_bad"))
    served = target
    if target.engine == "llamacpp":
        changes: dict[str, Any] = {"log_verbosity": 4}
        notes.append("llama.cpp runs at -lv 4 here so that its memory breakdown is printed")
        if swa_full:
            changes["extra_args"] = [*(target.launch.get("extra_args") or []), "--swa-full"]
            notes.append("--swa-full: a sliding-window model (Gemma 3) keeps a full-size SWA cache, so a shared "
                         "prefix is reusable token by token; without it llama.cpp restores SWA state only from its "
                         "last context checkpoint (a few tokens short of the prefix) and every point misses its "
                         "target (no effect on models without sliding-window attention)")
        served = with_launch(target, changes, ", ".join(f"{k}={v}" for k, v in changes.items()))
    log_dir = ctx.phase_dir / "server"
    log_reproduce(ctx, "phase8")
    results: list[PointResult] = []
    kv_parts: list[pd.DataFrame] = []
    memory = pd.DataFrame()
    from servelab.target.engines import engine_for
    restart_each = engine_for(served.engine).flush_cache_path is None

    def one(srv: RunningServer, pt: HitPoint, flush: dict[str, Any]) -> None:
        pool = token_pool(engine_tokenizer(srv.base_url, srv.target.engine, srv.engine.tokenize_path), seed=seed)
        res = run_hit_point(srv, ctx.run_dir, pt, pool, seed, definition, flush)
        results.append(res)
        kv_parts.append(kv_usage_series(res.slots, res.scrape, srv.target.engine, srv.engine.metric_names,
                                        res.t0_ns, pt.case_id))

    if restart_each:
        for i, pt in enumerate(points):
            with serving(served, log_dir, ctx.run_dir, ctx.phase, health_timeout_s) as srv:
                if i == 0:
                    memory = memory_breakdown(_read_log(srv), srv.target.engine, srv.engine.log_markers)
                one(srv, pt, {"method": "engine restarted before the point", "flushed": True,
                              "reason": f"{srv.target.engine} has no cache flush endpoint"})
    else:
        with serving(served, log_dir, ctx.run_dir, ctx.phase, health_timeout_s) as srv:
            memory = memory_breakdown(_read_log(srv), srv.target.engine, srv.engine.log_markers)
            env = CaseEnv(srv=srv, run_dir=ctx.run_dir, pool=[])
            for pt in points:
                one(srv, pt, flush_cache(env))
    # one timeline: each point's samples from its own start, laid end to end
    offset = 0.0
    timeline = []
    for part in kv_parts:
        if part.empty:
            continue
        part = part.copy()
        part["t_s"] = part["t_s"] - part["t_s"].min() + offset
        offset = float(part["t_s"].max()) + 0.5
        timeline.append(part)
    kv = pd.concat(timeline, ignore_index=True) if timeline else pd.DataFrame(
        columns=["t_s", "metric", "value", "source", "point"])
    matrix = matrix_frame(results)
    res = Phase8Result(matrix, kv, memory, results, target.engine, notes)
    write_phase8_tables(ctx.phase_dir, res)
    return res


def _read_log(srv: RunningServer) -> str:
    path = srv.log_paths.get(srv.target.head.name, "")
    try:
        return Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return ""


def write_phase8_tables(phase_dir: Path, res: Phase8Result) -> None:
    """``hit_rate_matrix.csv`` (every point, rejected ones too), ``kv_usage.csv``, ``memory.csv``, ``phase8.json``."""
    phase_dir.mkdir(parents=True, exist_ok=True)
    res.matrix.to_csv(phase_dir / "hit_rate_matrix.csv", index=False)
    res.kv.to_csv(phase_dir / "kv_usage.csv", index=False)
    res.memory.to_csv(phase_dir / "memory.csv", index=False)
    write_json_atomic(phase_dir / "phase8.json", {"headline": res.headline(), "notes": res.notes,
                                                  "engine": res.engine})


def kv_summary(res: Phase8Result) -> pd.DataFrame:
    """Peak and mean KV usage per point and metric (fractions), with the source named."""
    if res.kv.empty:
        return pd.DataFrame({"note": ["no KV usage samples (engine exposes neither a KV gauge nor /slots)"]})
    return (res.kv.groupby(["point", "metric", "source"], sort=False)["value"]
            .agg(peak="max", mean="mean", samples="count").reset_index())


def h6_evidence(res: Phase8Result) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H6 (KV capacity limits concurrency) from this phase's KV samples."""
    kv = res.kv[res.kv["metric"].isin(["kv_active", "kv_usage"])]
    peak = float(kv["value"].max()) if not kv.empty else math.nan
    deferred = 0.0
    for p in res.points:
        if not p.scrape.empty:
            d = p.scrape[p.scrape["name"].isin(["llamacpp:requests_deferred", "vllm:num_requests_waiting",
                                                "sglang:num_queue_reqs"])]
            deferred = max(deferred, float(d["value"].max()) if not d.empty else 0.0)
    nums = {"kv_peak_active": peak, "max_waiting_requests": deferred,
            "concurrency": int(res.matrix["groups"].max()) if not res.matrix.empty else None}
    if math.isnan(peak):
        return "inconclusive", "no KV usage exposed by the engine in this phase", nums
    if peak >= 0.9 or deferred > 0:
        return "supported", (f"KV usage peaked at {peak:.0%} with up to {deferred:.0f} request(s) waiting at "
                             f"C={nums['concurrency']}"), nums
    return "inconclusive", (f"KV usage peaked at {peak:.1%} with no request waiting at C={nums['concurrency']}: "
                            "this matrix does not press KV capacity (Phase 1's concurrency search decides H6)"), nums


# ---------------------------------------------------------------- figures

def hit_rate_figure(matrix: pd.DataFrame):
    """Achieved vs target hit rate, both sources, the tolerance band; REJECTED points as red ✕."""
    import plotly.graph_objects as go
    fig = go.Figure()
    if matrix.empty:
        return fig.update_layout(title="no hit-rate points")
    xs = np.linspace(0, 0.9, 10)
    tol = float(matrix["tolerance_pp"].max()) / 100
    fig.add_trace(go.Scatter(x=np.concatenate([xs, xs[::-1]]) * 100,
                             y=np.concatenate([xs + tol, (xs - tol)[::-1]]) * 100, fill="toself",
                             fillcolor="rgba(39,174,96,0.15)", line=dict(width=0),
                             name=f"accept band ±{tol * 100:.2f} pp",
                             hoverinfo="skip"))
    for src, sym in (("counter_hit_rate", "circle"), ("usage_hit_rate", "diamond")):
        for verdict, color in (("ACCEPTED", "#27ae60"), ("REJECTED", "#c0392b")):
            g = matrix[(matrix["verdict"] == verdict) & matrix[src].notna()]
            if g.empty:
                continue
            fig.add_trace(go.Scatter(
                x=g["target_rate"] * 100, y=g[src].astype(float) * 100, mode="markers",
                name=f"{'server counters' if src.startswith('counter') else 'per-request usage'} — {verdict}",
                marker=dict(symbol=sym if verdict == "ACCEPTED" else "x-open", size=12, color=color),
                hovertext=[f"{c}: {v}<br>{r}" for c, v, r in zip(g["case_id"], g["verdict"], g["reasons"])],
                hoverinfo="text"))
    fig.update_layout(title="Prefix-cache hit rate: achieved vs target (REJECTED points are never results)",
                      xaxis_title="target hit rate (%)", yaxis_title="achieved hit rate (%)", template="plotly_white")
    return fig


def ttft_figure(matrix: pd.DataFrame):
    """P50/P95 TTFT and input TPS per hit rate, accepted points only (rejected ones named in the title)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    ok = matrix[matrix["verdict"] == "ACCEPTED"].sort_values("target_rate")
    bad = matrix[matrix["verdict"] != "ACCEPTED"]["case_id"].tolist()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "input throughput (tok/s)"))
    x = [f"{round(r * 100)}%" for r in ok["target_rate"]]
    fig.add_trace(go.Bar(x=x, y=ok["p50_ttft_ms"], name="P50 TTFT"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=ok["p95_ttft_ms"], name="P95 TTFT"), row=1, col=1)
    fig.add_trace(go.Bar(x=x, y=ok["input_throughput"], name="input TPS"), row=1, col=2)
    title = "TTFT and throughput per achieved hit rate (accepted points)"
    if bad:
        title += f" — not shown (REJECTED): {', '.join(bad)}"
    fig.update_layout(title=title, barmode="group", template="plotly_white")
    return fig


def kv_figure(kv: pd.DataFrame):
    """KV usage over time (fraction of capacity), one line per metric; points laid end to end."""
    import plotly.graph_objects as go
    fig = go.Figure()
    if kv.empty:
        return fig.update_layout(title="KV usage: not exposed by this engine")
    for metric, g in kv.groupby("metric", sort=False):
        fig.add_trace(go.Scatter(x=g["t_s"], y=g["value"] * 100, mode="lines+markers", name=metric,
                                 marker=dict(size=3), hovertext=g["point"], hoverinfo="text+y"))
    for point, g in kv.groupby("point", sort=False):
        fig.add_vline(x=float(g["t_s"].min()), line_dash="dot", line_color="#95a5a6",
                      annotation_text=str(point), annotation_position="top left")
    fig.update_layout(title=f"KV usage over time — {kv['source'].iloc[0]}", xaxis_title="time (s, points end to end)",
                      yaxis_title="% of KV capacity", template="plotly_white")
    return fig


def point_requests(res: Phase8Result, case_id: str) -> pd.DataFrame:
    """Per request of one point: group, prompt/cached tokens (usage), TTFT — how each request hit the cache."""
    p = next((x for x in res.points if x.point.case_id == case_id), None)
    if p is None:
        return pd.DataFrame({"note": [f"no point {case_id}"]})
    rows = [{"request_id": r.request_id, "role": r.role, "group": r.group, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens,
             "ttft_ms": mx.request_metrics(r, "vllm").ttft_ms} for r in p.records]
    return pd.DataFrame(rows)
