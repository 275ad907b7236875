"""nvidia-smi ``--query-gpu=<collectors.SMI_FIELDS> --format=csv[,noheader][,nounits]`` → tidy samples.

Columns, in the order of ``collectors.SMI_FIELDS``: index, timestamp, utilization.gpu [%], utilization.memory [%],
memory.used [MiB], memory.total [MiB], power.draw [W], temperature.gpu [C], clocks.sm [MHz],
clocks.mem [MHz], pstate. ``utilization.gpu`` is the fraction of time any kernel ran (not SM
occupancy); ``utilization.memory`` the fraction of time the memory controller was busy. Timestamps
are the node's local time without a zone: our collector runs it with ``TZ=UTC``; pass ``tz`` for
files recorded elsewhere. ``[N/A]`` / ``[Not Supported]`` become missing values, never 0.
"""
from __future__ import annotations

import pandas as pd

from servelab.analyse.telemetry.collectors import SMI_FIELDS
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


def _num(v: str) -> float:
    v = v.strip()
    if v.startswith("P") and v[1:].isdigit():
        return float(v[1:])
    for unit in (" %", " MiB", " W", " C", " MHz"):
        if v.endswith(unit):
            v = v[: -len(unit)]
    return to_float(v)


def parse_smi_csv(text: str, node: str, tz: str = "UTC", fields: list[str] | None = None) -> pd.DataFrame:
    """Parse the query-loop output; ``attrs['bad_lines']`` counts lines that are not samples."""
    fields = fields or FIELDS
    if "index" not in fields or "timestamp" not in fields:
        raise ValueError("nvidia-smi fields must include index and timestamp")
    recs, bad = [], 0
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(fields) or not line.strip():
            bad += bool(line.strip())
            continue
        row = dict(zip(fields, parts))
        if not row["index"].isdigit():          # a header line ("index, timestamp, ...") or an error
            bad += 1
            continue
        recs.append(row)
    if not recs:
        out = empty_frame()
        out.attrs.update(bad_lines=bad)
        return out
    df = pd.DataFrame(recs)
    ts = pd.to_datetime(df["timestamp"], format="%Y/%m/%d %H:%M:%S.%f", errors="coerce")
    ts = ts.dt.tz_localize(tz).dt.tz_convert("UTC").dt.as_unit("ns")
    df["ts_ns"] = ts.astype("int64")
    df = df[ts.notna()]
    df["device"] = "gpu" + df["index"]
    long = []
    for field, metric in METRICS.items():
        if field not in df:
            continue
        part = pd.DataFrame({"node": node, "source": "nvidia-smi", "metric": metric, "device": df["device"],
                             "ts_ns": df["ts_ns"], "value": df[field].map(_num), "interval_ns": 0})
        long.append(part)
    out = pd.concat(long, ignore_index=True)
    used = out[out.metric == "mem_used_mib"].set_index(["device", "ts_ns"])["value"]
    total = out[out.metric == "mem_total_mib"].set_index(["device", "ts_ns"])["value"]
    if len(used) and len(total):
        free = (total - used).reset_index()
        free = free.assign(node=node, source="nvidia-smi", metric="mem_free_mib", interval_ns=0)
        out = pd.concat([out, free], ignore_index=True)
    out = out.dropna(subset=["value"])
    return make_frame(out, bad_lines=bad)
