"""The memory layer of a case (``docs/metrics.md#memory``): weights, KV pool and its peak use, graphs, workspace
peak and allocated vs reserved (fragmentation), beside the output throughput they limit — each number with the
source it was read from, and ``not exposed`` where this engine gives none.

Three kinds of source, all real output of the engine, read where the engine has them (its adapter names the
series and lines: ``memory_series``, ``memory_info``, ``memory_log_lines``):

- **its ``/metrics``**, scraped during the case (``server/metrics.parquet``): constants the engine sets once at
  start (SGLang 0.5.23: ``sglang:weight_memory_usage_gb``, ``sglang:kv_cache_memory_usage_gb``,
  ``sglang:graph_memory_usage_gb``, ``sglang:max_total_num_tokens``; vLLM: the labels of
  ``vllm:cache_config_info``) and gauges whose peak over the case's scrapes is taken (``sglang:kv_used_tokens``,
  ``sglang:kv_available_tokens``, ``sglang:token_usage``, ``vllm:kv_cache_usage_perc``). A gauge peak is a lower
  bound: the engine updates it at its own interval and the scraper samples it at its own;
- **its log**: the start-up lines (SGLang ``Load weight end ... mem usage=X GB``, ``KV Cache is allocated ...
  #tokens: N, K size: X GB, V size: Y GB``; vLLM ``KV cache size: N tokens``; llama.cpp at ``-lv 4`` its model,
  KV and compute buffers) and, for the KV in use, the scheduler lines of the case's log excerpt. The start-up lines
  have one reader (:func:`startup_lines`): these quantities and the memory breakdown table Phases 1 and 8 show
  (:func:`memory_breakdown`, one row per line the engine printed) are both built from it;
- **a capture's memory events**: torch's profiler with ``profile_memory`` writes ``[memory]`` events whose
  ``Total Allocated`` / ``Total Reserved`` are the caching allocator's totals on that device — the allocated and
  reserved peaks and the share of reserved memory not allocated at the allocated peak (fragmentation). Only a
  profiled case (a ``<case>--profile-*`` capture) has them.

Per rank or device the largest value is reported (memory is limited per device): SGLang's gauges carry one series
per ``tp_rank``/``pp_rank`` (CUDA-graph memory one per ``phase``, summed), its log one line per rank. SGLang's "GB"
is 2^30 bytes (its ``get_available_gpu_memory`` divides by ``1 << 30``); every size here is in GiB.
"""
from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from servelab.deploy.engines import engine_for
from servelab.measure import request_metrics as mx
from servelab.measure.engine_metrics import split_labels

GIB = float(2**30)
NOT_EXPOSED = "not exposed by this engine (its /metrics and log)"
NOT_TRACED = ("not exposed: no capture of these cases holds torch memory events (a profiled case with profile_memory, "
              "e.g. vLLM's profiler config torch_profiler_with_memory)")
TRACE_QUANTITIES = ("allocated_peak_gib", "reserved_peak_gib", "fragmentation_pct")


@dataclass(frozen=True)
class Quantity:
    key: str
    column: str             # the page's column: its unit in the header
    meaning: str


QUANTITIES: tuple[Quantity, ...] = (
    Quantity("weights_gib", "weights (GiB)", "memory the model's weights took at load"),
    Quantity("kv_pool_tokens", "KV pool (tokens)", "tokens the KV cache can hold (its capacity)"),
    Quantity("kv_pool_gib", "KV pool (GiB)", "memory of the KV cache pool"),
    Quantity("kv_used_peak_tokens", "KV used peak (tokens)", "most tokens held by running requests during the case"),
    Quantity("kv_held_peak_tokens", "KV held peak (tokens)",
             "most pool tokens not free during the case (running requests and prefix-cache entries)"),
    Quantity("kv_usage_peak_pct", "KV usage peak (%)",
             "the KV peak against the pool: used ÷ pool where both are token counts, else the engine's usage gauge"),
    Quantity("graphs_gib", "graphs (GiB)", "memory of captured CUDA graphs"),
    Quantity("workspace_peak_gib", "workspace peak (GiB)", "temporary buffers of a forward step at their largest"),
    Quantity("allocated_peak_gib", "allocated peak (GiB)", "torch caching allocator: allocated bytes at their peak"),
    Quantity("reserved_peak_gib", "reserved peak (GiB)", "torch caching allocator: reserved bytes at their peak"),
    Quantity("fragmentation_pct", "reserved not allocated (%)",
             "share of reserved memory not allocated at the allocated peak: (reserved − allocated) / reserved"),
)
COLUMNS = {q.key: q.column for q in QUANTITIES}


