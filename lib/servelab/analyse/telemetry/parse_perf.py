"""``perf stat -a -I <ms> -x ,`` output → tidy samples.

CSV fields (perf-stat(1), ``-x``): ``time_s,value,unit,event,run_time,pct_running,metric,metric_unit``
where ``time_s`` counts from perf's start; the collector's recorded start (``start_ns``) puts it on the
wall clock. ``<not supported>`` / ``<not counted>`` events (common in VMs) are listed in
``attrs['unsupported']`` and give no samples (never 0).
"""
from __future__ import annotations

import re

import pandas as pd

from servelab.analyse.telemetry.frames import empty_frame, make_frame


def parse_perf_stat(text: str, node: str, start_ns: int, interval_s: float = 5.0) -> pd.DataFrame:
    """``perf_<event>_per_s`` for counts, ``perf_cpus_utilized`` for ``task-clock`` (ms of CPU per ms)."""
    out, unsupported = [], set()
    step = int(interval_s * 1e9)
    for line in text.splitlines():
        parts = line.strip().split(",")
        if len(parts) < 4 or not re.fullmatch(r"\d+\.\d+", parts[0]):
            continue
        t, value, unit, event = parts[0], parts[1], parts[2], parts[3]
        ts = start_ns + int(float(t) * 1e9)
        if value.startswith("<"):
            unsupported.add(event)
            continue
        v = float(value)
        if event in ("task-clock", "cpu-clock") and unit == "msec":
            out.append((node, "perf-stat", "perf_cpus_utilized", "all", ts, v / (interval_s * 1000), step))
        else:
            name = re.sub(r"[^A-Za-z0-9]+", "_", event).strip("_").lower()
            out.append((node, "perf-stat", f"perf_{name}_per_s", "all", ts, v / interval_s, step))
    df = make_frame(out) if out else empty_frame()
    df.attrs["unsupported"] = sorted(unsupported)
    return df
