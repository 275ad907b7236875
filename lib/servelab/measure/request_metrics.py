"""Request-level serving metrics from raw client records, under two named definitions.

``sglang`` — SGLang ``bench_serving`` (0.5.9, OpenAI backends; ``docs/metrics.md#definitions``):
  TTFT  first chunk with **non-empty text** − send (0 if none, as bench_serving does);
  ITL   gaps between consecutive non-empty-text chunks (first excluded), one value per chunk; on the native
        ``/generate`` API the gap is split evenly over the chunk's completion-token delta (0-token chunks skipped);
  E2E   last SSE line received (incl. the usage chunk and ``[DONE]``) − send: the stream tail is included;
  output tokens  server ``completion_tokens``, falling back to the **requested** length if the server sent none;
  input tokens   the workload's (dataset) prompt length.
``vllm`` — ``vllm bench serve`` (``vllm/benchmarks/lib/endpoint_request_func.py``):
  TTFT  first chunk with a non-empty ``choices`` list (its text may be empty) − send; no such chunk = failed;
  ITL   gaps between consecutive choices chunks, one per chunk, never split per token;
  E2E   last choices chunk − send (the trailing usage chunk and ``[DONE]`` excluded);
  output tokens  server ``completion_tokens`` (vLLM would re-tokenize the text when absent; we count the
        non-empty text chunks instead and say so in ``output_tokens_source``);
  input tokens   server ``prompt_tokens`` when present (server truth), else the workload's.
Both: TPOT = (E2E − TTFT)/(output tokens − 1) for requests with more than one output token; throughput =
totals / measurement window. Goodput follows vLLM: a request is good iff every given SLO holds
(``value <= slo``), requests with ≤ 1 output token count TPOT 0; ``request_goodput`` = good / window.
Extra, definition-independent: ``itl_per_token`` (each text-chunk gap split over its token delta — from the
server where given, else 1 when chunks == tokens), client queue time and E2E including it.

Percentiles: ``numpy.percentile`` with linear interpolation (numpy's default, as both tools); std with
ddof=0 as both tools; the coefficient of variation across repeats uses the sample std (ddof=1). Every summary
says how many values each metric's statistics rest on (``n_ttft``, ``n_itl`` …), and a percentile is *shown*
only through :func:`percentile_label` / :func:`shown_percentile`: a Pp needs at least ``100 / (100 − p)``
values (P99: 100, P95: 20, P90: 10, P50: 2), below that the page shows "max of N" with the maximum instead.

Measurement integrity (:func:`integrity`, ``docs/metrics.md#integrity``): the client's dispatch lag, its own
event-loop lag sampled during the window, achieved vs scheduled arrival rate (open loop) and a Little's-law
check (mean in-flight vs throughput × mean latency); a client that fell behind makes the case INVALID.
All durations in ms unless the name says otherwise.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from servelab.measure.records import ClientRun, RequestRecord
from servelab.core.paths import cache_root

class Definition(StrEnum):
    """A metric definition: the benchmark tool whose rules a number follows — never the engine that served the
    requests (every case is summarised under both, whatever its engine). The value is the definition's name in
    files (``summary.json``, ``summary.csv``) and in the ``definition`` parameter."""
    SGLANG_BENCH = "sglang"        # SGLang bench_serving
    VLLM_BENCH = "vllm"            # vllm bench serve

    @property
    def tool(self) -> str:
        """The benchmark tool the definition reproduces."""
        return TOOL_OF[self]


SGLANG_BENCH, VLLM_BENCH = Definition.SGLANG_BENCH, Definition.VLLM_BENCH
TOOL_OF = {SGLANG_BENCH: "SGLang bench_serving", VLLM_BENCH: "vllm bench serve"}
DEFINITIONS = tuple(d.value for d in Definition)      # ("sglang", "vllm"): the names, in this order
PERCENTILES = (50, 90, 95, 99)
PERCENTILE_METHOD = "numpy.percentile, linear interpolation"
LATENCY_METRICS = ("ttft", "tpot", "itl", "itl_per_token", "e2el", "queue_time", "e2el_incl_queue")


def _check_definition(definition: str) -> None:
    if definition not in DEFINITIONS:
        raise ValueError(f"unknown metric definition '{definition}'; one of {DEFINITIONS}")


@dataclass
class RequestMetrics:
    """One request's metrics under one definition (ms; ITL lists in ms)."""
    request_id: str
    index: int
    role: str
    repeat: int
    success: bool
    timeout: bool
    error_kind: str
    ttft_ms: float | None
    tpot_ms: float | None
    e2el_ms: float | None
    itl_ms: list[float]
    itl_per_token_ms: list[float] | None
    input_tokens: int
    output_tokens: int
    output_tokens_source: str          # usage | requested | chunks
    expected_input_tokens: int
    requested_output_tokens: int
    server_prompt_tokens: int | None
    server_completion_tokens: int | None
    cached_tokens: int | None
    n_chunks: int                      # chunks counted by this definition
    queue_time_ms: float
    start_ms: float                    # send time relative to the window start
    done_seen: bool


