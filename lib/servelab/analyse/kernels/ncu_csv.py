"""``ncu --csv`` output (details or raw page) read into tidy frames, in base units; the derived per-launch
quantities (throughputs, occupancy, registers, flops per precision, DRAM bytes) and the warp stall reasons."""
from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from servelab.analyse.kernels.ranking import function_base


class NcuFormatError(ValueError):
    """An ``ncu`` CSV file whose layout is not one of the documented ones (details, raw)."""


# ---------------------------------------------------------------- the ncu CSV import

IDENTITY_COLUMNS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Kernel Time", "Context",
                    "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name")
RULE_COLUMNS = ("Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type", "Estimated Speedup")


@dataclass
class NcuReport:
    """A parsed ``ncu`` CSV: tidy metrics, the kernels, ncu's own rule advice, and what preceded the table."""
    path: str
    layout: str                      # details | raw
    metrics: pd.DataFrame            # kernel, id, section, metric, unit, value, value_base, unit_base
    kernels: pd.DataFrame            # id, kernel, function, block_size, grid_size, device, cc, process
    rules: pd.DataFrame = field(default_factory=pd.DataFrame)   # id, kernel, section, rule, type, description, speedup
    notes: list[str] = field(default_factory=list)              # ==PROF== / ==WARNING== lines


def parse_number(text: Any) -> float:
    """An ncu value as float: en-US thousands separators removed; ``n/a``/empty → NaN; non-numbers → NaN."""
    if text is None:
        return math.nan
    s = str(text).strip().replace(",", "")
    if s in ("", "n/a", "N/A", "nan", "-"):
        return math.nan
    try:
        return float(s)
    except ValueError:
        return math.nan


_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "k": 1e3}


def to_base_unit(value: float, unit: str) -> tuple[float, str]:
    """Undo ncu's SI auto-scaling (factor 1000; ncu 2025.3 writes ``ns``/``us``/``ms``, ``Kbyte``, ``Gbyte/s``,
    ``Ghz``, ``Kbyte/block``; older releases ``nsecond``/``usecond``/``byte/second``):
    ``(2.0, "Mbyte")`` → ``(2e6, "byte")``, ``(3.0, "us")`` → ``(3000, "ns")``, ``(1.2, "Tbyte/s")`` →
    ``(1.2e12, "byte/s")``, ``(1.98, "Ghz")`` → ``(1.98e9, "hz")``, ``(213.19, "Kbyte/block")`` → ``(213190, "byte/block")``.

    Time is expressed in nanoseconds (ncu's own base for ``gpu__time_duration``); other units unchanged.
    """
    u = (unit or "").strip()
    if not u or math.isnan(value):
        return value, u
    time_div = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, None: 1.0}
    m = re.fullmatch(r"([KMGTPk]?)byte(?:/(?:(n|u|m)?s(?:econd)?)|(/block))?", u)
    if m:
        v = value * _PREFIX[m.group(1)]
        if m.group(3):
            return v, "byte/block"
        if u.endswith(("/s", "second")):
            return v / time_div[m.group(2)], "byte/s"
        return v, "byte"
    m = re.fullmatch(r"(n|u|m|)s(?:econd)?", u)
    if m:
        return value * {"n": 1.0, "u": 1e3, "m": 1e6, "": 1e9}[m.group(1)], "ns"
    m = re.fullmatch(r"([KMGT]?)hz", u, re.IGNORECASE)
    if m:
        return value * _PREFIX[m.group(1).upper() if m.group(1) else ""], "hz"
    m = re.fullmatch(r"cycle/(n|u|m|)s(?:econd)?", u)
    if m:
        return value / time_div[m.group(1)], "hz"
    m = re.fullmatch(r"([KMGT])(inst|cycle|warp|block|thread|sector|request)(.*)", u)
    if m:
        return value * _PREFIX[m.group(1)], m.group(2) + m.group(3)
    return value, u


def _split_preamble(text: str, path: str) -> tuple[list[str], str]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith('"ID"'):
            return [ln for ln in lines[:i] if ln.startswith("==")], "\n".join(lines[i:])
    errors = [ln for ln in lines if ln.startswith("==ERROR==")]
    hint = f"; ncu said: {' | '.join(errors[:3])}" if errors else ""
    raise NcuFormatError(f"{path}: no ncu CSV header (a line starting with '\"ID\"') found{hint}. Expected the output "
                         f"of `ncu --csv` (details page) or `ncu --csv --page raw`")


