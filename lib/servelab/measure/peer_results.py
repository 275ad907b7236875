"""Peer tools' result files into one summary table, and ours out with vLLM-compatible keys.

Readers key on field *presence*, not tool versions (these tools change weekly):

- SGLang ``bench_serving`` JSONL (one object per run; ``e2e_latency``, ``total_throughput``, no ``failed``);
- ``vllm bench serve`` JSON (``--save-result``; one object, or newline-separated with ``--append-result``;
  ``e2el``, ``total_token_throughput``, ``p{P}_*`` for any percentile list);
- AIPerf ``profile_export_aiperf.json`` (``{tag: {unit, avg, p50, ...}}``; its ``inter_token_latency`` is
  vLLM's *TPOT* and its ``inter_chunk_latency`` is vLLM's ITL — mapped accordingly);
- guidellm ``benchmarks.json`` (``benchmarks[].metrics.<name>.successful.{mean, median, percentiles}``; its
  ``inter_token_latency_ms`` ≈ vLLM TPOT, its ``time_per_output_token_ms`` includes TTFT and is *not* TPOT;
  its percentiles are nearest-rank, not interpolated).

Every row says its ``tool`` and ``definition`` so numbers of different definitions are never silently mixed.
Common columns are those of ``COLUMNS`` (ms, tokens, per second). Each row also carries the workload *shape* as far
as the file states it — ``input_len``, ``output_len`` (tokens per request), ``concurrency``, ``request_rate``,
``num_prompts`` — and ``shape_source`` says where each came from: ``stated`` (the tool's own setting, e.g. SGLang's
``random_input_len``), ``from totals`` (total tokens / completed requests: what was achieved, not asked for), or
``from completed`` (SGLang writes no prompt count: completed requests stand in).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.measure.request_metrics import SGLANG_BENCH, VLLM_BENCH

COLUMNS = ["tool", "definition", "file", "run", "label", "input_len", "output_len", "num_prompts", "shape_source",
           "concurrency", "request_rate", "duration_s", "completed",
           "failed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
           "total_token_throughput", "request_goodput",
           *[f"{st}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for st in ("mean", "median", "p90", "p95", "p99")]]


EXPECTED = ("an SGLang bench_serving JSONL, a `vllm bench serve` JSON, an AIPerf profile_export_aiperf.json or a "
            "guidellm benchmarks.json")


class ImportFormatError(ValueError):
    """A result file is not one of the known formats (the message names the file and what was missing)."""


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, str):
        if x in ("inf", "Infinity"):
            return float("inf")
        try:
            return float(x)
        except ValueError:
            return None
    return float(x)


def _read_json_objects(path: Path) -> list[dict[str, Any]]:
    """One JSON object, or newline-separated objects (sglang JSONL, vllm --append-result)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ImportFormatError(f"{path}: not a text file; expected {EXPECTED}") from None
    except OSError as exc:
        raise ImportFormatError(f"{path}: cannot be read ({exc.strerror or exc}); expected {EXPECTED}") from None
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, list) else [obj]
    except json.JSONDecodeError:
        pass
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ImportFormatError(f"{path}:{no}: not JSON ({exc.msg}); expected {EXPECTED}") from None
    return out


def detect_format(obj: dict[str, Any]) -> str:
    """The tool that wrote a result object, from the keys present: ``sglang bench_serving`` | ``vllm bench serve`` |
    ``aiperf`` | ``guidellm`` | ``servelab`` (our own numbers under vllm bench serve's keys)."""
    if "benchmarks" in obj and isinstance(obj["benchmarks"], list):
        return "guidellm"
    if "time_to_first_token" in obj and isinstance(obj["time_to_first_token"], dict):
        return "aiperf"
    if obj.get("servelab_definition"):
        return "servelab"
    if "mean_e2e_latency_ms" in obj or "total_throughput" in obj:
        return "sglang bench_serving"
    if "mean_e2el_ms" in obj or "total_token_throughput" in obj:
        return "vllm bench serve"
    raise ImportFormatError(f"unknown result format: expected {EXPECTED}; none of their keys is present "
                            f"(keys: {', '.join(sorted(map(str, obj))[:8]) or 'none'})")


