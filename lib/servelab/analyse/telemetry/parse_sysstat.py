"""sysstat output (``mpstat -P ALL``, ``pidstat -H -h -t -u -r -w``, ``sar -n DEV,EDEV``) and ``numastat -p``
blocks → tidy samples.

mpstat and sar are recorded in sysstat's machine-readable JSON (``mpstat -o JSON``; ``sar -o <file>`` turned
into JSON by ``sadf -j`` when the collector stops): numbers with a decimal point and ISO dates whatever the
node's locale, sar's stamps with their date, UTC flag and interval. :func:`parse_mpstat` and
:func:`parse_sar_net` read that JSON — also cut short (mpstat stopped by SIGTERM never closes its document:
every complete sample before the cut is read) — and still read the text format of files recorded before
(recognised by their first character). The rest of this note is about the text format.

sysstat prints wall-clock times of day (``HH:MM:SS``, 1 s resolution) after a header line that holds
the date; our collectors run it with ``TZ=UTC LC_ALL=C S_TIME_FORMAT=ISO`` so the header date is ISO
and the times are UTC (pass ``tz`` for files recorded otherwise). A time earlier than the previous
one means midnight passed. ``pidstat -H`` prints epoch seconds instead. ``Average:`` lines (printed
after SIGINT) are skipped: summaries are computed over the case's own window, not sysstat's.

Every sysstat value is an average over the interval that ends at its time stamp: ``interval_ns`` is
that interval (taken from the collector, or the median spacing of the stamps). sysstat prints the
sample time truncated to the second, so the true time lies in ``[stamp, stamp + 1 s)``: stamps are
moved to the middle of that second (``+0.5 s``, ``HALF_SECOND_NS``), which halves the worst error.
"""
from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd

from servelab.analyse.telemetry.frames import empty_frame, make_frame, to_float

HEADER_RE = re.compile(r"^Linux\s+\S+\s+\((?P<host>[^)]*)\)\s+(?P<date>\S+)")
TIME_RE = re.compile(r"^(?P<h>\d{2}):(?P<m>\d{2}):(?P<s>\d{2})(?:\s+(?P<ampm>AM|PM))?$")
BLOCK_RE = re.compile(r"^### ts_ns=(?P<ts>\d+)(?: files| rc=(?P<rc>-?\d+)(?: argv=(?P<argv>.*))?)?$")

HALF_SECOND_NS = 500_000_000
# sysstat's kB are 1024 bytes; 1 kB/s = 1024*8/1e9 Gbit/s
KBPS_TO_GBPS = 1024 * 8 / 1e9


def _parse_date(text: str) -> dt.date:
    for fmt in ("%Y-%m-%d", "%m/%d/%Y", "%m/%d/%y", "%d/%m/%Y", "%d.%m.%Y"):
        try:
            return dt.datetime.strptime(text, fmt).date()
        except ValueError:
            pass
    raise ValueError(f"sysstat header date {text!r} is not in a known format (run with S_TIME_FORMAT=ISO)")


class _Clock:
    """Turns successive ``HH:MM:SS`` stamps into epoch ns, rolling the date over at midnight."""

    def __init__(self, date: dt.date, tz: str):
        self.date, self.tz, self.last = date, ZoneInfo(tz), None

    def ns(self, stamp: str, ampm: str | None = None) -> int | None:
        m = TIME_RE.match(stamp if ampm is None else f"{stamp} {ampm}")
        if not m:
            return None
        h, mi, s = int(m["h"]), int(m["m"]), int(m["s"])
        if m["ampm"]:
            h = h % 12 + (12 if m["ampm"] == "PM" else 0)
        t = dt.time(h, mi, s)
        secs = h * 3600 + mi * 60 + s
        if self.last is not None and self.last - secs > 12 * 3600:   # wrapped past midnight
            self.date += dt.timedelta(days=1)
        self.last = secs
        return int(dt.datetime.combine(self.date, t, tzinfo=self.tz).timestamp()) * 1_000_000_000 + HALF_SECOND_NS


def _lines(text: str, tz: str):
    """Yield ``(clock, parts)`` for every non-blank line other than sysstat's report header; the header sets
    the date with which ``clock`` turns ``HH:MM:SS`` stamps into epoch ns (None before the first header)."""
    clock = None
    for line in text.splitlines():
        if not line.strip():
            continue
        hm = HEADER_RE.match(line)
        if hm:
            clock = _Clock(_parse_date(hm["date"]), tz)
            continue
        yield clock, line.split()


def _rows(text: str, tz: str):
    """Yield ``(ts_ns, fields)`` for each data line, plus ``('header', fields)`` for column headers."""
    for clock, parts in _lines(text, tz):
        if parts[0].startswith("Average"):
            continue
        if clock is None:
            continue
        ampm = parts[1] if len(parts) > 1 and parts[1] in ("AM", "PM") else None
        ts = clock.ns(parts[0], ampm)
        if ts is None:
            continue
        fields = parts[2:] if ampm else parts[1:]
        yield ts, fields