def _ms(ns: float) -> float:
    return ns / 1e6


def request_metrics(rec: RequestRecord, definition: str, window_start_ns: int = 0) -> RequestMetrics:
    """The metrics of one raw record under ``definition`` (``sglang`` | ``vllm``)."""
    _check_definition(definition)
    ok = rec.ok
    text_idx = [i for i, t in enumerate(rec.chunk_text) if t]
    choice_idx = [i for i, c in enumerate(rec.chunk_choices) if c]
    ttft = tpot = e2e = None
    itl: list[float] = []
    if definition == SGLANG_BENCH:
        success = ok
        sel = text_idx
        if success:
            ttft = _ms(rec.chunk_ns[sel[0]] - rec.send_ns) if sel else 0.0
            last = max([*rec.chunk_ns, rec.done_ns or 0]) if (rec.chunk_ns or rec.done_ns) else rec.end_ns
            e2e = _ms(last - rec.send_ns)
        if rec.completion_tokens is not None:
            out, out_src = int(rec.completion_tokens), "usage"
        else:
            out, out_src = rec.requested_output_tokens, "requested"
        inp = rec.expected_input_tokens
        gaps = [_ms(rec.chunk_ns[b] - rec.chunk_ns[a]) for a, b in zip(sel, sel[1:])]
        if rec.api == "generate" and success:
            for k, g in zip(sel[1:], gaps):
                d = rec.chunk_tokens[k]
                d = 1 if d is None else d
                if d > 0:
                    itl.extend([g / d] * d)
        else:
            itl = gaps
    else:
        success = ok and bool(choice_idx)
        sel = choice_idx
        if success:
            ttft = _ms(rec.chunk_ns[sel[0]] - rec.send_ns)
            e2e = _ms(rec.chunk_ns[sel[-1]] - rec.send_ns)
            itl = [_ms(rec.chunk_ns[b] - rec.chunk_ns[a]) for a, b in zip(sel, sel[1:])]
        if rec.completion_tokens is not None:
            out, out_src = int(rec.completion_tokens), "usage"
        else:
            out, out_src = len(text_idx), "chunks"
        inp = int(rec.prompt_tokens) if rec.prompt_tokens is not None else rec.expected_input_tokens
    if success and out > 1 and ttft is not None and e2e is not None:
        tpot = (e2e - ttft) / (out - 1)
    return RequestMetrics(
        request_id=rec.request_id, index=rec.index, role=rec.role, repeat=rec.repeat, success=success,
        timeout=rec.error_kind == "timeout", error_kind=rec.error_kind if rec.error_kind else
        ("" if success else "no_chunk"), ttft_ms=ttft, tpot_ms=tpot, e2el_ms=e2e, itl_ms=itl if success else [],
        itl_per_token_ms=per_token_itl(rec) if success else None, input_tokens=inp, output_tokens=out,
        output_tokens_source=out_src, expected_input_tokens=rec.expected_input_tokens,
        requested_output_tokens=rec.requested_output_tokens, server_prompt_tokens=rec.prompt_tokens,
        server_completion_tokens=rec.completion_tokens, cached_tokens=rec.cached_tokens, n_chunks=len(sel),
        queue_time_ms=_ms(rec.dispatch_ns - rec.scheduled_ns) if rec.scheduled_ns else 0.0,
        start_ms=_ms(rec.send_ns - window_start_ns) if window_start_ns else 0.0, done_seen=rec.done_ns is not None)


def per_token_itl(rec: RequestRecord) -> list[float] | None:
    """Text-chunk gaps split over each chunk's token delta (ms); None when the deltas are unknown.

    Deltas come from the server (SGLang ``meta_info``, vLLM continuous usage); without them every
    text chunk counts one token only if the number of text chunks equals ``completion_tokens``.
    """
    idx = [i for i, t in enumerate(rec.chunk_text) if t]
    if len(idx) < 2:
        return [] if idx else None
    deltas = [rec.chunk_tokens[i] for i in idx]
    if any(d is None for d in deltas):
        if rec.completion_tokens is None or len(idx) != rec.completion_tokens:
            return None
        deltas = [1] * len(idx)
    out: list[float] = []
    for a, b, d in zip(idx, idx[1:], deltas[1:]):
        if d and d > 0:
            out.extend([_ms(rec.chunk_ns[b] - rec.chunk_ns[a]) / d] * int(d))
    return out