def read_ncu_csv(path_or_text: str | Path, text: str | None = None) -> NcuReport:
    """Read an ``ncu --csv`` output (details or raw page) into an :class:`NcuReport` (tidy metrics frame).

    ``path_or_text`` is a file path; pass ``text`` to parse a string (then the first argument names it in errors).
    """
    where = str(path_or_text)
    if text is None:
        p = Path(path_or_text)
        if not p.is_file():
            raise NcuFormatError(f"{p}: no such ncu CSV file")
        text = p.read_text(errors="replace")
    notes, body = _split_preamble(text, where)
    # program output after the table (ncu prints ==PROF== Disconnected...) is dropped
    body_lines = [ln for ln in body.splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(body_lines))))
    header = [h.strip() for h in rows[0]]
    if "Metric Name" in header and "Metric Value" in header:
        return _read_details(where, header, rows[1:], notes)
    if "Kernel Name" in header and len(rows) >= 2 and all(not c.strip() for c in rows[1][:header.index("Kernel Name") + 1]):
        return _read_raw(where, header, rows[1], rows[2:], notes)
    raise NcuFormatError(f"{where}: unknown ncu CSV layout. Header: {header[:16]}{' ...' if len(header) > 16 else ''}. "
                         f"Expected the details page (columns 'Kernel Name', 'Section Name', 'Metric Name', "
                         f"'Metric Unit', 'Metric Value') or the raw page (identity columns then one column per "
                         f"metric, second row = units with empty identity cells)")


def _kernel_rows(records: list[dict[str, str]]) -> pd.DataFrame:
    seen: dict[str, dict[str, Any]] = {}
    for r in records:
        kid = r.get("ID", "")
        if kid not in seen:
            seen[kid] = {"id": int(parse_number(kid)) if not math.isnan(parse_number(kid)) else kid,
                         "kernel": r.get("Kernel Name", ""), "function": function_base(r.get("Kernel Name", "")),
                         "block_size": r.get("Block Size", ""), "grid_size": r.get("Grid Size", ""),
                         "device": r.get("Device", ""), "cc": r.get("CC", ""), "process": r.get("Process Name", ""),
                         "stream": r.get("Stream", "")}
    return pd.DataFrame(list(seen.values()), columns=["id", "kernel", "function", "block_size", "grid_size", "device",
                                                      "cc", "process", "stream"])


def _tidy(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["kernel", "id", "section", "metric", "unit", "value_text"])
    df["value"] = df["value_text"].map(parse_number)
    base = [to_base_unit(v, u) for v, u in zip(df["value"], df["unit"])]
    df["value_base"] = [b[0] for b in base]
    df["unit_base"] = [b[1] for b in base]
    return df


def _read_details(where: str, header: list[str], rows: list[list[str]], notes: list[str]) -> NcuReport:
    for need in ("ID", "Kernel Name", "Metric Unit"):
        if need not in header:
            raise NcuFormatError(f"{where}: details-page CSV without the '{need}' column; header: {header}")
    recs = [dict(zip(header, r)) for r in rows if len(r) >= len(header) - len(RULE_COLUMNS)]
    if not recs:
        raise NcuFormatError(f"{where}: the ncu CSV has a header but no kernel rows (no kernel matched the filter?)")
    tidy, rules = [], []
    for r in recs:
        kid = int(parse_number(r["ID"])) if not math.isnan(parse_number(r["ID"])) else r["ID"]
        if r.get("Metric Name", "").strip():
            tidy.append({"kernel": r["Kernel Name"], "id": kid, "section": r.get("Section Name", ""),
                         "metric": r["Metric Name"], "unit": r.get("Metric Unit", ""),
                         "value_text": r.get("Metric Value", "")})
        if r.get("Rule Name", "").strip():
            rules.append({"id": kid, "kernel": r["Kernel Name"], "section": r.get("Section Name", ""),
                          "rule": r["Rule Name"], "type": r.get("Rule Type", ""),
                          "description": r.get("Rule Description", ""),
                          "speedup_type": r.get("Estimated Speedup Type", ""),
                          "speedup_pct": parse_number(r.get("Estimated Speedup", ""))})
    rules_df = pd.DataFrame(rules, columns=["id", "kernel", "section", "rule", "type", "description", "speedup_type",
                                            "speedup_pct"]).drop_duplicates()
    return NcuReport(where, "details", _tidy(tidy), _kernel_rows(recs), rules_df, notes)


