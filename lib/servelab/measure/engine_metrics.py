"""Engine ``/metrics`` (Prometheus text format): parse, scrape periodically during a case, run-level deltas.

The scraper runs in a background thread (the client's asyncio loop stays free for timestamps) and keeps
every sample as a row ``(ts_ns, wall_ns, name, labels, value)``. Counter deltas over the run
(``*_total`` last − first, per label set) are the correct way to get run-level numbers such as the prefix
cache hit rate or the spec-decode acceptance (gauges such as ``cache_hit_rate`` are moving values).
A failed scrape is a row in ``errors``, never a zero.
"""
from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from servelab.target.server import http_text

_SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


class PrometheusParseError(ValueError):
    """A line of a /metrics body is not valid Prometheus text format (line number given)."""


def _value(s: str) -> float:
    low = s.lower()
    if low in ("nan",):
        return math.nan
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    return float(s)


def parse_text(text: str) -> list[dict[str, Any]]:
    """Samples of a Prometheus text body: ``{"name", "labels" (dict), "value", "type"}`` per line.

    ``type`` comes from the ``# TYPE`` comment of the metric family (histogram ``_bucket``/``_sum``/
    ``_count`` samples inherit their family's type), ``untyped`` if none.
    """
    types: dict[str, str] = {}
    out = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3].strip()
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            raise PrometheusParseError(f"line {no}: not a Prometheus sample: {raw[:200]!r}")
        name = m.group("name")
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL_RE.findall(m.group("labels") or "")}
        try:
            value = _value(m.group("value"))
        except ValueError:
            raise PrometheusParseError(f"line {no}: bad value {m.group('value')!r}") from None
        family = name
        for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
            if name.endswith(suffix) and name[: -len(suffix)] in types:
                family = name[: -len(suffix)]
                break
        out.append({"name": name, "labels": labels, "value": value, "type": types.get(family, types.get(name, "untyped"))})
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
    """Per counter series (``*_total`` or TYPE counter): first, last, delta over the frame; a reset is flagged."""
    if frame.empty:
        return pd.DataFrame(columns=["name", "labels", "first", "last", "delta", "reset"])
    is_counter = (frame["type"] == "counter") | frame["name"].str.endswith("_total")
    rows = []
    for (name, labels), g in frame[is_counter].sort_values("ts_ns").groupby(["name", "labels"], sort=True):
        v = g["value"].to_numpy()
        reset = bool((v[1:] < v[:-1]).any()) if len(v) > 1 else False
        rows.append({"name": name, "labels": labels, "first": float(v[0]), "last": float(v[-1]),
                     "delta": float(v[-1] - v[0]), "reset": reset})
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