def request_frame(records: Iterable[RequestRecord], definition: str, window_start_ns: int = 0) -> pd.DataFrame:
    """One row per request under ``definition`` (ITL lists summarised as their count and mean)."""
    rows = []
    for rec in records:
        m = request_metrics(rec, definition, window_start_ns)
        d = {k: v for k, v in m.__dict__.items() if k not in ("itl_ms", "itl_per_token_ms")}
        d["n_itl"] = len(m.itl_ms)
        d["mean_itl_ms"] = float(np.mean(m.itl_ms)) if m.itl_ms else None
        d["definition"] = definition
        rows.append(d)
    return pd.DataFrame(rows)


def stats(values: list[float] | np.ndarray, prefix: str, unit: str = "ms") -> dict[str, float | None]:
    """mean, median, std (ddof 0), p50/p90/p95/p99 (numpy linear), min, max of ``values``; None if empty;
    ``n_<prefix>``: how many values they rest on."""
    arr = np.asarray(values, dtype=float)
    keys = ["mean", "median", "std", *[f"p{p}" for p in PERCENTILES], "min", "max"]
    if arr.size == 0:
        return {**{f"{k}_{prefix}_{unit}": None for k in keys}, f"n_{prefix}": 0}
    pct = np.percentile(arr, PERCENTILES)
    vals = [arr.mean(), np.median(arr), arr.std(), *pct, arr.min(), arr.max()]
    return {**{f"{k}_{prefix}_{unit}": float(v) for k, v in zip(keys, vals)}, f"n_{prefix}": int(arr.size)}


# ---------------------------------------------------------------- percentiles that say what they rest on

def min_samples(p: float) -> int:
    """Values a Pp needs before it is more than the maximum: at least one value must lie above it,
    ``ceil(100 / (100 − p))`` (P50: 2, P90: 10, P95: 20, P99: 100, P99.9: 1000)."""
    if not 0 < p < 100:
        raise ValueError(f"a percentile is between 0 and 100 (exclusive), got {p}")
    return math.ceil(round(100.0 / (100.0 - p), 9))


def _pname(p: float) -> str:
    return f"P{p:g}"


def percentile_label(p: float, n: int) -> str:
    """How a Pp over ``n`` values is labelled wherever it is shown: ``P99 (n=250)``; with fewer values than
    :func:`min_samples` it is no Pp but the largest value, ``max of 8`` (``1 sample`` for one, ``no samples``)."""
    n = int(n or 0)
    if n <= 0:
        return f"{_pname(p)}: no samples"
    if n == 1:
        return "1 sample"
    if n < min_samples(p):
        return f"max of {n}"
    return f"{_pname(p)} (n={n})"


def metric_count(summary: dict[str, Any], metric: str) -> int:
    """How many values the statistics of ``metric`` (``ttft``, ``tpot`` …) rest on in a summary; a summary of
    before the counts were written falls back to its completed requests (one value each for ttft/tpot/e2el)."""
    n = summary.get(f"n_{metric}")
    if n is None and metric in ("ttft", "tpot", "e2el", "e2el_incl_queue", "queue_time"):
        n = summary.get("completed")
    return int(n or 0)


def shown_percentile(summary: dict[str, Any], metric: str, p: float, unit: str = "ms"
                     ) -> tuple[str, float | None]:
    """(label, value) of Pp of ``metric`` in a summary as a page shows it: the percentile with ``n=`` when enough
    values hold it, else ``max of N`` with the maximum (never a Pp that is really one sample)."""
    n = metric_count(summary, metric)
    label = percentile_label(p, n)
    if n and n < min_samples(p):
        return label, summary.get(f"max_{metric}_{unit}")
    key = f"p{p:g}_{metric}_{unit}" if p != 50 or f"p50_{metric}_{unit}" in summary else f"median_{metric}_{unit}"
    return label, summary.get(key)


def _short(v: float, digits: int) -> str:
    return f"{v:.3g}" if 0 < abs(v) < 1 else f"{v:,.{digits}f}"


def percentile_cell(summary: dict[str, Any], metric: str, p: float, unit: str = "ms", digits: int = 2) -> str:
    """One table cell (its column header carries the unit): ``12.34 · P99 (n=250)`` or ``12.34 · max of 8``;
    ``—`` without values."""
    label, value = shown_percentile(summary, metric, p, unit)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{_short(float(value), digits)} · {label}"


_PCOL = re.compile(r"^(?:p(\d+(?:\.\d+)?)|(median))_(.+)_(ms|us|s|pct)$")