def _read_raw(where: str, header: list[str], units: list[str], rows: list[list[str]], notes: list[str]) -> NcuReport:
    if "ID" not in header:
        raise NcuFormatError(f"{where}: raw-page CSV without the 'ID' column; header: {header[:12]}")
    ident = [i for i, h in enumerate(header) if h in IDENTITY_COLUMNS]
    metric_cols = [i for i in range(len(header)) if i not in ident]
    if not metric_cols:
        raise NcuFormatError(f"{where}: raw-page CSV with no metric columns; header: {header}")
    recs, tidy = [], []
    for r in rows:
        if len(r) != len(header):
            raise NcuFormatError(f"{where}: raw-page row with {len(r)} cells, header has {len(header)}: {r[:5]}")
        rec = dict(zip(header, r))
        recs.append(rec)
        kid = int(parse_number(rec["ID"])) if not math.isnan(parse_number(rec["ID"])) else rec["ID"]
        for i in metric_cols:
            tidy.append({"kernel": rec.get("Kernel Name", ""), "id": kid, "section": "raw", "metric": header[i],
                         "unit": units[i] if i < len(units) else "", "value_text": r[i]})
    if not recs:
        raise NcuFormatError(f"{where}: the ncu CSV has a header but no kernel rows (no kernel matched the filter?)")
    return NcuReport(where, "raw", _tidy(tidy), _kernel_rows(recs), pd.DataFrame(), notes)


# ---------------------------------------------------------------- derived metrics

# quantity → candidates: raw metric ids, or (section, details label). First found wins.
DERIVED: dict[str, tuple[Any, ...]] = {
    "duration_ns": ("gpu__time_duration.sum", ("GPU Speed Of Light Throughput", "Duration")),
    "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",
                          ("GPU Speed Of Light Throughput", "Compute (SM) Throughput")),
    "memory_throughput_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
                              ("GPU Speed Of Light Throughput", "Memory Throughput")),
    "dram_throughput_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                            "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                            ("GPU Speed Of Light Throughput", "DRAM Throughput")),
    "tensor_pipe_pct": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
                        "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"),
    "l2_hit_rate_pct": ("lts__t_sector_hit_rate.pct", ("Memory Workload Analysis", "L2 Hit Rate")),
    "l1_hit_rate_pct": ("l1tex__t_sector_hit_rate.pct", ("Memory Workload Analysis", "L1/TEX Hit Rate")),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", ("Occupancy", "Achieved Occupancy")),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct", ("Occupancy", "Theoretical Occupancy")),
    "registers_per_thread": ("launch__registers_per_thread", ("Launch Statistics", "Registers Per Thread")),
    "shared_mem_static_bytes": ("launch__shared_mem_per_block_static",
                                ("Launch Statistics", "Static Shared Memory Per Block")),
    "shared_mem_dynamic_bytes": ("launch__shared_mem_per_block_dynamic",
                                 ("Launch Statistics", "Dynamic Shared Memory Per Block")),
    "block_threads": ("launch__block_size", ("Launch Statistics", "Block Size")),
    "grid_blocks": ("launch__grid_size", ("Launch Statistics", "Grid Size")),
    "dram_bytes": ("dram__bytes.sum",),
    "dram_bytes_read": ("dram__bytes_read.sum",),
    "dram_bytes_write": ("dram__bytes_write.sum",),
}
# SASS thread-instruction counters → flops (an FMA is 2 flops); the ncu roofline section counts the same way
FLOP_COUNTERS: dict[str, tuple[tuple[str, float], ...]] = {
    "fp32": (("smsp__sass_thread_inst_executed_op_fadd_pred_on.sum", 1), ("smsp__sass_thread_inst_executed_op_fmul_pred_on.sum", 1),  # noqa: E501
             ("smsp__sass_thread_inst_executed_op_ffma_pred_on.sum", 2)),
    "fp16": (("smsp__sass_thread_inst_executed_op_hadd_pred_on.sum", 1), ("smsp__sass_thread_inst_executed_op_hmul_pred_on.sum", 1),  # noqa: E501
             ("smsp__sass_thread_inst_executed_op_hfma_pred_on.sum", 2)),
    "fp64": (("smsp__sass_thread_inst_executed_op_dadd_pred_on.sum", 1), ("smsp__sass_thread_inst_executed_op_dmul_pred_on.sum", 1),  # noqa: E501
             ("smsp__sass_thread_inst_executed_op_dfma_pred_on.sum", 2)),
}
# tensor-core work: sm__ops_path_tensor_* count operations (FLOPs, 2 per multiply-add) per source type. Checked on
# the H200 capture: a 4096×4096×6144 bf16 GEMM reads exactly 2·M·N·K; with N = 14336 on 320-wide tiles it reads
# 2·M·14400·K — the counter counts the executed MMA work, tile padding included.
TENSOR_COUNTERS: dict[str, tuple[str, ...]] = {
    "bf16_tensor": ("sm__ops_path_tensor_src_bf16_dst_fp32.sum",),
    "fp16_tensor": ("sm__ops_path_tensor_src_fp16_dst_fp32.sum", "sm__ops_path_tensor_src_fp16_dst_fp16.sum"),
    "fp8_tensor": ("sm__ops_path_tensor_src_fp8.sum",),
}
STALL_RES = (re.compile(r"^smsp__average_warps_issue_stalled_(?P<reason>[a-z_0-9]+?)_per_issue_active\.ratio$"),
             re.compile(r"^smsp__average_warp_latency_issue_stalled_(?P<reason>[a-z_0-9]+?)\.ratio$"),
             re.compile(r"^smsp__pcsamp_warps_issue_stalled_(?P<reason>[a-z_0-9]+?)$"))