# ---------------------------------------------------------------- /metrics

def _split(key: Any) -> dict[str, str]:
    return split_labels(str(key or ""))


def metric_memory(frame: pd.DataFrame | None, adapter: Any) -> dict[str, tuple[float, str]]:
    """``{quantity: (value, source)}`` from a case's scraped ``/metrics`` (``metrics.parquet``: ts_ns, name, labels,
    value) as the adapter's ``memory_series`` and ``memory_info`` name them."""
    out: dict[str, tuple[float, str]] = {}
    if frame is None or frame.empty:
        return out
    for key, (series, how, scale) in (adapter.memory_series or {}).items():
        s = frame[frame["name"] == series]
        if s.empty:
            continue
        s = s.assign(rank=s["labels"].map(lambda k: ",".join(f"{a}={b}" for a, b in sorted(_split(k).items())
                                                             if a != "phase")))
        per_ts = s.groupby(["rank", "ts_ns"])["value"].sum()         # a series per phase label: summed
        if how == "last":
            v = per_ts.groupby(level="rank").last().max()
            src = f"{series} (/metrics, set once at start)"
        elif how == "max":
            v = per_ts.groupby(level="rank").max().max()
            src = f"{series} (/metrics gauge, highest of the case's scrapes)"
        else:                                                         # min: the tightest moment
            v = per_ts.groupby(level="rank").min().min()
            src = f"{series} (/metrics gauge, lowest of the case's scrapes)"
        out[key] = (float(v) * scale, src + (" × 100" if scale == 100.0 else ""))
    if adapter.memory_info:
        series, labels = adapter.memory_info
        s = frame[frame["name"] == series]
        if not s.empty:
            lab = _split(s.iloc[-1]["labels"])
            for key, (label, scale) in labels.items():
                try:
                    out.setdefault(key, (float(lab[label]) * scale, f"{series}{{{label}}} (/metrics)"))
                except (KeyError, ValueError):
                    continue
    if "kv_pool_tokens" in out and "kv_free_min_tokens" in out:
        pool, free = out["kv_pool_tokens"][0], out.pop("kv_free_min_tokens")
        out["kv_held_peak_tokens"] = (pool - free[0], f"pool − lowest free: {out['kv_pool_tokens'][1].split(' ')[0]} − "
                                                      f"{free[1]}")
    out.pop("kv_free_min_tokens", None)
    return out


# ---------------------------------------------------------------- the engine's start-up log

@dataclass(frozen=True)
class StartupLine:
    """One start-up line a pattern matched: the pattern's key, its named groups as the engine printed them, the line
    from the match on (a restart prints the same text behind a new time stamp) and the whole line."""
    key: str
    groups: dict[str, str | None]
    text: str
    line: str

    def numbers(self) -> list[float]:
        """The groups that matched, as numbers (``524,288`` → 524288)."""
        return [float(v.replace(",", "")) for v in self.groups.values() if v is not None]


def startup_lines(log_text: str, patterns: Iterable[tuple[str, str]]) -> list[list[StartupLine]]:
    """The one reader of the engine's start-up memory lines: per ``(key, regex)`` pattern, every line of
    ``log_text`` it matches, in the log's order. The memory layer's quantities (:func:`log_memory`) and the
    breakdown table (:func:`memory_breakdown`) are both built from it."""
    lines = log_text.splitlines()
    return [[StartupLine(key, m.groupdict(), line[m.start():].strip(), line) for line in lines
             if (m := re.search(rx, line))] for key, rx in patterns]


def log_memory(log_text: str, adapter: Any) -> dict[str, tuple[float, str]]:
    """``{quantity: (value, source)}`` from the engine's start-up lines (the adapter's ``memory_log_lines``: each
    regex's named groups summed, or multiplied with ``how="product"``; several matching lines — ranks, devices, KV
    groups — combined by ``agg``: ``max`` per rank, ``sum`` over a rank's buffers)."""
    out: dict[str, tuple[float, str]] = {}
    if not log_text:
        return out
    found = startup_lines(log_text, [(key, rx) for key, rx, *_ in adapter.memory_log_lines])
    for (key, _rx, scale, how, agg), matched in zip(adapter.memory_log_lines, found):
        seen: dict[str, float] = {}
        for s in matched:
            nums = s.numbers()
            if not nums:
                continue
            val = math.prod(nums) if how == "product" else sum(nums)
            seen[s.text] = val * scale                            # the same line of a restart counts once
        if seen:
            vals = list(seen.values())
            first = next(iter(seen))
            out[key] = (max(vals) if agg == "max" else sum(vals),
                        f"engine log: \"{first[:110]}{'…' if len(first) > 110 else ''}\""
                        + (f" ({len(vals)} such lines, {'largest' if agg == 'max' else 'summed'})" if len(vals) > 1
                           else ""))
    return out