def labelled_percentiles(df: pd.DataFrame, digits: int = 2, counts: dict[str, str] | None = None) -> pd.DataFrame:
    """A frame of summaries (one per row) as a page shows it: every ``p<p>_<metric>_<unit>`` / ``median_…`` cell
    becomes :func:`percentile_cell` — the percentile with its ``n=``, or ``max of N`` with the row's
    ``max_<metric>_<unit>``. The count of a metric comes from ``counts[metric]`` (a column name, e.g. Phase 7's
    ``n_gaps``), else ``n_<metric>`` (then dropped: every cell says its count), else — for TTFT, TPOT and E2E —
    the row's ``completed``; a percentile column with no count anywhere is left as it is."""
    if df.empty:
        return df
    counts = counts or {}
    out = df.copy()
    rows = [{k: (None if _isnan(v) else v) for k, v in r.items()} for r in df.to_dict("records")]
    drop: set[str] = set()
    for col in df.columns:
        m = _PCOL.match(str(col))
        if not m:
            continue
        p = 50.0 if m.group(2) else float(m.group(1))
        metric, unit = m.group(3), m.group(4)
        if metric in counts:
            src = counts[metric]
        elif f"n_{metric}" in df.columns:
            src = f"n_{metric}"
            drop.add(src)
        elif "completed" in df.columns and metric in ("ttft", "tpot", "e2el"):
            src = "completed"
        else:
            continue
        out[col] = pd.Series([percentile_cell({**r, f"n_{metric}": r.get(src)}, metric, p, unit, digits)
                              for r in rows], index=df.index, dtype=object)
    return out.drop(columns=[c for c in drop if c in out.columns])


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