def _obj(x: Any) -> dict[str, Any]:
    """``x`` if it is a JSON object, else ``{}`` (an optional section of another type is read as absent)."""
    return x if isinstance(x, dict) else {}


def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _row(**kw: Any) -> dict[str, Any]:
    return {c: kw.get(c) for c in COLUMNS}


def _per_request(total: Any, n: Any) -> float | None:
    total, n = _num(total), _num(n)
    return total / n if total is not None and n else None


def _shape(stated: dict[str, Any], totals: dict[str, Any], prompts: Any, prompts_how: str) -> dict[str, Any]:
    """``input_len``, ``output_len``, ``num_prompts`` and ``shape_source`` from what the file states, falling back
    to per-request means of its totals (``totals``: name → (total tokens, completed))."""
    out: dict[str, Any] = {}
    how = []
    for key in ("input_len", "output_len"):
        v = _num(stated.get(key))
        if v is not None:
            out[key], src = v, "stated"
        else:
            out[key], src = _per_request(*totals.get(key, (None, None))), "from totals"
            if out[key] is None:
                src = "unknown"
        how.append(f"{key.split('_')[0]}: {src}")
    out["num_prompts"] = _num(prompts)
    how.append(f"prompts: {prompts_how if out['num_prompts'] is not None else 'unknown'}")
    out["shape_source"] = "; ".join(how)
    return out


def sglang_shape(obj: dict[str, Any]) -> dict[str, Any]:
    """SGLang states its requested lengths for the random datasets with ``random_range_ratio`` 1 (fixed lengths)
    and for ShareGPT with a fixed output length; it writes no prompt count (completed requests stand in)."""
    stated: dict[str, Any] = {}
    ds = str(obj.get("dataset_name") or "")
    if ds.startswith("random") and _num(obj.get("random_range_ratio")) == 1.0:
        stated = {"input_len": obj.get("random_input_len"), "output_len": obj.get("random_output_len")}
    elif obj.get("sharegpt_output_len") is not None:
        stated = {"output_len": obj.get("sharegpt_output_len")}
    n = obj.get("completed")
    return _shape(stated, {"input_len": (obj.get("total_input_tokens"), n),
                           "output_len": (obj.get("total_output_tokens"), n)}, n, "from completed")


def vllm_shape(obj: dict[str, Any]) -> dict[str, Any]:
    """``vllm bench serve`` states ``num_prompts``; lengths only as totals (or ``--metadata`` keys of ours)."""
    n = obj.get("completed")
    stated = {"input_len": obj.get("random_input_len") or obj.get("input_len"),
              "output_len": obj.get("random_output_len") or obj.get("output_len")}
    prompts = obj.get("num_prompts")
    how = "stated"
    if prompts is None and n is not None:
        prompts, how = (_num(n) or 0) + (_num(obj.get("failed")) or 0), "from completed"
    return _shape(stated, {"input_len": (obj.get("total_input_tokens"), n),
                           "output_len": (obj.get("total_output_tokens"), n)}, prompts, how)


def aiperf_shape(obj: dict[str, Any], load: dict[str, Any], count: float | None, failed: float | None
                 ) -> dict[str, Any]:
    """AIPerf states the synthetic ISL/OSL means (``input_config.datasets[].prompts`` in 0.13, older
    ``input_config.input.prompt``) and the request count of its profiling phase."""
    cfg = obj.get("input_config") or {}
    stated: dict[str, Any] = {}
    for d in _list(cfg.get("datasets")):
        pr = _obj(_obj(d).get("prompts"))
        stated = {"input_len": _obj(pr.get("isl")).get("mean"), "output_len": _obj(pr.get("osl")).get("mean")}
        break
    if not stated:
        pr = _obj(_obj(cfg.get("input")).get("prompt"))
        stated = {"input_len": _obj(pr.get("input_tokens")).get("mean"),
                  "output_len": _obj(pr.get("output_tokens")).get("mean")}
    for key, v in stated.items():
        _aiperf_number("input_config (synthetic prompts)", key, v)
    prompts, how = load.get("requests") or load.get("request_count"), "stated"
    if prompts is None and count is not None:
        prompts, how = count + (failed or 0), "from completed"

    def avg(tag: str) -> float | None:
        m = obj.get(tag)
        return _num(m.get("avg")) if isinstance(m, dict) else None
    return _shape(stated, {"input_len": (avg("input_sequence_length"), 1), "output_len": (avg("output_sequence_length"), 1)},
                  prompts, how)


