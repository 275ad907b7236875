"""NIC and RDMA counters → cumulative counter frames, rates, and increments inside a window.

- ``ethtool -S <dev>``: ``NIC statistics:`` then ``     <name>: <value>`` lines (mlx5 names in the
  kernel's ``Documentation/networking/device_drivers/ethernet/mellanox/mlx5/counters.rst``:
  ``rx_bytes_phy``, ``tx_bytes_phy``, ``rx_vport_rdma_unicast_bytes``, ``rx_discards_phy``,
  ``rx_prio3_pause`` ...). Our collector samples it every second in framed blocks
  (``### ts_ns=<n> rc=<rc> argv=["ethtool","-S","eth0"]``).
- RDMA sysfs: ``/sys/class/infiniband/<hca>/ports/<p>/{counters,hw_counters}/<name>``;
  ``port_xmit_data``/``port_rcv_data`` count **4-byte words** (kernel ABI
  ``Documentation/ABI/stable/sysfs-class-infiniband``), so bytes = value × 4.

Counters are cumulative: rates come from deltas between consecutive samples (a negative delta means
the counter was reset and gives no rate); errors are judged by their increment inside a window.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from servelab.analyse.telemetry.frames import COUNTER_COLUMNS, make_counters, make_frame, empty_frame
from servelab.analyse.telemetry.parse_sysstat import iter_blocks

RDMA_PATH_RE = re.compile(r"^/sys/class/infiniband/(?P<hca>[^/]+)/ports/(?P<port>\d+)/(?P<group>counters|hw_counters)/"
                          r"(?P<name>\S+)$")
RDMA_WORD_BYTES = 4

# counters whose increase inside a window is a problem (errors), a flow-control event (pause) or congestion
ERROR_RE = re.compile(r"(err|error|discard|drop|crc|symbol|out_of_buffer|out_of_sequence|link_down|downed|"
                      r"retrans|retry|timeout|seq_err|nak|overrun|integrity|icrc|duplicate_request|"
                      r"buf_discard|cong_discard)", re.IGNORECASE)
PAUSE_RE = re.compile(r"pause", re.IGNORECASE)
CONGESTION_RE = re.compile(r"(cnp|ecn|marked|xmit_wait)", re.IGNORECASE)


def counter_kind(name: str) -> str:
    """``pause`` | ``congestion`` | ``error`` | ``traffic`` for a counter name."""
    if PAUSE_RE.search(name):
        return "pause"
    if CONGESTION_RE.search(name):
        return "congestion"
    if ERROR_RE.search(name):
        return "error"
    return "traffic"


def parse_ethtool_s(text: str) -> dict[str, float]:
    """One ``ethtool -S`` report → ``{counter: value}`` (lines without ``name: number`` are ignored)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if ":" not in line or line.strip().endswith("statistics:"):
            continue
        k, v = line.rsplit(":", 1)
        v = v.strip()
        if re.fullmatch(r"-?\d+", v):
            out[k.strip()] = float(v)
    return out


def parse_ethtool_blocks(text: str, node: str) -> pd.DataFrame:
    """Sampler blocks of ``ethtool -S <dev>`` → counter frame (device = the netdev)."""
    recs = []
    for ts, rc, argv, body in iter_blocks(text):
        if rc != 0:
            continue
        try:
            dev = json.loads(argv)[-1] if argv else "?"
        except json.JSONDecodeError:
            dev = "?"
        for k, v in parse_ethtool_s("\n".join(body)).items():
            recs.append((node, "ethtool", dev, k, ts, v))
    return make_counters(recs)


def parse_rdma_blocks(text: str, node: str) -> pd.DataFrame:
    """Sampler blocks of RDMA sysfs counters → counter frame (device = ``<hca>:<port>``, raw units)."""
    recs = []
    for ts, _rc, _argv, body in iter_blocks(text):
        for line in body:
            parts = line.split()
            if len(parts) != 2:
                continue
            m = RDMA_PATH_RE.match(parts[0])
            if not m or not re.fullmatch(r"\d+", parts[1]):
                continue
            recs.append((node, "rdma", f"{m['hca']}:{m['port']}", m["name"], ts, float(parts[1])))
    return make_counters(recs)