# the breakdown of an engine that prints no buffer lines (its adapter has no ``memory_log_patterns``): its start-up
# quantities (``memory_log_lines``) as printed — quantity → (component, the printed value's name, MiB per unit)
PRINTED_QUANTITIES: dict[str, tuple[str, str, float | None]] = {
    "weights_gib": ("weights", "mem_gb", 1024.0), "kv_pool_tokens": ("KV cache", "tokens", None),
    "graphs_gib": ("CUDA graphs", "mem_gb", 1024.0)}


def memory_breakdown(log_text: str, adapter: Any) -> pd.DataFrame:
    """The memory components the engine printed at start-up, one row per line (Phase 1's and Phase 8's table):
    ``component, device, mib, detail, line``.

    Where the adapter names the engine's own memory lines (``memory_log_patterns``: llama.cpp at ``-lv 4``, its
    breakdown, model / output / compute buffers and KV cache) those, else the start-up quantities it prints (SGLang's
    weights, KV tokens and CUDA graphs, vLLM's KV tokens: :data:`PRINTED_QUANTITIES`), read from the same lines as
    :func:`log_memory`. Nothing found: one row ``not exposed`` (llama.cpp needs ``-lv 4`` for these lines).
    """
    rows: list[dict[str, Any]] = []
    if adapter.memory_log_patterns:
        for (comp, _rx), matched in zip(adapter.memory_log_patterns, startup_lines(log_text,
                                                                                   adapter.memory_log_patterns)):
            for s in matched:
                d, line = s.groups, s.line.strip()[-200:]
                if comp.startswith("breakdown"):
                    for part in ("model", "context", "compute"):
                        rows.append({"component": f"{part} (breakdown)", "device": d["dev"], "mib": float(d[part]),
                                     "detail": f"total {d['total']} MiB", "line": line})
                    continue
                detail = ""
                if comp == "KV cache":
                    detail = (f"{d['cells']} cells per sequence, {d['layers']} layers, {d['seqs']} seqs, "
                              f"K {d['kdt']} {d['k']} MiB, V {d['vdt']} {d['v']} MiB")
                rows.append({"component": comp, "device": d.get("dev", "-"), "mib": float(d["mib"]),
                             "detail": detail, "line": line})
    else:
        printed = [(key, rx) for key, rx, *_ in adapter.memory_log_lines if key in PRINTED_QUANTITIES]
        for (key, _rx), matched in zip(printed, startup_lines(log_text, printed)):
            comp, unit, mib_per = PRINTED_QUANTITIES[key]
            for s in matched:
                v = next(iter(s.groups.values()), None)
                rows.append({"component": comp, "device": "-", "mib": float(v) * mib_per if mib_per and v else None,
                             "detail": f"{unit}={v}", "line": s.line.strip()[-200:]})
    if not rows:
        return pd.DataFrame([{"component": "all", "device": "-", "mib": None,
                              "detail": "not exposed in the engine log" +
                                        (f" ({adapter.memory_log_note})" if adapter.memory_log_note else ""),
                              "line": ""}])
    return pd.DataFrame(rows).drop_duplicates(subset=["component", "device", "mib", "detail"]).reset_index(drop=True)


def scheduler_memory(excerpt: str, adapter: Any, pool_tokens: float | None = None) -> dict[str, tuple[float, str]]:
    """KV in use from the scheduler lines of a case's log excerpt (the adapter's ``scheduler_log``): the highest
    ``kv_tokens`` (SGLang's ``#token``) and ``kv_usage`` (its ``token usage``, a fraction) seen."""
    out: dict[str, tuple[float, str]] = {}
    toks, usage = [], []
    for line in (excerpt or "").splitlines():
        f = adapter.parse_scheduler_line(line)
        if not f:
            continue
        if isinstance(f.get("kv_tokens"), float):
            toks.append(f["kv_tokens"])
        if isinstance(f.get("kv_usage"), float):
            usage.append(f["kv_usage"])
    if toks:
        out["kv_used_peak_tokens"] = (max(toks), "engine log: the scheduler lines' tokens in use, highest")
    if usage:
        out["kv_usage_peak_pct"] = (100.0 * max(usage), "engine log: the scheduler lines' token usage, highest × 100")
    return out


# ---------------------------------------------------------------- a capture's memory events

_MEMORY_EVENT = re.compile(r'"name":\s*"\[memory\]".*?"args":\s*(\{[^{}]*\})', re.DOTALL)