def guidellm_shape(obj: dict[str, Any], bench: dict[str, Any]) -> dict[str, Any]:
    """guidellm states the synthetic data's token counts (``config.spec.data[]``) and a ``max_requests``
    constraint; otherwise the benchmark's mean token counts and its request total."""
    spec = ((obj.get("config") or {}).get("spec")) or {}
    stated: dict[str, Any] = {}
    for d in spec.get("data") or []:
        if isinstance(d, dict) and (d.get("prompt_tokens_stdev") in (None, 0)) and (d.get("output_tokens_stdev") in (None, 0)):
            stated = {"input_len": d.get("prompt_tokens"), "output_len": d.get("output_tokens")}
        break
    prompts, how = None, "stated"
    for c in spec.get("constraints") or []:
        if isinstance(c, dict) and c.get("kind") == "max_requests":
            prompts = c.get("count")
    m = bench.get("metrics") or {}
    if prompts is None:
        prompts, how = (m.get("request_totals") or {}).get("total"), "from the request total"

    def mean(name: str) -> float | None:
        return _num((((m.get(name) or {}).get("successful")) or {}).get("mean"))
    return _shape(stated, {"input_len": (mean("prompt_token_count"), 1), "output_len": (mean("output_token_count"), 1)},
                  prompts, how)


def from_sglang(obj: dict[str, Any], file: str = "", run: int = 0) -> dict[str, Any]:
    """One SGLang bench_serving JSONL object → a row (definition ``sglang``)."""
    lat = {}
    for m_ours, m_theirs in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e_latency")):
        for st in ("mean", "median", "p90", "p95", "p99"):
            lat[f"{st}_{m_ours}_ms"] = _num(obj.get(f"{st}_{m_theirs}_ms"))
    return _row(tool="sglang bench_serving", definition=SGLANG_BENCH, file=file, run=run, label=obj.get("tag"),
                **sglang_shape(obj),
                concurrency=_num(obj.get("max_concurrency")), request_rate=_num(obj.get("request_rate")),
                duration_s=_num(obj.get("duration")), completed=_num(obj.get("completed")), failed=None,
                total_input_tokens=_num(obj.get("total_input_tokens")),
                total_output_tokens=_num(obj.get("total_output_tokens")),
                request_throughput=_num(obj.get("request_throughput")),
                output_throughput=_num(obj.get("output_throughput")),
                total_token_throughput=_num(obj.get("total_throughput")), request_goodput=None, **lat)


def from_vllm(obj: dict[str, Any], file: str = "", run: int = 0, tool: str = "vllm bench serve",
              definition: str = VLLM_BENCH) -> dict[str, Any]:
    """One ``vllm bench serve`` result object → a row (definition ``vllm``)."""
    lat = {}
    for m in ("ttft", "tpot", "itl", "e2el"):
        for st in ("mean", "median", "p90", "p95", "p99"):
            lat[f"{st}_{m}_ms"] = _num(obj.get(f"{st}_{m}_ms"))
    return _row(tool=tool, definition=definition, file=file, run=run, label=obj.get("label"), **vllm_shape(obj),
                concurrency=_num(obj.get("max_concurrency")), request_rate=_num(obj.get("request_rate")),
                duration_s=_num(obj.get("duration")), completed=_num(obj.get("completed")),
                failed=_num(obj.get("failed")), total_input_tokens=_num(obj.get("total_input_tokens")),
                total_output_tokens=_num(obj.get("total_output_tokens")),
                request_throughput=_num(obj.get("request_throughput")),
                output_throughput=_num(obj.get("output_throughput")),
                total_token_throughput=_num(obj.get("total_token_throughput")),
                request_goodput=_num(obj.get("request_goodput")), **lat)


