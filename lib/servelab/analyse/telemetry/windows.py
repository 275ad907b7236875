"""Cut samples to a case's exact measurement window (the client's own start/end, in ns).

A sample that averages over an interval (sysstat, counter rates) describes ``(ts_ns - interval_ns,
ts_ns]``; it belongs to a window when the middle of that interval lies inside ``[start_ns, end_ns]``.
An instantaneous reading (nvidia-smi, DCGM) belongs when its stamp does. Stamps are first moved to the
client's clock with the node's measured offset (``clock.json``: node clock − controller clock).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class CaseWindow:
    """A case's measurement window on the client's clock (epoch ns)."""
    case_id: str
    start_ns: int
    end_ns: int
    label: str = ""

    def __post_init__(self) -> None:
        if self.end_ns <= self.start_ns:
            raise ValueError(f"case {self.case_id}: window end {self.end_ns} is not after start {self.start_ns}")

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def to_client_clock(frame: pd.DataFrame, offsets_ns: dict[str, int]) -> pd.DataFrame:
    """Subtract each node's clock offset from its stamps (nodes without an offset are left as they are)."""
    if frame.empty or not offsets_ns:
        return frame
    off = frame["node"].map(offsets_ns).fillna(0).astype("int64")
    out = frame.copy()
    out["ts_ns"] = out["ts_ns"] - off
    return out


def sample_mid_ns(frame: pd.DataFrame) -> pd.Series:
    return frame["ts_ns"] - frame["interval_ns"] // 2


def slice_window(frame: pd.DataFrame, window: CaseWindow) -> pd.DataFrame:
    """The samples of ``frame`` that belong to ``window`` (see module doc), with a ``case`` column."""
    if frame.empty:
        return frame.assign(case=pd.Series(dtype=object))
    mid = sample_mid_ns(frame)
    out = frame[(mid >= window.start_ns) & (mid <= window.end_ns)]
    return out.assign(case=window.case_id)


def coverage(frame: pd.DataFrame, window: CaseWindow,
             intervals_s: dict[tuple[str, str], float] | None = None) -> pd.DataFrame:
    """Per node and source: samples inside the window, first/last sample offset from the window edges
    (s), the largest gap between samples (s), and whether the window is covered end to end
    (edges within two sampling intervals and no gap over three intervals). ``intervals_s`` gives the
    sampling interval per (node, source) — from the collector statuses; else it is inferred."""
    cols = ["case", "node", "source", "samples", "first_after_start_s", "last_before_end_s", "max_gap_s",
            "interval_s", "covered"]
    inside = slice_window(frame, window)
    rows = []
    for (node, source), g in inside.groupby(["node", "source"]):
        stamps = np.unique(sample_mid_ns(g).to_numpy())
        interval = (intervals_s or {}).get((node, source)) or float(np.median(g["interval_ns"])) / 1e9 or (
            float(np.median(np.diff(stamps))) / 1e9 if len(stamps) > 1 else 1.0)
        first = (stamps[0] - window.start_ns) / 1e9
        last = (window.end_ns - stamps[-1]) / 1e9
        gap = float(np.max(np.diff(stamps))) / 1e9 if len(stamps) > 1 else float("nan")
        ok = first <= 2 * interval and last <= 2 * interval and not (gap == gap and gap > 3 * interval)
        rows.append((window.case_id, node, source, len(stamps), first, last, gap, interval, bool(ok)))
    return pd.DataFrame(rows, columns=cols)
