"""nvidia-smi ``--query-gpu=<collectors.SMI_FIELDS> --format=csv[,noheader][,nounits]`` → tidy samples.

Columns, in the order of ``collectors.SMI_FIELDS``: index, timestamp, utilization.gpu [%], utilization.memory [%],
memory.used [MiB], memory.total [MiB], power.draw [W], temperature.gpu [C], clocks.sm [MHz],
clocks.mem [MHz], pstate. ``utilization.gpu`` is the fraction of time any kernel ran (not SM
occupancy); ``utilization.memory`` the fraction of time the memory controller was busy. Timestamps
are the node's local time without a zone: our collector runs it with ``TZ=UTC``; pass ``tz`` for
files recorded elsewhere. A CSV saved by hand (``--format=csv``) is read by its own header: any field
order, names with or without ``[unit]``, values with or without units (``26 %``).
``[N/A]`` / ``[Not Supported]`` become missing values, never 0.
"""
from __future__ import annotations

import re

import pandas as pd

from servelab.measure.telemetry.collectors import SMI_FIELDS
from servelab.analyse.telemetry.frames import empty_frame, make_frame, to_float

FIELDS = SMI_FIELDS.split(",")
METRICS = {
    "utilization.gpu": "util_gpu_pct",
    "utilization.memory": "util_mem_pct",
    "memory.used": "mem_used_mib",
    "memory.total": "mem_total_mib",
    "power.draw": "power_w",
    "temperature.gpu": "temp_c",
    "clocks.sm": "sm_clock_mhz",
    "clocks.mem": "mem_clock_mhz",
    "pstate": "pstate",
}


HEADER_ALIASES = {
    "clocks.current.sm": "clocks.sm", "clocks.current.memory": "clocks.mem", "clocks.memory": "clocks.mem",
    "power.draw.instant": "power.draw", "power.draw.average": "power.draw",
}
KEY_FIELDS = ("index", "pci.bus_id", "uuid")       # what names a GPU, in order of preference
VALUE_RE = re.compile(r"^\s*(?P<v>[-+]?\d+(?:\.\d+)?)\s*(?:%|[A-Za-z]+)?\s*$")


def _field_name(col: str) -> str:
    """``'utilization.gpu [%]'`` → ``'utilization.gpu'``; nvidia-smi's long names map to the short ones."""
    name = re.sub(r"\s*\[[^\]]*\]\s*$", "", col.strip()).strip().lower()
    return HEADER_ALIASES.get(name, name)


def _header(parts: list[str]) -> list[str] | None:
    """The field list if this CSV line is a header (``--format=csv`` prints one; names may carry units)."""
    names = [_field_name(p) for p in parts]
    if "timestamp" in names or any(k in names for k in KEY_FIELDS):
        return names
    return None


def _num(v: str) -> float:
    v = v.strip()
    if v.startswith("P") and v[1:].isdigit():
        return float(v[1:])
    m = VALUE_RE.match(v)
    return float(m["v"]) if m else to_float(v)


def _key(fields: list[str]) -> str | None:
    return next((k for k in KEY_FIELDS if k in fields), None)


def parse_smi_csv(text: str, node: str, tz: str = "UTC", fields: list[str] | None = None) -> pd.DataFrame:
    """Parse the query-loop output, or a CSV a user saved: a header line (``--format=csv``) names the
    fields in its own order, with or without units; values may carry units (``26 %``, ``4096 MiB``).
    ``attrs['bad_lines']`` counts lines that are not samples (header lines included); when nothing
    parses, ``attrs['reason']`` says why in one line."""
    given = [_field_name(f) for f in fields] if fields else None
    cur = given or FIELDS
    recs, bad, first_bad, headers = [], 0, "", []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if given is None and (h := _header(parts)):
            cur = h
            headers.append(h)
            bad += 1
            continue
        key = _key(cur)
        if len(parts) != len(cur) or key is None or "timestamp" not in cur:
            bad += 1
            first_bad = first_bad or line.strip()
            continue
        row = dict(zip(cur, parts))
        if key == "index" and not row["index"].isdigit():      # an error message or a stray header
            bad += 1
            first_bad = first_bad or line.strip()
            continue
        row["_gpu"] = ("gpu" + row["index"]) if key == "index" else row[key]
        recs.append(row)
    if not recs:
        out = empty_frame()
        out.attrs.update(bad_lines=bad, reason=_why_nothing(text, cur, bad, first_bad))
        return out
    df = pd.DataFrame(recs)
    ts = pd.to_datetime(df["timestamp"], format="%Y/%m/%d %H:%M:%S.%f", errors="coerce")
    if ts.isna().any():
        ts = ts.fillna(pd.to_datetime(df["timestamp"], format="mixed", errors="coerce"))
    ts = ts.dt.tz_localize(tz).dt.tz_convert("UTC").dt.as_unit("ns")
    df["ts_ns"] = ts.astype("int64")
    df = df[ts.notna()]
    if df.empty:
        out = empty_frame()
        out.attrs.update(bad_lines=bad + len(recs), reason=f"nvidia-smi CSV: {len(recs)} sample line(s) but no "
                         f"readable timestamp (first: '{recs[0]['timestamp']}')")
        return out
    df["device"] = df["_gpu"]
    long = []
    for field, metric in METRICS.items():
        if field not in df:
            continue
        part = pd.DataFrame({"node": node, "source": "nvidia-smi", "metric": metric, "device": df["device"],
                             "ts_ns": df["ts_ns"], "value": df[field].map(_num), "interval_ns": 0})
        long.append(part)
    out = pd.concat(long, ignore_index=True) if long else pd.DataFrame(columns=["metric", "device", "ts_ns", "value"])
    used = out[out.metric == "mem_used_mib"].set_index(["device", "ts_ns"])["value"]
    total = out[out.metric == "mem_total_mib"].set_index(["device", "ts_ns"])["value"]
    if len(used) and len(total):
        free = (total - used).reset_index()
        free = free.assign(node=node, source="nvidia-smi", metric="mem_free_mib", interval_ns=0)
        out = pd.concat([out, free], ignore_index=True)
    out = out.dropna(subset=["value"])
    if out.empty:
        got = ", ".join(c for c in df.columns if not c.startswith("_") and c not in ("ts_ns", "device"))
        e = empty_frame()
        e.attrs.update(bad_lines=bad, reason=f"nvidia-smi CSV: {len(df)} sample line(s) but no known metric among "
                       f"their fields ({got}); known: {', '.join(METRICS)}")
        return e
    return make_frame(out, bad_lines=bad)


def _why_nothing(text: str, fields: list[str], bad: int, first_bad: str) -> str:
    if not text.strip():
        return "nvidia-smi CSV: the input is empty"
    if "timestamp" not in fields:
        return f"nvidia-smi CSV: no 'timestamp' field (fields: {', '.join(fields)}); query it with --query-gpu=timestamp,…"
    if _key(fields) is None:
        return f"nvidia-smi CSV: no field names the GPU (one of {', '.join(KEY_FIELDS)}; fields: {', '.join(fields)})"
    if not first_bad:
        return "nvidia-smi CSV: a header but no sample lines"
    return (f"nvidia-smi CSV: none of {bad} line(s) is a sample of the {len(fields)} fields "
            f"({', '.join(fields)}); first: '{first_bad[:100]}'")