def memory_events(path: Path) -> pd.DataFrame:
    """The ``[memory]`` events of a Kineto trace (``.json`` or ``.json.gz``): ts_us, device_type, device,
    allocated, reserved, bytes (the event's own allocation, negative for a free)."""
    p = Path(path)
    raw = gzip.open(p, "rt", errors="replace").read() if p.suffix == ".gz" else p.read_text(errors="replace")
    rows = []
    for m in _MEMORY_EVENT.finditer(raw):
        try:
            a = json.loads(m.group(1))
        except ValueError:
            continue
        ts = re.search(r'"ts":\s*([\d.]+)', raw[max(0, m.start() - 200):m.end()])
        rows.append({"ts_us": float(ts.group(1)) if ts else None, "device_type": int(a.get("Device Type", -1)),
                     "device": int(a.get("Device Id", -1)), "allocated": float(a.get("Total Allocated", 0)),
                     "reserved": float(a.get("Total Reserved", 0)), "bytes": float(a.get("Bytes", 0))})
    return pd.DataFrame(rows, columns=["ts_us", "device_type", "device", "allocated", "reserved", "bytes"])


def trace_memory(paths: Iterable[Path]) -> dict[str, tuple[float, str]]:
    """Allocated and reserved peaks and the fragmentation at the allocated peak, from the memory events of the
    traces in ``paths`` (the device with the highest allocated peak; CPU events, whose allocator reserves
    nothing, only where no device has any)."""
    best: tuple[float, float, float, str] | None = None
    for p in paths:
        ev = memory_events(Path(p))
        if ev.empty:
            continue
        dev = ev[ev["device_type"] != 0] if (ev["device_type"] != 0).any() else ev
        for (dtype, d), g in dev.groupby(["device_type", "device"]):
            i = g["allocated"].idxmax()
            alloc, reserved_then, reserved_peak = g.loc[i, "allocated"], g.loc[i, "reserved"], g["reserved"].max()
            if best is None or alloc > best[0]:
                where = f"{Path(p).name}: {len(g)} [memory] events of device {'cuda' if dtype == 1 else dtype}:{d}"
                best = (alloc, reserved_peak, reserved_then, where)
    if best is None:
        return {}
    alloc, reserved, reserved_then, where = best
    out = {"allocated_peak_gib": (alloc / GIB, f"capture memory events: Total Allocated, highest ({where})"),
           "reserved_peak_gib": (reserved / GIB, f"capture memory events: Total Reserved, highest ({where})")}
    if reserved_then > 0:
        out["fragmentation_pct"] = (100.0 * (reserved_then - alloc) / reserved_then,
                                    f"capture memory events: (Total Reserved − Total Allocated) / Total Reserved at "
                                    f"the allocated peak ({where})")
    return out


def case_traces(case_dir: Path) -> list[Path]:
    """The trace files of a case's captures: its own ``profiles/`` and its ``<case>--profile-*`` folders."""
    case_dir = Path(case_dir)
    folders = [case_dir / "profiles", *sorted(case_dir.parent.glob(f"{case_dir.name}--profile-*/profiles"))]
    return [f for d in folders if d.is_dir() for f in sorted(d.rglob("*.json*"))
            if f.name.endswith((".json", ".json.gz")) and ".servelab_cache" not in f.parts]


# ---------------------------------------------------------------- a case, a set of cases