# "selected" is the issuing warp itself and "not_issued" a total, not stall reasons
NOT_STALLS = ("selected", "not_issued")


def _lookup(m: pd.DataFrame, candidates: tuple[Any, ...]) -> tuple[float, str]:
    for c in candidates:
        if isinstance(c, tuple):
            hit = m[(m["section"] == c[0]) & (m["metric"] == c[1])]
        else:
            hit = m[m["metric"] == c]
        vals = hit["value_base"].dropna()
        if not vals.empty:
            return float(vals.iloc[0]), c if isinstance(c, str) else f"{c[0]} / {c[1]}"
    return math.nan, ""


def derived_metrics(report: NcuReport) -> pd.DataFrame:
    """One row per profiled kernel launch: the quantities of ``docs/method.md#kernels`` (units in the column names).

    ``sm_throughput_pct, tensor_pipe_pct, dram_throughput_pct, l2_hit_rate_pct, achieved_occupancy_pct,
    registers_per_thread, shared_mem_*_bytes, duration_ns, dram_bytes``, flops per precision, and
    ``top_stalls`` (the three largest warp stall reasons, cycles per issued instruction). NaN = not collected.
    """
    out = []
    for (kid, kernel), m in report.metrics.groupby(["id", "kernel"], sort=False):
        row: dict[str, Any] = {"id": kid, "kernel": kernel, "function": function_base(kernel)}
        for q, cands in DERIVED.items():
            row[q], _ = _lookup(m, cands)
        if math.isnan(row["dram_bytes"]) and not (math.isnan(row["dram_bytes_read"]) and math.isnan(row["dram_bytes_write"])):
            row["dram_bytes"] = np.nansum([row["dram_bytes_read"], row["dram_bytes_write"]])
        row["shared_mem_bytes"] = np.nansum([row["shared_mem_static_bytes"], row["shared_mem_dynamic_bytes"]]) \
            if not (math.isnan(row["shared_mem_static_bytes"]) and math.isnan(row["shared_mem_dynamic_bytes"])) else math.nan
        for prec, parts in FLOP_COUNTERS.items():
            vals = [(_lookup(m, (name,))[0], mult) for name, mult in parts]
            row[f"flops_{prec}"] = sum(v * w for v, w in vals if not math.isnan(v)) \
                if any(not math.isnan(v) for v, _ in vals) else math.nan
        for prec, names in TENSOR_COUNTERS.items():
            vals = [_lookup(m, (n,))[0] for n in names]
            row[f"flops_{prec}"] = float(np.nansum(vals)) if any(not math.isnan(v) for v in vals) else math.nan
        stalls = []
        for metric, val in zip(m["metric"], m["value_base"]):
            for rx in STALL_RES:
                mm = rx.match(metric)
                if mm and not math.isnan(val) and mm.group("reason") not in NOT_STALLS:
                    stalls.append((mm.group("reason"), float(val)))
                    break
        stalls.sort(key=lambda t: -t[1])
        row["top_stalls"] = ", ".join(f"{r} {v:.2f}" for r, v in stalls[:3]) if stalls else "-"
        out.append(row)
    return pd.DataFrame(out)


def stall_reasons(report: NcuReport) -> pd.DataFrame:
    """Warp stall reasons per kernel (cycles per issued instruction), largest first: ``id, kernel, reason, value``."""
    rows = []
    for kid, kernel, metric, val in zip(report.metrics["id"], report.metrics["kernel"], report.metrics["metric"],
                                        report.metrics["value_base"]):
        for rx in STALL_RES:
            mm = rx.match(metric)
            if mm and not math.isnan(val) and mm.group("reason") not in NOT_STALLS:
                rows.append({"id": kid, "kernel": function_base(kernel), "reason": mm.group("reason"), "value": val})
                break
    df = pd.DataFrame(rows, columns=["id", "kernel", "reason", "value"])
    return df.sort_values(["id", "value"], ascending=[True, False]).reset_index(drop=True)
