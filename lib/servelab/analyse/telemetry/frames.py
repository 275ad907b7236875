"""The tidy sample frame shared by every telemetry parser."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pandas as pd

COLUMNS = ["node", "source", "metric", "device", "ts_ns", "value", "interval_ns"]
COUNTER_COLUMNS = ["node", "source", "device", "counter", "ts_ns", "value"]


def empty_frame() -> pd.DataFrame:
    return pd.DataFrame({"node": pd.Series(dtype=object), "source": pd.Series(dtype=object),
                         "metric": pd.Series(dtype=object), "device": pd.Series(dtype=object),
                         "ts_ns": pd.Series(dtype="int64"), "value": pd.Series(dtype="float64"),
                         "interval_ns": pd.Series(dtype="int64")})


def make_frame(records: Iterable[tuple[Any, ...]] | pd.DataFrame, **attrs: Any) -> pd.DataFrame:
    """Build a sample frame from ``(node, source, metric, device, ts_ns, value, interval_ns)`` tuples."""
    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame(list(records), columns=COLUMNS)
    if df.empty:
        df = empty_frame()
    df = df[COLUMNS].astype({"ts_ns": "int64", "value": "float64", "interval_ns": "int64"})
    df = df.astype({"node": object, "source": object, "metric": object, "device": object})
    df.attrs.update(attrs)
    return df.reset_index(drop=True)


def make_counters(records: Iterable[tuple[Any, ...]], **attrs: Any) -> pd.DataFrame:
    """Cumulative counter samples ``(node, source, device, counter, ts_ns, value)``."""
    df = pd.DataFrame(list(records), columns=COUNTER_COLUMNS)
    df = df.astype({"ts_ns": "int64", "value": "float64"}) if not df.empty else df.astype(
        {"ts_ns": "int64", "value": "float64"})
    df = df.astype({"node": object, "source": object, "device": object, "counter": object})
    df.attrs.update(attrs)
    return df


def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and not f.empty]
    return make_frame(pd.concat(frames, ignore_index=True)) if frames else empty_frame()


def to_float(text: str) -> float:
    """``'132.20'`` → 132.2; ``'[N/A]'``, ``'N/A'``, ``'[Not Supported]'``, ``''`` → NaN."""
    t = text.strip().strip("[]")
    try:
        return float(t)
    except ValueError:
        return float("nan")


def nan_to_dash(df: pd.DataFrame) -> pd.DataFrame:
    """Missing numbers shown as ``-`` (never 0), for tables and CSVs meant for people."""
    out = df.astype(object).where(df.notna(), "-")
    return out.replace({np.nan: "-"})
