"""The engine's collectives against the communication ceiling measured on the same machine.

Phase 5 measures what the fabric gives a bare collective at each message size (nccl-tests on GPUs); Phase 3 sees
what the engine's collectives achieve. :func:`collectives_vs_ceiling` joins them, per collective kind × message-size
bucket (the power of two nearest the size, so one bucket holds one shape of call):

- ``calls per step``: calls of that kind and bucket per rank per captured step (window; steps counted over every
  collective of the capture, sized or not);
- ``size`` and ``time``: the median message size (nccl-tests' S: the gathered output for all-gather, the input
  otherwise, ``analyse.trace.nccl.message_bytes``) and the median duration of a call;
- ``algbw`` = S / time and ``busbw`` = algbw × the nccl-tests factor for the collective and the group size
  (``docs/metrics.md#nccl-tests``: all-reduce 2(n−1)/n, all-gather / reduce-scatter / all-to-all (n−1)/n);
  the median of the per-call values;
- ``ceiling busbw``: nccl-tests' out-of-place busbw at the same size, interpolated in log2(size) between the
  measured sizes of the same collective (``msgsize.place_on_curves``: never extrapolated, ``—`` outside the range);
- ``share of ceiling`` = busbw / ceiling busbw;
- ``exposed per step``: the collective's exposed time per rank per step (``analyse.trace.metrics.comm_by_collective``:
  its time not covered by compute on the same device), given to its buckets in proportion to their share of the
  collective's total call time (calls whose size the trace does not record keep their share, in no bucket).

The finding names the bucket that costs the most exposed time per step (``docs/metrics.md#engine-vs-ceiling``).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

from servelab.analyse.nccl.msgsize import normalise_collective, place_on_curves
from servelab.analyse.trace.nccl import busbw_factor

COLUMNS = ["collective", "size bucket", "calls per step", "median size (B)", "median time (µs)", "algbw (GB/s)",
           "busbw (GB/s)", "ceiling busbw (GB/s)", "share of ceiling (%)", "exposed per step (ms)", "calls", "ranks"]


def size_label(n: float) -> str:
    """Bytes as nccl-tests sizes read: ``512 B``, ``64 KiB``, ``1 MiB``."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if abs(v - round(v)) < 0.05 else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def collectives_vs_ceiling(comm: pl.DataFrame, curves: pd.DataFrame, exposure: pl.DataFrame | None = None,
                           steps: int | None = None) -> pd.DataFrame:
    """:data:`COLUMNS`, one row per collective × size bucket, largest exposed cost first. ``comm``: the capture's
    collectives (``analyse.trace.nccl.comm_ops``); ``curves``: nccl-tests rows (``perf_log.runs_frame``); ``exposure``:
    ``comm_by_collective`` of the same capture; ``steps``: windows per rank (default: counted in ``comm``)."""
    if comm is None or comm.height == 0:
        return pd.DataFrame(columns=COLUMNS)
    every = comm.to_pandas()
    every["kind_n"] = every["collective"].map(normalise_collective)
    c = every[every["msg_bytes"].notna() & (every["msg_bytes"] > 0) & (every["dur_ns"] > 0)].copy()
    if c.empty:
        return pd.DataFrame(columns=COLUMNS)
    c["bucket"] = (2.0 ** np.round(np.log2(c["msg_bytes"].astype(float)))).astype(np.int64)
    c["algbw"] = c["msg_bytes"] / c["dur_ns"]                          # bytes/ns = GB/s
    c["factor"] = [busbw_factor(k, n) for k, n in zip(c["collective"], c["group_size"])]
    c["busbw"] = c["algbw"] * c["factor"].astype(float)
    ranks = int(every["rank"].nunique())
    n_steps = steps or int(every.groupby("rank")["window"].nunique().max() or 1)
    per_rank_steps = max(1, n_steps) * max(1, ranks)
    exposed_total: dict[str, float] = {}
    if exposure is not None and exposure.height:
        e = exposure.to_pandas()
        for coll, ms in e.groupby("collective")["exposed_ms"].sum().items():
            exposed_total[normalise_collective(coll)] = float(ms)
    dur_total = every.groupby("kind_n")["dur_ns"].sum().to_dict()     # sized or not: unsized calls keep their share
    rows = []
    for (kind, bucket), g in c.groupby(["kind_n", "bucket"]):
        share_of_time = float(g["dur_ns"].sum() / dur_total[kind]) if dur_total.get(kind) else 0.0
        exp = exposed_total.get(kind)
        rows.append({"collective": kind, "size bucket": size_label(bucket), "bucket": int(bucket),
                     "calls per step": len(g) / per_rank_steps, "median size (B)": float(g["msg_bytes"].median()),
                     "median time (µs)": float(g["dur_ns"].median() / 1e3), "algbw (GB/s)": float(g["algbw"].median()),
                     "busbw (GB/s)": float(g["busbw"].median()) if g["busbw"].notna().any() else math.nan,
                     "exposed per step (ms)": exp * share_of_time / per_rank_steps if exp is not None else math.nan,
                     "calls": len(g), "ranks": int(g["rank"].nunique())})
    out = pd.DataFrame(rows)
    sizes = out.rename(columns={"collective": "collective_", "median size (B)": "msg_bytes"})
    sizes = sizes.assign(collective=sizes["collective_"], calls_per_step=1)
    placed = place_on_curves(sizes[["collective", "msg_bytes", "calls_per_step"]], curves) if not curves.empty \
        else pd.DataFrame({"busbw_gbps": [math.nan] * len(out)})
    out["ceiling busbw (GB/s)"] = placed["busbw_gbps"].to_numpy()
    out["share of ceiling (%)"] = 100.0 * out["busbw (GB/s)"] / out["ceiling busbw (GB/s)"]
    out = out.sort_values(["exposed per step (ms)", "calls"], ascending=[False, False], na_position="last")
    return out[COLUMNS].reset_index(drop=True)


def ceiling_finding(table: pd.DataFrame, ceiling_source: str = "nccl-tests") -> str | None:
    """The sentence for the bucket with the most exposed time per step (else the most calls)."""
    t = table[table["ceiling busbw (GB/s)"].notna()] if not table.empty else table
    if t.empty:
        return None
    r: dict[str, Any] = t.iloc[0].to_dict()
    exp = r["exposed per step (ms)"]
    return (f"{r['collective']} at {r['size bucket']} ({r['calls per step']:.1f} calls per rank per step) reaches "
            f"{r['share of ceiling (%)']:.0f} % of the {ceiling_source} busbw at that size ({r['busbw (GB/s)']:.2f} of "
            f"{r['ceiling busbw (GB/s)']:.2f} GB/s, median of {r['calls']} calls)"
            + (f"; {exp:.3f} ms exposed per step" if exp == exp else "") + ".")


def with_ceiling(table: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """A :func:`collectives_vs_ceiling` table (e.g. Phase 3's ``collectives_vs_ceiling.csv``) against other curves:
    the ceiling and share columns recomputed at each bucket's median size."""
    if table.empty:
        return table
    out = table.copy()
    sizes = pd.DataFrame({"collective": out["collective"], "msg_bytes": out["median size (B)"].astype(float),
                          "calls_per_step": 1})
    placed = place_on_curves(sizes, curves) if not curves.empty else pd.DataFrame({"busbw_gbps": [math.nan] * len(out)})
    out["ceiling busbw (GB/s)"] = placed["busbw_gbps"].to_numpy()
    out["share of ceiling (%)"] = 100.0 * out["busbw (GB/s)"] / out["ceiling busbw (GB/s)"]
    return out
