"""``dcgmi dmon -e <ids> -d <ms>`` output → tidy samples.

Format (NVIDIA/DCGM ``dcgmi/DeviceMonitor.cpp``): a header line ``#Entity`` + one short name per field,
a unit line starting with ``ID``, the pair repeated every 14 samples, then one row per entity and
sample: ``GPU 0`` (or ``GPU-I 3``, ``Switch 0``) followed by the values; ``N/A`` when a value is blank;
ratios printed with 3 decimals. dmon prints no time stamps: our collector prefixes each line with the
receive time in ns (``<ts_ns> <line>``); for a plain dmon file pass ``start_ns`` and the stamps are
estimated as ``start_ns + k * interval`` (``attrs['estimated_ts']``).

Units: SMACT/SMOCC/TENSO/DRAMA/GRACT/FPxxA are ratios 0..1 (reported here in %); PCITX/PCIRX and
NVLTX/NVLRX are bytes per second (reported in GB/s, 1e9 B/s); XID is the last XID error number.
"""
from __future__ import annotations

import re

import pandas as pd

from servelab.analyse.telemetry.frames import empty_frame, make_frame, to_float

SHORT_TO_METRIC: dict[str, tuple[str, float]] = {
    "GRACT": ("dcgm_gr_engine_active_pct", 100.0),
    "SMACT": ("dcgm_sm_active_pct", 100.0),
    "SMOCC": ("dcgm_sm_occupancy_pct", 100.0),
    "TENSO": ("dcgm_tensor_active_pct", 100.0),
    "DRAMA": ("dcgm_dram_active_pct", 100.0),
    "FP64A": ("dcgm_fp64_active_pct", 100.0),
    "FP32A": ("dcgm_fp32_active_pct", 100.0),
    "FP16A": ("dcgm_fp16_active_pct", 100.0),
    "PCITX": ("pcie_tx_GBps", 1e-9),
    "PCIRX": ("pcie_rx_GBps", 1e-9),
    "NVLTX": ("nvlink_tx_GBps", 1e-9),
    "NVLRX": ("nvlink_rx_GBps", 1e-9),
    "XID": ("xid_last", 1.0),
    "GPUTL": ("dcgm_gpu_util_pct", 1.0),
    "POWER": ("dcgm_power_w", 1.0),
}
ENTITY_RE = re.compile(r"^(GPU|GPU-I|GPU-CI|vGPU|Switch|Link|CPU|Core|NIC)\s+(\d+)\s+(.*)$")
STAMP_RE = re.compile(r"^(\d{16,20}) (.*)$")


def parse_dcgm_dmon(text: str, node: str, interval_s: float = 1.0, start_ns: int | None = None) -> pd.DataFrame:
    """Parse (stamped or plain) dmon output; ``attrs`` has ``na_values``, ``bad_lines``, ``estimated_ts``."""
    header: list[str] | None = None
    out, na, bad = [], 0, 0
    estimated = False
    k = -1
    seen_in_set: set[str] = set()
    step = int(interval_s * 1e9)
    for raw in text.splitlines():
        m = STAMP_RE.match(raw)
        ts, line = (int(m[1]), m[2]) if m else (None, raw)
        s = line.strip()
        if not s:
            continue
        if s.startswith("#Entity"):
            header = s.split()[1:]
            continue
        if s.startswith("ID") or s.startswith("dmon was stopped"):
            continue
        em = ENTITY_RE.match(s)
        if not em or header is None:
            bad += 1
            continue
        device = f"{em[1].lower()}{em[2]}"
        if device in seen_in_set or k < 0:      # a new sample set begins
            k += 1
            seen_in_set = set()
        seen_in_set.add(device)
        if ts is None:
            if start_ns is None:
                raise ValueError("dcgmi dmon output has no stamps: pass start_ns (the collector's start time)")
            ts, estimated = start_ns + (k + 1) * step, True
        vals = em[3].split()
        if len(vals) != len(header):
            bad += 1
            continue
        for short, v in zip(header, vals):
            metric, scale = SHORT_TO_METRIC.get(short, (f"dcgm_{short.lower()}", 1.0))
            x = to_float(v)
            if x != x:
                na += 1
                continue
            out.append((node, "dcgm", metric, device, ts, x * scale, 0))
    if not out:
        df = empty_frame()
        df.attrs.update(na_values=na, bad_lines=bad, estimated_ts=estimated)
        return df
    return make_frame(out, na_values=na, bad_lines=bad, estimated_ts=estimated)
