"""Read back one case's telemetry folder: statuses, clocks, parsed samples and counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from servelab.analyse.telemetry import parse_dcgm, parse_net, parse_perf, parse_smi, parse_sysstat
from servelab.analyse.telemetry.frames import COUNTER_COLUMNS, concat, empty_frame, make_counters
from servelab.measure.telemetry.runner import CollectorStatus, read_clock, read_statuses, telemetry_dir
from servelab.analyse.telemetry.windows import CaseWindow, to_client_clock


@dataclass
class CaseTelemetry:
    """Everything Phase 2 knows about one case: samples on the client's clock, counters, statuses."""
    case_id: str
    window: CaseWindow | None
    samples: pd.DataFrame
    counters: pd.DataFrame
    statuses: list[CollectorStatus]
    clock_offsets_ns: dict[str, int] = field(default_factory=dict)
    parse_notes: list[str] = field(default_factory=list)


def parse_raw(status: CollectorStatus, text: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Dispatch one raw file to its parser → (samples, counters)."""
    node, p, iv = status.node, status.parser, status.interval_s
    none = make_counters([])
    if p == "smi":
        return parse_smi.parse_smi_csv(text, node), none
    if p == "dcgm":
        return parse_dcgm.parse_dcgm_dmon(text, node, iv, start_ns=status.start_ns), none
    if p == "mpstat":
        return parse_sysstat.parse_mpstat(text, node, iv), none
    if p == "pidstat":
        return parse_sysstat.parse_pidstat(text, node, iv), none
    if p == "numastat":
        return parse_sysstat.parse_numastat(text, node, iv), none
    if p == "sar_net":
        return parse_sysstat.parse_sar_net(text, node, iv, netdevs=status.options.get("netdevs") or None), none
    if p == "ethtool":
        c = parse_net.parse_ethtool_blocks(text, node)
        return parse_net.ethtool_rates(c), c
    if p == "rdma":
        c = parse_net.parse_rdma_blocks(text, node)
        return parse_net.rdma_rates(c), c
    if p == "perf":
        return parse_perf.parse_perf_stat(text, node, status.start_ns or 0, iv), none
    raise ValueError(f"{status.node}/{status.collector}: unknown parser '{p}'")


def load_case_telemetry(case_dir: Path, case_id: str | None = None, window: CaseWindow | None = None) -> CaseTelemetry:
    """Parse every raw file a case's collectors left (also those that exited early: their data up to
    the exit is real, and their status already marks the case)."""
    case_dir = Path(case_dir)
    statuses = read_statuses(case_dir)
    tdir = telemetry_dir(case_dir)
    samples, counters, notes = [], [], []
    offsets = {}
    for st in statuses:
        offsets.setdefault(st.node, int(read_clock(case_dir, st.node).get("offset_ns", 0)))
        path = tdir / st.raw_file
        if not st.started or not path.exists():
            continue
        try:
            s, c = parse_raw(st, path.read_text(errors="replace"))
        except ValueError as exc:
            notes.append(f"{st.node}/{st.collector}: {exc}")
            continue
        for key in ("bad_lines", "na_values"):
            if s.attrs.get(key):
                notes.append(f"{st.node}/{st.collector}: {s.attrs[key]} {key.replace('_', ' ')}")
        if s.attrs.get("unsupported"):
            notes.append(f"{st.node}/{st.collector}: not supported here: {', '.join(s.attrs['unsupported'])}")
        samples.append(s)
        counters.append(c)
    frame = to_client_clock(concat(samples), offsets)
    cnt = [c for c in counters if not c.empty]
    cframe = pd.concat(cnt, ignore_index=True) if cnt else make_counters([])
    if not cframe.empty:
        cframe = cframe.assign(ts_ns=cframe["ts_ns"] - cframe["node"].map(offsets).fillna(0).astype("int64"))
    return CaseTelemetry(case_id or case_dir.name, window, frame if not frame.empty else empty_frame(),
                         cframe[COUNTER_COLUMNS] if not cframe.empty else cframe, statuses, offsets, notes)