def parse_rdma_snapshot(text: str) -> dict[str, float]:
    """``<name> <value>`` or ``<path> <value>`` lines (one counter dump) → ``{name: value}``."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and re.fullmatch(r"\d+", parts[1]):
            out[parts[0].rsplit("/", 1)[-1]] = float(parts[1])
    return out


def _rates(counters: pd.DataFrame, counter: str, metric: str, scale: float) -> list[pd.DataFrame]:
    part = counters[counters.counter == counter].sort_values("ts_ns")
    out = []
    for (node, source, dev), g in part.groupby(["node", "source", "device"], sort=False):
        ts = g["ts_ns"].to_numpy()
        v = g["value"].to_numpy()
        if len(ts) < 2:
            continue
        dt = np.diff(ts)
        dv = np.diff(v)
        rate = np.where((dv >= 0) & (dt > 0), dv / np.maximum(dt, 1) * 1e9 * scale, np.nan)
        out.append(pd.DataFrame({"node": node, "source": source, "metric": metric, "device": dev,
                                 "ts_ns": ts[1:], "value": rate, "interval_ns": dt}))
    return out


def _sum_matching(counters: pd.DataFrame, pattern: str, name: str) -> pd.DataFrame:
    part = counters[counters.counter.str.fullmatch(pattern)]
    if part.empty:
        return part
    g = part.groupby(["node", "source", "device", "ts_ns"], as_index=False)["value"].sum()
    return g.assign(counter=name)[COUNTER_COLUMNS]


def ethtool_rates(counters: pd.DataFrame) -> pd.DataFrame:
    """``eth_{rx,tx}_gbps`` (physical port bytes: ``*_bytes_phy``, else ``*_bytes``, else the sum of
    per-queue bytes), ``rdma_vport_{rx,tx}_gbps`` (mlx5 RDMA vport bytes) and packet rates."""
    if counters.empty:
        return empty_frame()
    frames = []
    for direction in ("rx", "tx"):
        have = set(counters.counter)
        if f"{direction}_bytes_phy" in have:
            src = f"{direction}_bytes_phy"
        elif f"{direction}_bytes" in have:
            src = f"{direction}_bytes"
        else:
            summed = _sum_matching(counters, rf"{direction}_queue_\d+_bytes", f"{direction}_queues_bytes")
            counters = pd.concat([counters, summed], ignore_index=True) if not summed.empty else counters
            src = f"{direction}_queues_bytes"
        frames += _rates(counters, src, f"eth_{direction}_gbps", 8 / 1e9)
        pk = f"{direction}_packets_phy" if f"{direction}_packets_phy" in have else f"{direction}_packets"
        frames += _rates(counters, pk, f"eth_{direction}_pps", 1.0)
        frames += _rates(counters, f"{direction}_vport_rdma_unicast_bytes", f"rdma_vport_{direction}_gbps", 8 / 1e9)
    frames = [f for f in frames if not f.empty]
    return make_frame(pd.concat(frames, ignore_index=True)) if frames else empty_frame()


def rdma_rates(counters: pd.DataFrame) -> pd.DataFrame:
    """``rdma_{tx,rx}_gbps`` from ``port_{xmit,rcv}_data`` × 4 bytes, and packet rates."""
    if counters.empty:
        return empty_frame()
    frames = (_rates(counters, "port_xmit_data", "rdma_tx_gbps", RDMA_WORD_BYTES * 8 / 1e9)
              + _rates(counters, "port_rcv_data", "rdma_rx_gbps", RDMA_WORD_BYTES * 8 / 1e9)
              + _rates(counters, "port_xmit_packets", "rdma_tx_pps", 1.0)
              + _rates(counters, "port_rcv_packets", "rdma_rx_pps", 1.0))
    frames = [f for f in frames if not f.empty]
    return make_frame(pd.concat(frames, ignore_index=True)) if frames else empty_frame()


def increments(counters: pd.DataFrame, start_ns: int | None = None, end_ns: int | None = None,
               kinds: tuple[str, ...] = ("error", "pause", "congestion")) -> pd.DataFrame:
    """Increase of each error/pause/congestion counter between the last sample at or before
    ``start_ns`` (else the first sample) and the last sample at or before ``end_ns``.

    Columns: node, source, device, counter, kind, increment, samples. A reset counter gives NaN.
    """
    cols = ["node", "source", "device", "counter", "kind", "increment", "samples"]
    if counters.empty:
        return pd.DataFrame(columns=cols)
    c = counters.assign(kind=counters["counter"].map(counter_kind))
    c = c[c.kind.isin(kinds)].sort_values("ts_ns")
    rows = []
    for (node, source, dev, name, kind), g in c.groupby(["node", "source", "device", "counter", "kind"]):
        before = g[g.ts_ns <= start_ns] if start_ns is not None else g.iloc[:0]
        first = before.iloc[-1] if len(before) else g.iloc[0]
        upto = g[g.ts_ns <= end_ns] if end_ns is not None else g
        if upto.empty:
            continue
        last = upto.iloc[-1]
        inc = last.value - first.value
        rows.append((node, source, dev, name, kind, inc if inc >= 0 else np.nan, len(upto)))
    return pd.DataFrame(rows, columns=cols)