def _tps_and_validity(case_dir: Path, definition: str) -> tuple[float | None, str]:
    """From the case's summary, read once: its output TPS in ``definition`` (None where absent) and its recorded
    verdict (VALID / INVALID; "—" where it has none), so an INVALID case's TPS is never shown unmarked."""
    try:
        s = json.loads((case_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None, "—"
    v = ((s.get("metrics") or {}).get(definition) or {}).get("output_throughput")
    return (float(v) if isinstance(v, (int, float)) else None), str((s.get("verdict") or {}).get("status") or "—")


def case_memory(case_dir: Path, adapter: Any | None = None, startup_log: str | None = None,
                definition: str = mx.VLLM_BENCH) -> dict[str, Any]:
    """One case's memory quantities: ``{"case", "output_tps", <quantity>: value, "sources": {quantity: source}}``.
    ``startup_log``: the engine's log from its start (default: the log ``server/engine_log_clock.json`` names).
    The first source that has a quantity wins: ``/metrics``, the start-up log, the case's scheduler lines, its
    captures' memory events."""
    case_dir = Path(case_dir)
    meta = json.loads((case_dir / "meta.json").read_text()) if (case_dir / "meta.json").is_file() else {}
    adapter = adapter or engine_for(str(meta.get("engine") or "llamacpp"))
    server = case_dir / "server"
    frame = pd.read_parquet(server / "metrics.parquet") if (server / "metrics.parquet").is_file() else None
    if startup_log is None:
        try:
            clock = json.loads((server / "engine_log_clock.json").read_text())
            startup_log = Path(clock.get("log", "")).read_text(errors="replace") if clock.get("log") else ""
        except (OSError, ValueError):
            startup_log = ""
    excerpt = (server / "engine_log_excerpt.txt").read_text(errors="replace") \
        if (server / "engine_log_excerpt.txt").is_file() else ""
    found: dict[str, tuple[float, str]] = {}
    for part in (metric_memory(frame, adapter), log_memory(startup_log or "", adapter)):
        for k, v in part.items():
            found.setdefault(k, v)
    for k, v in scheduler_memory(excerpt, adapter).items():
        found.setdefault(k, v)
    if "kv_used_peak_tokens" in found and found.get("kv_pool_tokens", (0,))[0] > 0:
        # exact where both token counts exist (SGLang rounds its token_usage gauge to 0.01)
        found["kv_usage_peak_pct"] = (100.0 * found["kv_used_peak_tokens"][0] / found["kv_pool_tokens"][0],
                                      "KV used peak ÷ KV pool (tokens) × 100")
    elif "kv_usage_peak_pct" in found and "kv_pool_tokens" in found:
        found["kv_used_peak_tokens"] = (found["kv_usage_peak_pct"][0] / 100.0 * found["kv_pool_tokens"][0],
                                        "KV usage peak × KV pool (tokens)")
    for k, v in trace_memory(case_traces(case_dir)).items():
        found.setdefault(k, v)
    tps, validity = _tps_and_validity(case_dir, definition)
    row: dict[str, Any] = {"case": case_dir.name, "output_tps": tps, "validity": validity}
    row.update({q.key: float(found[q.key][0]) if q.key in found else None for q in QUANTITIES})
    row["sources"] = {q.key: found[q.key][1] for q in QUANTITIES if q.key in found}
    return row


def memory_table(case_dirs: Iterable[Path], definition: str = mx.VLLM_BENCH, startup_log: str | None = None,
                 adapter: Any | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-case table, sources). The table: one row per case, output TPS first, then every quantity with its unit
    in the header — ``not exposed`` where no source of this engine gives it. The sources: per quantity, its
    meaning and where each number came from (``not exposed by this engine`` for none)."""
    rows = [case_memory(Path(d), adapter, startup_log, definition) for d in case_dirs if Path(d, "meta.json").is_file()]
    if not rows:
        return (pd.DataFrame({"note": ["no case folder with a meta.json: nothing to read"]}),
                pd.DataFrame(columns=["quantity", "meaning", "source"]))
    table = pd.DataFrame([{"case": r["case"], "output TPS (tok/s)": r["output_tps"], "validity": r["validity"],
                           **{COLUMNS[q.key]: r[q.key] for q in QUANTITIES}} for r in rows])
    for q in QUANTITIES:                        # a column no case has: said in words, never a zero
        col = COLUMNS[q.key]
        if table[col].isna().all():
            table[col] = "not exposed"
        else:
            table[col] = table[col].map(lambda v: round(float(v), 4) if v is not None and not pd.isna(v) else "—")
    srcs = []
    for q in QUANTITIES:
        used = sorted({r["sources"][q.key] for r in rows if q.key in r["sources"]})
        none = NOT_TRACED if q.key in TRACE_QUANTITIES else NOT_EXPOSED
        srcs.append({"quantity": q.column, "meaning": q.meaning, "source": "; ".join(used) if used else none})
    return table, pd.DataFrame(srcs)


def page_view(table: pd.DataFrame) -> pd.DataFrame:
    """The per-case memory table as a page shows it: the quantities no case has are named once in the caption
    instead of filling a column of ``not exposed`` each (the CSV keeps every column); only cases and TPS left: a
    note saying the engine exposed none of it."""
    if "case" not in table.columns:
        return table
    rows_of = ("case", "output TPS (tok/s)", "validity")
    gone = [c for c in table.columns if c not in rows_of and table[c].astype(str).eq("not exposed").all()]
    view = table.drop(columns=gone)
    if gone and not [c for c in view.columns if c not in rows_of]:
        return pd.DataFrame({"note": [f"the engine exposed none of the memory quantities for these {len(table)} "
                                      f"cases at this log level ({', '.join(gone)}); the sources table says why"]})
    if gone:
        view.attrs["caption"] = f"Not exposed by this engine here: {', '.join(gone)} (the sources table says why)."
    return view