def _interval_ns(ts: list[int], interval_s: float | None) -> int:
    if interval_s:
        return int(interval_s * 1e9)
    u = np.unique(np.asarray(ts, dtype="int64"))
    return int(np.median(np.diff(u))) if len(u) > 1 else 1_000_000_000


def is_json(text: str) -> bool:
    """sysstat JSON (``{"sysstat": ...``) rather than its text report."""
    return text.lstrip().startswith("{")


def json_hosts(text: str) -> list[tuple[dict, list[dict]]]:
    """``(host fields, statistics entries)`` of a sysstat JSON document; a document cut short (the writer was
    stopped) yields every statistics entry that is complete. Raises ``ValueError`` when it is not sysstat JSON."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        hosts = (doc.get("sysstat") or {}).get("hosts")
        if not isinstance(hosts, list):
            raise ValueError("JSON without sysstat.hosts: not sysstat -o JSON / sadf -j output")
        return [({k: v for k, v in h.items() if k != "statistics"}, [e for e in h.get("statistics") or []
                                                                      if isinstance(e, dict)])
                for h in hosts if isinstance(h, dict)]
    # cut short: the host fields before "statistics", then entry after entry until one is incomplete
    at = text.find('"statistics"')
    if not text.lstrip().startswith('{"sysstat"') or at < 0:
        raise ValueError("not sysstat JSON (no '{\"sysstat\"' document with 'statistics')")
    host: dict = {}
    for key in ("nodename", "date", "file-date", "timezone", "number-of-cpus"):
        m = re.search(rf'"{re.escape(key)}":\s*("(?:[^"\\]|\\.)*"|\d+)', text[:at])
        if m:
            host[key] = json.loads(m.group(1))
    dec = json.JSONDecoder()
    i = text.index("[", at) + 1
    entries = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] != "{":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break
        if isinstance(obj, dict):
            entries.append(obj)
    return [(host, entries)]


def _json_stamp_ns(stamp: Any, host: dict, clock: "_Clock | None", tz: str) -> tuple[int | None, "_Clock | None"]:
    """Epoch ns (mid-second, as for text) of one sysstat JSON timestamp: sadf's ``{"date", "time", "utc"}`` or
    mpstat's ``"HH:MM:SS"`` under the host's ``date``."""
    if isinstance(stamp, dict):
        try:
            d = _parse_date(str(stamp["date"]))
            h, m, sec = (int(x) for x in str(stamp["time"]).split(":"))
        except (KeyError, ValueError):
            return None, clock
        zone = dt.timezone.utc if stamp.get("utc", 1) else ZoneInfo(tz)
        t = dt.datetime.combine(d, dt.time(h, m, sec), tzinfo=zone)
        return int(t.timestamp()) * 1_000_000_000 + HALF_SECOND_NS, clock
    if clock is None:
        date = host.get("date") or host.get("file-date")
        if not date:
            return None, None
        clock = _Clock(_parse_date(str(date)), tz)
    return clock.ns(str(stamp)), clock


def _json_rows(text: str, tz: str):
    """``(ts_ns, interval_s or None, entry)`` for every statistics entry of a sysstat JSON document."""
    for host, entries in json_hosts(text):
        clock = None
        for e in entries:
            stamp = e.get("timestamp")
            ts, clock = _json_stamp_ns(stamp, host, clock, tz)
            if ts is None:
                continue
            iv = stamp.get("interval") if isinstance(stamp, dict) else None
            yield ts, (float(iv) if isinstance(iv, (int, float)) and iv > 0 else None), e


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else np.nan


def _mpstat_json(text: str, tz: str) -> list[tuple[int, str, dict[str, float]]]:
    recs = []
    for ts, _, e in _json_rows(text, tz):
        for row in e.get("cpu-load") or []:
            if isinstance(row, dict) and "cpu" in row:
                recs.append((ts, str(row["cpu"]), {f"%{k}": _num(v) for k, v in row.items() if k != "cpu"}))
    return recs


def parse_mpstat(text: str, node: str, interval_s: float | None = None, tz: str = "UTC") -> pd.DataFrame:
    """``mpstat -P ALL -o JSON <s>`` (or the text report of older recordings) → ``cpu_*_pct`` (device ``all``),
    ``core_busy_pct`` (``cpuN``) and ``hottest_core_busy_pct`` (device ``max``: the busiest core at each stamp).
    busy = 100 − %idle."""
    header: list[str] | None = None
    recs = []
    if is_json(text):
        recs = _mpstat_json(text, tz)
    for ts, f in ([] if recs or is_json(text) else _rows(text, tz)):
        if f and f[0] == "CPU":
            header = f
            continue
        if header is None or len(f) != len(header):
            continue
        row = dict(zip(header, f))
        recs.append((ts, row["CPU"], {k: to_float(v) for k, v in row.items() if k != "CPU"}))
    if not recs:
        return empty_frame()
    step = _interval_ns([r[0] for r in recs], interval_s)
    out = []
    for ts, cpu, vals in recs:
        busy = 100.0 - vals.get("%idle", np.nan)
        if cpu == "all":
            out.append((node, "mpstat", "cpu_busy_pct", "all", ts, busy, step))
            for k in ("%usr", "%sys", "%iowait", "%irq", "%soft", "%steal"):
                if k in vals:
                    out.append((node, "mpstat", f"cpu_{k[1:]}_pct", "all", ts, vals[k], step))
        else:
            out.append((node, "mpstat", "core_busy_pct", f"cpu{cpu}", ts, busy, step))
    df = make_frame(out)
    cores = df[df.metric == "core_busy_pct"]
    if not cores.empty:
        hot = cores.groupby("ts_ns", as_index=False)["value"].max()
        hot = hot.assign(node=node, source="mpstat", metric="hottest_core_busy_pct", device="max", interval_ns=step)
        df = make_frame(pd.concat([df, hot], ignore_index=True))
    return df


def parse_pidstat(text: str, node: str, interval_s: float | None = None, tz: str = "UTC") -> pd.DataFrame:
    """``pidstat -H -h -t -u -r -w -p <pid>`` → process (``proc_*``) and per-thread (``thread_cpu_pct``,
    device ``<name>[<tid>]``) samples, plus ``hottest_thread_cpu_pct`` (device ``max``).

    ``proc_cpu_pct`` can exceed 100 (several cores); a thread at ~100 % is a saturated single core.
    """
    header: list[str] | None = None
    recs = []
    for clock, parts in _lines(text, tz):
        if parts[0] == "#":
            header = parts[1:]
            continue
        if header is None or parts[0].startswith("Average"):
            continue
        n = len(header)
        if len(parts) < n:
            continue
        fields = parts[: n - 1] + [" ".join(parts[n - 1:])]
        row = dict(zip(header, fields))
        t = row.get("Time", "")
        if t.isdigit():
            ts = int(t) * 1_000_000_000 + HALF_SECOND_NS
        elif clock is not None:
            ts = clock.ns(t)
            if ts is None:
                continue
        else:
            continue
        recs.append((ts, row))
    if not recs:
        return empty_frame()
    step = _interval_ns([r[0] for r in recs], interval_s)
    out = []
    for ts, row in recs:
        is_thread = row.get("TGID") == "-"
        cmd = row.get("Command", "?").replace("|__", "")
        if is_thread:
            out.append((node, "pidstat", "thread_cpu_pct", f"{cmd}[{row.get('TID')}]", ts,
                        to_float(row.get("%CPU", "nan")), step))
            continue
        dev = f"{cmd}[{row.get('TGID', row.get('PID', '?'))}]"
        for col, metric, scale in (("%CPU", "proc_cpu_pct", 1.0), ("%usr", "proc_usr_pct", 1.0),
                                   ("%system", "proc_sys_pct", 1.0), ("%wait", "proc_wait_pct", 1.0),
                                   ("RSS", "proc_rss_mib", 1 / 1024), ("majflt/s", "proc_majflt_ps", 1.0),
                                   ("minflt/s", "proc_minflt_ps", 1.0), ("cswch/s", "proc_cswch_ps", 1.0),
                                   ("nvcswch/s", "proc_nvcswch_ps", 1.0)):
            if col in row:
                out.append((node, "pidstat", metric, dev, ts, to_float(row[col]) * scale, step))
    df = make_frame(out)
    thr = df[df.metric == "thread_cpu_pct"]
    if not thr.empty:
        hot = thr.groupby("ts_ns", as_index=False)["value"].max()
        hot = hot.assign(node=node, source="pidstat", metric="hottest_thread_cpu_pct", device="max",
                         interval_ns=step)
        df = make_frame(pd.concat([df, hot], ignore_index=True))
    return df


SAR_METRICS = {
    "rxpck/s": ("net_rx_pps", 1.0), "txpck/s": ("net_tx_pps", 1.0),
    "rxkB/s": ("net_rx_gbps", KBPS_TO_GBPS), "txkB/s": ("net_tx_gbps", KBPS_TO_GBPS),
    "%ifutil": ("net_ifutil_pct", 1.0),
    "rxerr/s": ("net_rxerr_ps", 1.0), "txerr/s": ("net_txerr_ps", 1.0), "coll/s": ("net_coll_ps", 1.0),
    "rxdrop/s": ("net_rxdrop_ps", 1.0), "txdrop/s": ("net_txdrop_ps", 1.0),
    "txcarr/s": ("net_txcarr_ps", 1.0), "rxfram/s": ("net_rxfram_ps", 1.0),
    "rxfifo/s": ("net_rxfifo_ps", 1.0), "txfifo/s": ("net_txfifo_ps", 1.0),
}


def parse_sar_net(text: str, node: str, interval_s: float | None = None, tz: str = "UTC",
                  netdevs: list[str] | None = None) -> pd.DataFrame:
    """``sadf -j`` of ``sar -n DEV,EDEV -o <file> <s>`` (or the text report of older recordings) → per-netdev
    ``net_*`` samples (throughput in Gbit/s, errors per s).

    ``netdevs`` keeps only those interfaces (the target's rails); default: every interface but ``lo``.
    """
    if is_json(text):
        return _sar_net_json(text, node, interval_s, tz, netdevs)
    header: list[str] | None = None
    out = []
    for ts, f in _rows(text, tz):
        if f and f[0] == "IFACE":
            header = f
            continue
        if header is None or len(f) != len(header):
            continue
        row = dict(zip(header, f))
        dev = row["IFACE"]
        if (netdevs and dev not in netdevs) or (not netdevs and dev == "lo"):
            continue
        for col, val in row.items():
            if col in SAR_METRICS:
                metric, scale = SAR_METRICS[col]
                out.append((node, "sar-net", metric, dev, ts, to_float(val) * scale, 0))
    if not out:
        return empty_frame()
    df = make_frame(out)
    df["interval_ns"] = _interval_ns(df["ts_ns"].tolist(), interval_s)
    return df


# sadf -j keys → the text report's column names (SAR_METRICS)
SAR_JSON_KEYS = {"ifutil-percent": "%ifutil"}


def _sar_net_json(text: str, node: str, interval_s: float | None, tz: str, netdevs: list[str] | None
                  ) -> pd.DataFrame:
    out = []
    ivs = []
    for ts, iv, e in _json_rows(text, tz):
        net = e.get("network") or {}
        if iv:
            ivs.append(iv)
        for block in ("net-dev", "net-edev"):
            for row in net.get(block) or []:
                if not isinstance(row, dict):
                    continue
                dev = str(row.get("iface", ""))
                if not dev or (netdevs and dev not in netdevs) or (not netdevs and dev == "lo"):
                    continue
                for key, val in row.items():
                    col = SAR_JSON_KEYS.get(key, f"{key}/s")
                    if col in SAR_METRICS:
                        metric, scale = SAR_METRICS[col]
                        out.append((node, "sar-net", metric, dev, ts, _num(val) * scale, 0))
    if not out:
        return empty_frame()
    df = make_frame(out)
    df["interval_ns"] = _interval_ns(df["ts_ns"].tolist(), interval_s or (float(np.median(ivs)) if ivs else None))
    return df


def iter_blocks(text: str):
    """Split sampler output into ``(ts_ns, rc, argv_json, body_lines)`` blocks."""
    cur = None
    for line in text.splitlines():
        m = BLOCK_RE.match(line)
        if m:
            if cur:
                yield cur
            cur = (int(m["ts"]), int(m["rc"]) if m["rc"] else 0, m["argv"] or "", [])
            continue
        if cur is not None:
            cur[3].append(line)
    if cur:
        yield cur


def parse_numastat_text(lines: list[str]) -> dict[str, float]:
    """One ``numastat -p`` report → MB per NUMA node from its ``Total`` row (``{'node0': 3.9, ...}``)."""
    nodes: list[str] = []
    for line in lines:
        s = line.strip()
        if s.startswith("Node ") and "Total" in s:
            nodes = [f"node{n}" for n in re.findall(r"Node (\d+)", s)]
        elif s.startswith("Total") and nodes:
            vals = [to_float(v) for v in s.split()[1:]]
            return dict(zip(nodes, vals[: len(nodes)]))
    return {}


def parse_numastat(text: str, node: str, interval_s: float | None = None) -> pd.DataFrame:
    """Sampler blocks of ``numastat -p <pid>`` → ``numa_mem_mib`` per NUMA node and
    ``numa_top_node_share_pct`` (share of the process memory on its largest node; 100 = all local)."""
    out = []
    for ts, rc, _argv, body in iter_blocks(text):
        if rc != 0:
            continue
        per = parse_numastat_text(body)
        if not per:
            continue
        for dev, mb in per.items():
            out.append((node, "numastat", "numa_mem_mib", dev, ts, mb, 0))
        total = sum(v for v in per.values() if v == v)
        if total > 0:
            out.append((node, "numastat", "numa_top_node_share_pct", "proc", ts, 100 * max(per.values()) / total, 0))
        out.append((node, "numastat", "numa_nodes", "proc", ts, float(len(per)), 0))
    return make_frame(out) if out else empty_frame()