@dataclass
class SLO:
    """Service-level objectives in ms (None = not set). A request is good iff every set one holds."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def good(self, m: RequestMetrics) -> bool:
        if not m.success:
            return False
        tpot = m.tpot_ms if m.output_tokens > 1 and m.tpot_ms is not None else 0.0
        checks = [(self.ttft_ms, m.ttft_ms), (self.tpot_ms, tpot), (self.e2el_ms, m.e2el_ms)]
        return all(slo is None or (v is not None and v <= slo) for slo, v in checks)


def summarize(records: list[RequestRecord], duration_s: float, definition: str, slo: SLO | None = None,
              window_start_ns: int = 0, roles: tuple[str, ...] = ("measure",)) -> dict[str, Any]:
    """Aggregate metrics of the records whose role is in ``roles`` over a window of ``duration_s`` seconds."""
    _check_definition(definition)
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ms = [request_metrics(r, definition, window_start_ns) for r in records if r.role in roles]
    good = [m for m in ms if m.success]
    total_in = sum(m.input_tokens for m in good)
    total_out = sum(m.output_tokens for m in good)
    out: dict[str, Any] = {
        "definition": definition, "percentile_method": PERCENTILE_METHOD, "duration_s": duration_s,
        "num_requests": len(ms), "completed": len(good), "failed": len(ms) - len(good),
        "timeouts": sum(m.timeout for m in ms),
        "errors_by_kind": pd.Series([m.error_kind for m in ms if not m.success], dtype=object).value_counts().to_dict(),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "total_cached_tokens": sum(m.cached_tokens or 0 for m in good),
        "request_throughput": len(good) / duration_s, "input_throughput": total_in / duration_s,
        "output_throughput": total_out / duration_s, "total_token_throughput": (total_in + total_out) / duration_s,
        "output_tokens_sources": pd.Series([m.output_tokens_source for m in good], dtype=object)
        .value_counts().to_dict(),
        "missing_done": sum(not m.done_seen for m in good),
    }
    out.update(stats([m.ttft_ms for m in good if m.ttft_ms is not None], "ttft"))
    out.update(stats([m.tpot_ms for m in good if m.tpot_ms is not None], "tpot"))
    out.update(stats([x for m in good for x in m.itl_ms], "itl"))
    per_tok = [m.itl_per_token_ms for m in good]
    out.update(stats([x for p in per_tok if p for x in p], "itl_per_token"))
    out["itl_per_token_available"] = bool(good) and all(p is not None for p in per_tok)
    out.update(stats([m.e2el_ms for m in good if m.e2el_ms is not None], "e2el"))
    out.update(stats([m.queue_time_ms for m in ms], "queue_time"))
    out.update(stats([m.e2el_ms + m.queue_time_ms for m in good if m.e2el_ms is not None], "e2el_incl_queue"))
    # per-user decode speed (InferenceX "interactivity"): 1000 / TPOT
    out["median_tok_per_s_per_user"] = (1000.0 / out["median_tpot_ms"]) if out["median_tpot_ms"] else None
    if slo is not None and slo.is_set():
        n_good = sum(slo.good(m) for m in ms)
        out["slo"] = slo.__dict__
        out["good_requests"] = n_good
        out["request_goodput"] = n_good / duration_s
        out["goodput_fraction"] = n_good / len(ms) if ms else None
    else:
        out["slo"], out["good_requests"], out["request_goodput"], out["goodput_fraction"] = None, None, None, None
    out["token_check"] = token_check(records, roles)
    return out


def token_check(records: list[RequestRecord], roles: tuple[str, ...] = ("measure",)) -> dict[str, Any]:
    """Achieved vs requested tokens per request (server ``usage`` vs the workload); mismatches listed."""
    rows = []
    for r in records:
        if r.role not in roles or not r.ok:
            continue
        in_ok = r.prompt_tokens is not None and int(r.prompt_tokens) == r.expected_input_tokens
        out_ok = r.completion_tokens is not None and int(r.completion_tokens) == r.requested_output_tokens
        if not (in_ok and out_ok):
            rows.append({"request_id": r.request_id, "expected_input": r.expected_input_tokens,
                         "server_input": r.prompt_tokens, "requested_output": r.requested_output_tokens,
                         "server_output": r.completion_tokens})
    checked = sum(1 for r in records if r.role in roles and r.ok)
    return {"checked": checked, "mismatches": len(rows), "examples": rows[:20],
            "exact": checked > 0 and not rows}


def cv_across_repeats(summaries: list[dict[str, Any]],
                      keys: tuple[str, ...] = ("output_throughput", "total_token_throughput", "request_throughput",
                                               "median_ttft_ms", "median_tpot_ms", "p95_ttft_ms", "p95_tpot_ms",
                                               "median_e2el_ms")) -> dict[str, dict[str, float | None]]:
    """Mean, sample std (ddof=1) and CV % of each key across repeat summaries (None with < 2 repeats)."""
    out: dict[str, dict[str, float | None]] = {}
    for k in keys:
        vals = np.array([s[k] for s in summaries if s.get(k) is not None], dtype=float)
        if vals.size < 2:
            out[k] = {"mean": float(vals.mean()) if vals.size else None, "std": None, "cv_pct": None, "n": int(vals.size)}
            continue
        mean, std = float(vals.mean()), float(vals.std(ddof=1))
        out[k] = {"mean": mean, "std": std, "cv_pct": 100.0 * std / mean if mean else None, "n": int(vals.size)}
    return out


# ---------------------------------------------------------------- measurement integrity

CEILING_FILE = "client_ceiling.json"   # in the servelab cache: benchmarks/bench_client_overhead.py --save-ceiling
SAVE_CEILING = "benchmarks/bench_client_overhead.py --ceiling --save-ceiling"


def measured_client_ceiling(path: Any = None) -> dict[str, Any] | None:
    """The client's *accurate ceiling* (``docs/metrics.md#integrity``): the highest chunk rate at which it keeps
    p99 timestamp error ≤ 1 ms with ≥ 99 % of offered chunks on time, on one pinned core, as measured on *this*
    machine by ``benchmarks/bench_client_overhead.py --ceiling --save-ceiling`` (chunks/s, the command, the date,
    the machine). ``path`` None: ``client_ceiling.json`` in the servelab cache (``SERVELAB_CACHE``) — a ceiling
    belongs to the machine the client runs on, so none ships with servelab; ``None`` back when none was measured.
    A file that is there but holds no positive ``chunks_per_s`` raises ``ValueError`` naming it."""
    if path is None:
        path = cache_root() / CEILING_FILE
    if not Path(path).is_file():
        return None
    text, where = Path(path).read_text(), str(path)
    try:
        d = json.loads(text)
        rate = float(d["chunks_per_s"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a client-ceiling file ({exc}); measure again with {SAVE_CEILING} "
                         "or delete it") from None
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"{where}: chunks_per_s must be > 0, got {d['chunks_per_s']!r}; measure again with "
                         f"{SAVE_CEILING} or delete it")
    return {**d, "chunks_per_s": rate}


def chunk_rate(run: ClientRun) -> tuple[int, float]:
    """(chunks received inside the window, chunks per second over it) of one client run: every SSE event timed,
    the usage chunk and ``[DONE]`` included — what the client had to timestamp."""
    lo, hi = run.window_start_ns, run.window_end_ns
    n = sum(lo <= t <= hi for r in run.records for t in r.chunk_ns)
    n += sum(1 for r in run.records if r.done_ns is not None and lo <= r.done_ns <= hi)
    return n, n / max(run.duration_s, 1e-9)


@dataclass
class IntegrityRules:
    """When a run's client is judged to have fallen behind (any one makes the case INVALID).

    ``client_ceiling``: the measured accurate ceiling (:func:`measured_client_ceiling`, the cache's file by
    default; pass another, or ``None``, to judge against a different one); a run whose chunk rate exceeds it is
    INVALID; ``None``: "no ceiling measured", not judged."""
    max_dispatch_lag_ms: float = 50.0      # worst request: sent this long after it was due
    max_loop_lag_ms: float = 100.0         # worst monitor wake-up: the client's loop could not run this long
    max_loop_lag_p99_ms: float = 50.0      # sustained: P99 of the wake-up lags (judged from 100 samples, a P99's own rule)
    min_rate_ratio: float = 0.95           # open loop: achieved / scheduled arrival rate
    max_littles_law_error: float = 0.15    # |mean in-flight − throughput × mean latency| / the larger
    min_samples: int = 20                  # fewer monitor samples: Little's law is not judged
    client_ceiling: dict[str, Any] | None = field(default_factory=measured_client_ceiling)


def _lag_stats(values_ms: list[float] | np.ndarray) -> dict[str, Any]:
    arr = np.asarray(values_ms, dtype=float)
    if arr.size == 0:
        return {"n": 0, "mean_ms": None, "p99_ms": None, "max_ms": None, "p99_label": percentile_label(99, 0)}
    return {"n": int(arr.size), "mean_ms": float(arr.mean()), "p99_ms": float(np.percentile(arr, 99)),
            "max_ms": float(arr.max()), "p99_label": percentile_label(99, int(arr.size))}


def dispatch_lag_ms(rec: RequestRecord) -> float:
    """How late the client sent a request, ms: its arrival timer's lateness (``ready − scheduled``, open loop)
    plus the time from getting its slot to the POST (``send − dispatch``). The wait for a slot under a
    concurrency cap is queue time, not lag."""
    late = max(0, rec.ready_ns - rec.scheduled_ns) if rec.ready_ns and rec.scheduled_ns else 0
    return (late + max(0, rec.send_ns - rec.dispatch_ns)) / 1e6 if rec.dispatch_ns else late / 1e6


def littles_law(mean_inflight: float | None, throughput_rps: float, mean_latency_s: float | None,
                samples: int = 0) -> dict[str, Any]:
    """L = λ·W: the mean requests in flight the client sampled against throughput × mean latency; ``error`` is
    their difference over the larger (0: they agree). ``noise`` is what ``samples`` samples of a count averaging
    that much can miss by chance (three standard errors of a Poisson count, ``3·sqrt(L/samples)``), relative to the
    same larger value: a difference within it is not evidence of anything."""
    if mean_inflight is None or mean_latency_s is None:
        return {"mean_inflight": mean_inflight, "lambda_w": None, "error": None, "noise": None}
    lw = throughput_rps * mean_latency_s
    big = max(abs(mean_inflight), abs(lw))
    noise = 3.0 * math.sqrt(big / samples) / big if samples and big > 0 else None
    return {"mean_inflight": float(mean_inflight), "lambda_w": float(lw),
            "error": float(abs(mean_inflight - lw) / big) if big > 0 else 0.0, "noise": noise}


def integrity(run: ClientRun, rules: IntegrityRules | None = None) -> dict[str, Any]:
    """The measurement-integrity record of one client run, with ``reasons`` (empty: the client kept up).

    - ``dispatch_lag``: per request, :func:`dispatch_lag_ms` (n, mean, P99, max);
    - ``loop_lag``: the monitor's wake-up lateness during the window (n, mean, P99, max, total stalled ms);
    - ``arrival``: requested (``rate_rps``), scheduled (the seeded arrivals actually drawn) and achieved (when the
      client was ready to send them) rates, open loop only;
    - ``littles_law``: mean in-flight sampled by the monitor vs completed-per-second × mean latency over the
      window, all requests of the run (injections included: the monitor counts them too).
    """
    rules = rules or IntegrityRules()
    if run.processes:          # several client processes: each judged on its own, a reason names its process
        out = pooled_integrity([integrity(p, rules) for p in run.processes], [p.process for p in run.processes])
        n_chunks, rate = chunk_rate(run)
        out["clients"] = {"processes": len(run.processes), "chunks": n_chunks, "chunks_per_s": rate,
                          **(run.sizing.get("clients") or {})}
        return out
    recs = [r for r in run.records if r.send_ns]
    window_s = max(run.duration_s, 1e-9)
    dl = _lag_stats([dispatch_lag_ms(r) for r in recs])
    ll = _lag_stats([x / 1e6 for x in run.loop_lag_ns])
    ll["total_ms"] = float(sum(run.loop_lag_ns) / 1e6)
    ll["interval_ms"] = run.monitor_interval_s * 1e3
    out: dict[str, Any] = {"dispatch_lag": dl, "loop_lag": ll, "window_s": window_s, "requests": len(recs),
                           "sizing": dict(run.sizing), "rules": dict(rules.__dict__)}
    reasons: list[str] = []
    late = run.sizing.get("start_late_ms")         # one of several client processes: vs the shared start instant
    if late is not None and late > rules.max_dispatch_lag_ms:
        reasons.append(f"client fell behind: it opened its window {late:.1f} ms after the shared start instant "
                       f"(> {rules.max_dispatch_lag_ms:g} ms)")
    if dl["n"] and dl["max_ms"] > rules.max_dispatch_lag_ms:
        reasons.append(f"client fell behind: a request was sent {dl['max_ms']:.1f} ms after it was due "
                       f"(> {rules.max_dispatch_lag_ms:g} ms)")
    # ~1 ms per wake-up is the loop's own timer granularity (epoll waits in whole ms): the total is reported, not judged
    ll["share"] = ll["total_ms"] / 1e3 / window_s
    if ll["n"] and ll["max_ms"] > rules.max_loop_lag_ms:
        reasons.append(f"client fell behind: its event loop stalled {ll['max_ms']:.1f} ms "
                       f"(worst of {ll['n']} samples, > {rules.max_loop_lag_ms:g} ms)")
    elif ll["n"] >= min_samples(99) and ll["p99_ms"] > rules.max_loop_lag_p99_ms:
        reasons.append(f"client fell behind: its event loop lagged {ll['p99_ms']:.1f} ms at "
                       f"{ll['p99_label']} (> {rules.max_loop_lag_p99_ms:g} ms)")
    arrival: dict[str, Any] = {"mode": run.mode, "requested_rps": run.rate_rps}
    timed = sorted((r.scheduled_ns, r.ready_ns or r.dispatch_ns) for r in run.records
                   if r.role != "inject" and r.scheduled_ns)
    if run.rate_rps is not None and len(timed) >= 2:
        sched_span = (timed[-1][0] - timed[0][0]) / 1e9
        ready = sorted(t for _, t in timed)
        ready_span = (ready[-1] - timed[0][0]) / 1e9
        arrival["scheduled_rps"] = (len(timed) - 1) / sched_span if sched_span > 0 else None
        arrival["achieved_rps"] = (len(timed) - 1) / ready_span if ready_span > 0 else None
        if arrival["scheduled_rps"] and arrival["achieved_rps"]:
            ratio = arrival["achieved_rps"] / arrival["scheduled_rps"]
            arrival["ratio"] = ratio
            if ratio < rules.min_rate_ratio:
                reasons.append(f"client fell behind: achieved arrival rate {arrival['achieved_rps']:.2f} req/s is "
                               f"{ratio:.0%} of the {arrival['scheduled_rps']:.2f} req/s scheduled "
                               f"(< {rules.min_rate_ratio:.0%})")
    else:
        arrival["achieved_rps"] = len(recs) / window_s
        arrival["note"] = "closed loop: requests follow completions, no arrival rate was requested"
    out["arrival"] = arrival
    ended = [r for r in recs if r.end_ns]
    lat = [(r.end_ns - r.send_ns) / 1e9 for r in ended]
    lw = littles_law(float(np.mean(run.inflight)) if run.inflight else None, len(ended) / window_s,
                     float(np.mean(lat)) if lat else None, len(run.inflight))
    lw["samples"] = len(run.inflight)
    lw["judged"] = lw["error"] is not None and len(run.inflight) >= rules.min_samples
    bound = max(rules.max_littles_law_error, lw["noise"] or 0.0)
    lw["bound"] = bound
    if lw["judged"] and lw["error"] > bound:
        reasons.append(f"Little's law off: the client saw {lw['mean_inflight']:.2f} requests in flight on average, "
                       f"throughput × mean latency says {lw['lambda_w']:.2f} ({lw['error']:.0%} apart, "
                       f"> {bound:.0%})")
    out["littles_law"] = lw
    n_chunks, rate = chunk_rate(run)
    ceil = rules.client_ceiling
    cc: dict[str, Any] = {"chunks": n_chunks, "chunks_per_s": rate}
    if not ceil:
        cc["note"] = "no ceiling measured"
    else:
        cc.update(ceiling_chunks_per_s=ceil["chunks_per_s"], measured=ceil.get("measured"),
                  command=ceil.get("command"), ratio=rate / ceil["chunks_per_s"])
        if rate > ceil["chunks_per_s"]:
            reasons.append(f"client past its accurate ceiling ({rate:,.0f} chunks/s > {ceil['chunks_per_s']:,.0f} "
                           f"measured on one core by {ceil.get('command') or 'bench_client_overhead.py --ceiling'}"
                           f"{', ' + str(ceil['measured']) if ceil.get('measured') else ''})")
    out["chunk_rate"] = cc
    out["reasons"] = reasons
    out["ok"] = not reasons
    return out


def pooled_integrity(per_run: list[dict[str, Any]], processes: list[str] | None = None) -> dict[str, Any]:
    """One integrity record over the repeats of a case: the worst of each check, every repeat's reasons (prefixed
    with the repeat when there are several), ``repeats`` keeps each run's record. ``processes``: the records are
    the client processes of one run instead (their labels prefix the reasons, ``processes`` keeps them)."""
    if not per_run:
        return {"ok": True, "reasons": [], "repeats": []}
    if processes:
        pooled = pooled_integrity(per_run) if len(per_run) > 1 else {**per_run[0], "repeats": []}
        reasons = [f"{label}: {x}" for label, r in zip(processes, per_run) for x in r["reasons"]]
        pooled.pop("repeats", None)
        return {**pooled, "reasons": reasons, "ok": not reasons, "processes": per_run, "repeats": []}
    if len(per_run) == 1:
        return {**per_run[0], "repeats": []}
    def worst(key: str, stat: str) -> float | None:
        vals = [r[key][stat] for r in per_run if r[key].get(stat) is not None]
        return max(vals) if vals else None
    reasons = [f"repeat {i}: {x}" for i, r in enumerate(per_run) for x in r["reasons"]]
    return {"dispatch_lag": {"max_ms": worst("dispatch_lag", "max_ms"), "n": sum(r["dispatch_lag"]["n"] for r in per_run)},
            "loop_lag": {"max_ms": worst("loop_lag", "max_ms"), "n": sum(r["loop_lag"]["n"] for r in per_run)},
            "littles_law": {"error": worst("littles_law", "error")},
            "chunk_rate": {"chunks_per_s": worst("chunk_rate", "chunks_per_s"),
                           "ceiling_chunks_per_s": per_run[0].get("chunk_rate", {}).get("ceiling_chunks_per_s")},
            "reasons": reasons, "ok": not reasons, "repeats": per_run}


@dataclass
class ValidityRules:
    """When a case result may be presented as a result (MLPerf-loadgen spirit)."""
    min_completed: int = 1
    min_window_s: float = 0.0
    require_exact_tokens: bool = True
    max_error_rate: float = 0.0
    max_cv_pct: float | None = None          # milestone bound (3 %, docs/method.md#repeats), checked with >= 2 repeats
    cv_key: str = "output_throughput"


@dataclass
class Verdict:
    verdict: str                              # VALID | INVALID
    reasons: list[str] = field(default_factory=list)


def validity(summary: dict[str, Any], rules: ValidityRules, profiler_attached: bool = False,
             cv: dict[str, dict[str, float | None]] | None = None,
             integrity_record: dict[str, Any] | None = None) -> Verdict:
    """VALID, or INVALID with every reason found (short window, too few requests, token mismatch, errors,
    timeouts, profiler attached, CV over the bound, a client that fell behind: ``integrity_record``'s reasons)."""
    reasons = []
    if summary["completed"] < rules.min_completed:
        reasons.append(f"too few completed requests: {summary['completed']} < {rules.min_completed}")
    if summary["duration_s"] < rules.min_window_s:
        reasons.append(f"measurement window too short: {summary['duration_s']:.3f} s < {rules.min_window_s} s")
    n = summary["num_requests"]
    if n and summary["failed"] / n > rules.max_error_rate:
        reasons.append(f"errors: {summary['failed']} of {n} requests failed {summary['errors_by_kind']}")
    if summary["timeouts"]:
        reasons.append(f"timeouts: {summary['timeouts']}")
    tc = summary.get("token_check") or {}
    if rules.require_exact_tokens and tc.get("mismatches"):
        reasons.append(f"achieved tokens off target in {tc['mismatches']} of {tc['checked']} requests")
    if profiler_attached:
        reasons.append("a profiler was attached (never compare with clean runs)")
    if rules.max_cv_pct is not None and cv:
        c = (cv.get(rules.cv_key) or {}).get("cv_pct")
        if c is not None and c > rules.max_cv_pct:
            reasons.append(f"CV of {rules.cv_key} across repeats {c:.1f} % > {rules.max_cv_pct} %")
    reasons += [str(x) for x in (integrity_record or {}).get("reasons") or []]
    return Verdict("INVALID" if reasons else "VALID", reasons)


def both_definitions(records: list[RequestRecord], duration_s: float, slo: SLO | None = None,
                     window_start_ns: int = 0, roles: tuple[str, ...] = ("measure",)) -> dict[str, dict[str, Any]]:
    """``{"sglang": summary, "vllm": summary}`` of the same records."""
    return {d: summarize(records, duration_s, d, slo, window_start_ns, roles) for d in DEFINITIONS}


def side_by_side(summaries: dict[str, dict[str, Any]],
                 keys: tuple[str, ...] = ("completed", "failed", "total_input_tokens", "total_output_tokens",
                                          "request_throughput", "output_throughput", "total_token_throughput",
                                          "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                                          "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms",
                                          "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")
                 ) -> pd.DataFrame:
    """A metric × definition table (rows: metric; columns: ``sglang``, ``vllm``)."""
    return pd.DataFrame({d: [s.get(k) for k in keys] for d, s in summaries.items()}, index=list(keys))