_UNIT_TO_MS = {"ms": 1.0, "milliseconds": 1.0, "ns": 1e-6, "nanoseconds": 1e-6, "us": 1e-3, "s": 1000.0,
               "sec": 1000.0, "seconds": 1000.0}


_AIPERF_TIME_TAGS = ("time_to_first_token", "inter_token_latency", "inter_chunk_latency", "request_latency")


def _aiperf_number(tag: str, key: str, v: Any) -> float | None:
    """One AIPerf statistic: a number, a numeric string (``"12.5"``), or null/absent (→ None); anything else is
    an :class:`ImportFormatError` naming the field."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ImportFormatError(f"AIPerf field {tag}.{key} is {type(v).__name__} {json.dumps(v)[:40]}, not a number")
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            raise ImportFormatError(f"AIPerf field {tag}.{key} is the string {v[:40]!r}, not a number") from None
    return float(v)


def _aiperf_section(obj: dict[str, Any], tag: str, kind: type, default: Any) -> Any:
    v = obj.get(tag)
    if v is None:
        return default
    if not isinstance(v, kind):
        raise ImportFormatError(f"AIPerf field {tag} is {type(v).__name__}, expected {kind.__name__}")
    return v


def from_aiperf(obj: dict[str, Any], file: str = "") -> dict[str, Any]:
    """AIPerf ``profile_export_aiperf.json`` → a row (definition ``aiperf``: ITL↔TPOT renamed to ours).

    Statistics may be null (missing) or numeric strings; a statistic that is not a number, a latency with values
    but no unit or an unknown unit, or a section of the wrong type raises :class:`ImportFormatError` (one line
    naming the field), never a traceback."""
    def metric(tag: str) -> dict[str, float | None]:
        m = obj.get(tag)
        if m is None:
            return {}
        if not isinstance(m, dict):
            raise ImportFormatError(f"AIPerf field {tag} is {type(m).__name__}, expected an object "
                                    "{unit, avg, p50, ...}")
        vals = {st: _aiperf_number(tag, key, m.get(key))
                for st, key in (("mean", "avg"), ("median", "p50"), ("p90", "p90"), ("p95", "p95"), ("p99", "p99"))}
        if all(v is None for v in vals.values()):
            return {}
        unit = m.get("unit")
        if unit is None or str(unit).strip() == "":
            raise ImportFormatError(f"AIPerf field {tag} has values but no unit; expected one of "
                                    f"{', '.join(sorted(_UNIT_TO_MS))}")
        f = _UNIT_TO_MS.get(str(unit).strip().lower())
        if f is None:
            raise ImportFormatError(f"AIPerf field {tag} has unit {str(unit)[:20]!r}; expected one of "
                                    f"{', '.join(sorted(_UNIT_TO_MS))}")
        return {k: (v * f if v is not None else None) for k, v in vals.items()}
    lat = {}
    for ours, tag in (("ttft", "time_to_first_token"), ("tpot", "inter_token_latency"),
                      ("itl", "inter_chunk_latency"), ("e2el", "request_latency")):
        m = metric(tag)
        for st in ("mean", "median", "p90", "p95", "p99"):
            lat[f"{st}_{ours}_ms"] = m.get(st)

    def avg(tag: str) -> float | None:
        m = obj.get(tag)
        if m is None:
            return None
        if not isinstance(m, dict):
            raise ImportFormatError(f"AIPerf field {tag} is {type(m).__name__}, expected an object {{unit, avg}}")
        return _aiperf_number(tag, "avg", m.get("avg"))
    cfg = _aiperf_section(obj, "input_config", dict, {})
    raw_phases = cfg.get("phases") or []
    if not isinstance(raw_phases, list) or not all(isinstance(ph, dict) for ph in raw_phases):
        raise ImportFormatError("AIPerf field input_config.phases is not a list of objects")
    phases = [ph for ph in raw_phases if ph.get("kind", "profiling") == "profiling"]
    load = phases[0] if phases else (cfg.get("loadgen") or {})
    if not isinstance(load, dict):
        raise ImportFormatError(f"AIPerf field input_config.loadgen is {type(load).__name__}, expected an object")
    errs = _aiperf_section(obj, "error_summary", list, None)
    failed = None
    if errs is not None:
        failed = 0.0
        for i, e in enumerate(errs):
            if not isinstance(e, dict):
                raise ImportFormatError(f"AIPerf field error_summary[{i}] is {type(e).__name__}, expected an object")
            failed += _aiperf_number(f"error_summary[{i}]", "count", e.get("count")) or 0.0
    count = avg("completed_request_count") if avg("completed_request_count") is not None else avg("request_count")
    total_in = avg("total_isl")
    total_out = avg("total_osl")
    if total_in is None and avg("input_sequence_length") is not None and count is not None:
        total_in = avg("input_sequence_length") * count
    if total_out is None and avg("output_sequence_length") is not None and count is not None:
        total_out = avg("output_sequence_length") * count
    for k in ("concurrency", "request_rate", "requests", "request_count"):
        _aiperf_number("input_config (profiling phase)", k, load.get(k))
    return _row(tool="aiperf", definition="aiperf", file=file, run=0, label=None,
                **aiperf_shape(obj, load, count, failed),
                concurrency=_num(load.get("concurrency")), request_rate=_num(load.get("request_rate")),
                duration_s=avg("benchmark_duration"), completed=count, failed=failed,
                total_input_tokens=total_in, total_output_tokens=total_out,
                request_throughput=avg("request_throughput"), output_throughput=avg("output_token_throughput"),
                total_token_throughput=avg("total_token_throughput"), request_goodput=avg("goodput"), **lat)


def from_guidellm(obj: dict[str, Any], file: str = "") -> list[dict[str, Any]]:
    """guidellm ``benchmarks.json`` → one row per benchmark (definition ``guidellm``)."""
    rows = []
    for i, b in enumerate(obj.get("benchmarks") or []):
        m = b.get("metrics") or {}

        def dist(name: str, scale: float = 1.0, m: dict[str, Any] = m) -> dict[str, float | None]:
            d = ((m.get(name) or {}).get("successful")) or {}
            pct = d.get("percentiles") or {}
            def s(v: Any) -> float | None:
                v = _num(v)
                return v * scale if v is not None else None
            return {"mean": s(d.get("mean")), "median": s(d.get("median")), "p90": s(pct.get("p90")),
                    "p95": s(pct.get("p95")), "p99": s(pct.get("p99")), "total_sum": _num(d.get("total_sum"))}
        lat = {}
        for ours, name, scale in (("ttft", "time_to_first_token_ms", 1.0), ("tpot", "inter_token_latency_ms", 1.0),
                                  ("e2el", "request_latency", 1000.0)):
            d = dist(name, scale)
            for st in ("mean", "median", "p90", "p95", "p99"):
                lat[f"{st}_{ours}_ms"] = d[st]
        totals = m.get("request_totals") or {}
        sched = b.get("scheduler_state") or {}
        cfg = b.get("config") or {}
        strat = cfg.get("strategy") or {}
        dur = _num(b.get("duration"))
        if dur is None and sched.get("end_time") is not None and sched.get("start_time") is not None:
            dur = _num(sched["end_time"]) - _num(sched["start_time"])
        rows.append(_row(tool="guidellm", definition="guidellm", file=file, run=i, label=strat.get("type_"),
                         **guidellm_shape(obj, b),
                         concurrency=_num(strat.get("streams") or strat.get("max_concurrency")),
                         request_rate=_num(strat.get("rate")), duration_s=dur,
                         completed=_num(totals.get("successful")), failed=_num(totals.get("errored")),
                         total_input_tokens=dist("prompt_token_count")["total_sum"],
                         total_output_tokens=dist("output_token_count")["total_sum"],
                         request_throughput=dist("requests_per_second")["mean"],
                         output_throughput=dist("output_tokens_per_second")["mean"],
                         total_token_throughput=dist("tokens_per_second")["mean"], request_goodput=None, **lat))
    return rows


def import_file(path: str | Path) -> pd.DataFrame:
    """Any supported result file → rows of the common table (one per run/benchmark in the file)."""
    path = Path(path)
    if not path.exists():
        raise ImportFormatError(f"{path}: no such file; expected {EXPECTED}")
    objs = _read_json_objects(path)
    if not objs:
        raise ImportFormatError(f"{path}: empty; expected {EXPECTED}")
    rows: list[dict[str, Any]] = []
    for i, obj in enumerate(objs):
        if not isinstance(obj, dict):
            raise ImportFormatError(f"{path}: object {i} is not a JSON object; expected {EXPECTED}")
        kind = "result"
        try:
            kind = detect_format(obj)
            rows.extend(_convert(kind, obj, path, i))
        except ImportFormatError as exc:
            raise ImportFormatError(f"{path}: {exc}") from None
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
            # a field of a type no reader expects: one line naming the file, never a traceback
            raise ImportFormatError(f"{path}: a field of an unexpected type in this {kind} result "
                                    f"({type(exc).__name__}: {exc}); expected {EXPECTED}") from None
    return pd.DataFrame(rows, columns=COLUMNS)


def _convert(kind: str, obj: dict[str, Any], path: Path, i: int) -> list[dict[str, Any]]:
    """One object of a result file of ``kind`` → its rows."""
    if kind == "sglang bench_serving":
        return [from_sglang(obj, str(path), i)]
    if kind in ("vllm bench serve", "servelab"):
        d = obj.get("servelab_definition")
        return [from_vllm(obj, str(path), i, tool="servelab" if d else "vllm bench serve", definition=d or VLLM_BENCH)]
    if kind == "aiperf":
        return [from_aiperf(obj, str(path))]
    return from_guidellm(obj, str(path))


def import_files(paths: list[str | Path]) -> pd.DataFrame:
    """Several result files into one table."""
    frames = [import_file(p) for p in paths]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def to_vllm_keys(summary: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our summary (one definition) with ``vllm bench serve`` key names, plus ``servelab_definition``.

    ``p{P}_{metric}_ms`` for P in 50/90/95/99, ``{mean,median,std}_{metric}_ms``; sglang-only extras
    (``input_throughput``, ``total_throughput``) are kept too so SGLang readers find theirs.
    """
    out: dict[str, Any] = {"servelab_definition": summary["definition"], "endpoint_type": "openai",
                           "backend": "servelab", "duration": summary["duration_s"], "completed": summary["completed"],
                           "failed": summary["failed"], "total_input_tokens": summary["total_input_tokens"],
                           "total_output_tokens": summary["total_output_tokens"],
                           "request_throughput": summary["request_throughput"],
                           "request_goodput": summary.get("request_goodput"),
                           "output_throughput": summary["output_throughput"],
                           "total_token_throughput": summary["total_token_throughput"],
                           "input_throughput": summary["input_throughput"],
                           "total_throughput": summary["total_token_throughput"]}
    for m in ("ttft", "tpot", "itl", "e2el"):
        for st in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
            out[f"{st}_{m}_ms"] = summary.get(f"{st}_{m}_ms")
        out[f"max_{m}_ms"] = summary.get(f"max_{m}_ms")
    out.update(extra or {})
    return out


def write_vllm_json(path: str | Path, summary: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_vllm_keys(summary, extra), indent=2, default=str))
    return path
