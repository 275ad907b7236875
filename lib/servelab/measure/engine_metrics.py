"""Engine ``/metrics`` (Prometheus text format): parse, scrape periodically during a case, run-level deltas.

The scraper runs in a background thread (the client's asyncio loop stays free for timestamps) and keeps
every sample as a row ``(ts_ns, wall_ns, name, labels, value)``. Counter deltas over the run
(``*_total`` last − first, per label set) are the correct way to get run-level numbers such as the prefix
cache hit rate or the spec-decode acceptance (gauges such as ``cache_hit_rate`` are moving values).
A failed scrape is a row in ``errors``, never a zero.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from servelab.deploy.server import http_text

class PrometheusParseError(ValueError):
    """A /metrics body is not valid Prometheus text format (the first bad line's number given)."""


def _first_bad_line(text: str) -> tuple[int, str]:
    """(line number, line) of the first sample line the parser rejects on its own; (0, "") if none does."""
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            return no, raw
    return 0, ""


def parse_text(text: str) -> list[dict[str, Any]]:
    """Samples of a Prometheus text body: ``{"name", "labels" (dict), "value", "type"}`` per sample.

    Parsed by ``prometheus_client.parser.text_string_to_metric_families`` (the maintained parser of the
    exposition format: escapes, NaN/±Inf, timestamps, histogram and summary families). ``type`` is the family's
    ``# TYPE`` (histogram ``_bucket``/``_sum``/``_count`` samples carry their family's type), ``untyped`` if none.
    The parser names a counter's samples ``<family>_total`` even where the engine wrote the family without the
    suffix (llama.cpp's ``llamacpp:n_tokens_max``).
    """
    out = []
    try:
        for fam in text_string_to_metric_families(text):
            typ = "untyped" if fam.type in ("unknown", "untyped") else fam.type
            for s in fam.samples:
                out.append({"name": s.name, "labels": dict(s.labels), "value": float(s.value), "type": typ})
    except ValueError as exc:
        no, raw = _first_bad_line(text)
        where = f"line {no}: not a Prometheus sample: {raw[:200]!r}" if no else "not a Prometheus text body"
        raise PrometheusParseError(f"{where} ({exc})") from None
    return out


def label_key(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={labels[k]}" for k in sorted(labels))


@dataclass
class Scraper:
    """Scrape ``url`` every ``interval_s`` in a thread until ``stop()``; rows in ``frame()``."""
    url: str
    interval_s: float = 0.5
    timeout_s: float = 2.0
    headers: dict[str, str] = field(default_factory=dict, repr=False)   # Authorization with an API key
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def scrape_once(self) -> bool:
        t, wall = time.perf_counter_ns(), time.time_ns()
        status, text = http_text(self.url, timeout=self.timeout_s, headers=self.headers)
        if status != 200:
            self.errors.append({"ts_ns": t, "wall_ns": wall, "status": status, "error": text[:200]})
            return False
        try:
            samples = parse_text(text)
        except PrometheusParseError as exc:
            self.errors.append({"ts_ns": t, "wall_ns": wall, "status": status, "error": str(exc)})
            return False
        for s in samples:
            self.rows.append({"ts_ns": t, "wall_ns": wall, "name": s["name"], "labels": label_key(s["labels"]),
                              "value": s["value"], "type": s["type"]})
        return True

    def _loop_after_first(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scrape_once()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> "Scraper":
        """Take the first sample now (so counter deltas cover everything after this call), then go on in a thread."""
        self.scrape_once()
        self._thread = threading.Thread(target=self._loop_after_first, name="servelab-metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> pd.DataFrame:
        """Stop, take one last sample (so deltas cover the whole case) and return the frame."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self.interval_s + 1)
        self.scrape_once()
        return self.frame()

    def frame(self) -> pd.DataFrame:
        cols = ["ts_ns", "wall_ns", "name", "labels", "value", "type"]
        return pd.DataFrame(self.rows, columns=cols)


def counter_deltas(frame: pd.DataFrame) -> pd.DataFrame:
    """Per counter series (``*_total`` or TYPE counter): first, last, delta over the frame; a reset is flagged.

    A series absent from the frame's first scrape and present later was created inside the window (engines create
    a label set on its first increment: SGLang's ``sglang:cached_tokens_total{cache_source="device"}`` appears with
    the first prefix-cache hit); it counts from 0, as a Prometheus counter does."""
    if frame.empty:
        return pd.DataFrame(columns=["name", "labels", "first", "last", "delta", "reset"])
    is_counter = (frame["type"] == "counter") | frame["name"].str.endswith("_total")
    first_scrape = frame["ts_ns"].min()
    rows = []
    for (name, labels), g in frame[is_counter].sort_values("ts_ns").groupby(["name", "labels"], sort=True):
        v = g["value"].to_numpy()
        reset = bool((v[1:] < v[:-1]).any()) if len(v) > 1 else False
        first = float(v[0]) if g["ts_ns"].iloc[0] <= first_scrape else 0.0
        rows.append({"name": name, "labels": labels, "first": first, "last": float(v[-1]),
                     "delta": float(v[-1] - first), "reset": reset})
    return pd.DataFrame(rows)


def named_deltas(frame: pd.DataFrame, metric_names: dict[str, str]) -> dict[str, float | None]:
    """Run-level deltas under our names (``engine.metric_names``: ours → engine series); None if absent.

    Also ``prefix_cache_hit_rate`` = Δcached/Δprompt tokens when both counters exist.
    """
    d = counter_deltas(frame)
    out: dict[str, float | None] = {}
    for ours, series in metric_names.items():
        if not (ours.endswith("_total")):
            continue
        sel = d[d["name"].isin([series, series + "_total"])] if not d.empty else d
        out[ours] = float(sel["delta"].sum()) if not sel.empty else None
    p, c = out.get("prompt_tokens_total"), out.get("cached_tokens_total")
    out["prefix_cache_hit_rate"] = (c / p) if p and c is not None else None
    return out


def gauge_series(frame: pd.DataFrame, metric_names: dict[str, str], keys: tuple[str, ...] = ("running", "waiting",
                 "kv_usage")) -> pd.DataFrame:
    """Time series of a few gauges under our names: columns ``ts_ns``, ``metric``, ``value`` (labels summed)."""
    rows = []
    for k in keys:
        series = metric_names.get(k)
        if not series or frame.empty:
            continue
        g = frame[frame["name"] == series].groupby("ts_ns", as_index=False)["value"].sum()
        g["metric"] = k
        rows.append(g)
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=["ts_ns", "value", "metric"])


def split_labels(key: str) -> dict[str, str]:
    """``label_key``'s ``a=1,b=2`` back into a mapping (label values with ',' or '=' are kept whole where possible)."""
    out: dict[str, str] = {}
    last = None
    for part in key.split(",") if key else []:
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = v
            last = k
        elif last is not None:             # a ',' inside the previous value
            out[last] += "," + part
    return out


def histogram_buckets(frame: pd.DataFrame, series: str, t0_ns: int | None = None,
                      t1_ns: int | None = None) -> pd.DataFrame:
    """The buckets of one histogram over a window: columns ``le`` (upper bound, +inf last), ``count`` (cumulative
    observations that arrived in the window: the bucket's value at the last scrape minus at the first, label sets
    other than ``le`` summed). ``t0_ns``/``t1_ns`` (wall clock) narrow the scrapes used; empty if absent or with
    fewer than two scrapes."""
    rows = frame[frame["name"] == f"{series}_bucket"] if not frame.empty else frame
    if t0_ns is not None:
        rows = rows[rows["wall_ns"] >= t0_ns]
    if t1_ns is not None:
        rows = rows[rows["wall_ns"] <= t1_ns]
    if rows.empty or rows["ts_ns"].nunique() < 2:       # a window needs a scrape at each end
        return pd.DataFrame(columns=["le", "count"])
    le = rows["labels"].map(lambda k: float(split_labels(k).get("le", "nan")))
    per = rows.assign(le=le).groupby(["ts_ns", "le"], as_index=False)["value"].sum()
    first, last = per["ts_ns"].min(), per["ts_ns"].max()
    a = per[per["ts_ns"] == first].set_index("le")["value"]
    b = per[per["ts_ns"] == last].set_index("le")["value"]
    d = (b - a.reindex(b.index).fillna(0)).sort_index()
    return pd.DataFrame({"le": d.index.to_numpy(dtype=float), "count": d.to_numpy(dtype=float)})


def histogram_quantile(buckets: pd.DataFrame, q: float) -> dict[str, float | None]:
    """Quantile ``q`` of a cumulative histogram the way Prometheus' ``histogram_quantile`` does it: find the bucket
    holding rank ``q × total``, interpolate linearly between its lower and upper bound (lower bound 0 for the
    first bucket). A rank in the +Inf bucket returns the largest finite bound (a lower bound on the truth).
    Returns ``value``, the bucket ``lo``/``hi`` it came from, and ``total``; value None without observations."""
    if buckets.empty:
        return {"value": None, "lo": None, "hi": None, "total": 0.0}
    le = buckets["le"].to_numpy(dtype=float)
    cum = buckets["count"].to_numpy(dtype=float)
    total = float(cum[-1]) if np.isinf(le[-1]) else float(cum.max())
    if total <= 0:
        return {"value": None, "lo": None, "hi": None, "total": 0.0}
    rank = q * total
    i = int(np.searchsorted(cum, rank, side="left"))
    i = min(i, len(le) - 1)
    lo = 0.0 if i == 0 else float(le[i - 1])
    hi = float(le[i])
    if np.isinf(hi):
        return {"value": lo, "lo": lo, "hi": hi, "total": total}
    below = 0.0 if i == 0 else float(cum[i - 1])
    inside = float(cum[i]) - below
    value = hi if inside <= 0 else lo + (hi - lo) * (rank - below) / inside
    return {"value": value, "lo": lo, "hi": hi, "total": total}


def histogram_mean(frame: pd.DataFrame, series: str, t0_ns: int | None = None, t1_ns: int | None = None) -> float | None:
    """Exact mean of the observations that arrived in the window: Δ``_sum`` / Δ``_count`` (None without any)."""
    def delta(name: str) -> float | None:
        rows = frame[frame["name"] == name] if not frame.empty else frame
        if t0_ns is not None:
            rows = rows[rows["wall_ns"] >= t0_ns]
        if t1_ns is not None:
            rows = rows[rows["wall_ns"] <= t1_ns]
        if rows.empty:
            return None
        per = rows.groupby("ts_ns")["value"].sum().sort_index()
        return float(per.iloc[-1] - per.iloc[0]) if len(per) > 1 else None
    s, c = delta(f"{series}_sum"), delta(f"{series}_count")
    return s / c if s is not None and c else None
