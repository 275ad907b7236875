"""The server-side layer of a case: what the engine said about itself while the client measured it.

Three sources, all on the wall clock and cut to one window of the case (docs/metrics.md#server-side):

- the engine's ``/metrics`` scraped during the case (``server/metrics.parquet``): its gauges (running and
  queued requests, KV-cache usage, preemptions/retractions) as step series, under the names of the adapter's
  ``metric_names``;
- the engine's scheduler/batch log lines (``server/engine_log_excerpt.txt``), parsed by the adapter
  (``parse_scheduler_line``) and placed in time by the time each line carries (``line_time``) and the clock note
  written beside the excerpt (``server/engine_log_clock.json``);
- the engine's latency histograms (TTFT, queue time, ITL, E2E): counts that arrived in the window, and
  percentiles interpolated inside their buckets the way Prometheus' ``histogram_quantile`` does.

Nothing here starts anything: it reads a case folder and returns frames.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import polars as pl

from servelab.measure.engine_metrics import gauge_series, histogram_buckets, histogram_mean, histogram_quantile
from servelab.analyse.trace import stalls as S
from servelab.measure.records import read_records

SERIES_COLUMNS = ["t_s", "wall_ns", "metric", "value", "source"]
QUANTILES = (0.5, 0.95, 0.99)
# scheduler-line fields drawn as series (common names from the adapters' scheduler_fields)
LOG_SERIES = {"running": "running (log)", "queued": "queued (log)", "kv_usage": "kv_usage (log)",
              "new_tokens": "prefill tokens per batch (log)", "retracted": "retracted (log)"}


@dataclass
class ServerSide:
    """One case's server-side layer on one window (``t_s`` = seconds since ``t0_wall_ns``)."""
    case_id: str
    engine: str
    t0_wall_ns: int
    t1_wall_ns: int
    series: pd.DataFrame                  # t_s, wall_ns, metric, value, source (metrics | log)
    lines: pd.DataFrame                   # t_s, wall_ns, event, fields..., line (scheduler lines in the window)
    histograms: pd.DataFrame              # metric, observations, p50/p95/p99 (ms), p95 bucket bounds (ms)
    clock: str                            # how the log lines were placed on the wall clock, one sentence
    notes: list[str] = field(default_factory=list)


def _localize(naive: dt.datetime, year: int, utc_offset_s: float) -> int:
    """Wall ns of a naive server-local datetime (year filled in where the format has none)."""
    if naive.year == 1900:
        naive = naive.replace(year=year)
    tz = dt.timezone(dt.timedelta(seconds=utc_offset_s))
    return int(naive.replace(tzinfo=tz).timestamp() * 1e9)


def _iso_ns(iso: str) -> int | None:
    try:
        return int(dt.datetime.fromisoformat(iso).timestamp() * 1e9)
    except (TypeError, ValueError):
        return None


def scheduler_lines(text: str, adapter: Any, clock: dict[str, Any] | None = None,
                    year: int | None = None) -> tuple[pd.DataFrame, str]:
    """Every scheduler line of ``text`` as a row (``order``, ``wall_ns`` or NaN, ``event``, fields, ``line``) and
    one sentence saying how the lines were placed in time.

    ``elapsed`` times (llama.cpp) are added to the process start in ``clock``; ``wall`` times (SGLang, vLLM) are read
    in ``clock``'s UTC offset (this machine's by default), the year taken from the process start or ``year``; lines
    without a time keep only their order."""
    clock = clock or {}
    started = _iso_ns(clock.get("process_started", ""))
    offset = float(clock.get("utc_offset_s", 0.0) if clock else
                   (dt.datetime.now().astimezone().utcoffset() or dt.timedelta()).total_seconds())
    yr = year or (dt.datetime.fromtimestamp(started / 1e9).year if started else dt.datetime.now().year)
    rows = []
    kinds: set[str] = set()
    for order, line in enumerate(text.splitlines()):
        fields = adapter.parse_scheduler_line(line)
        if fields is None:
            continue
        when = adapter.line_time(line)
        wall, kind = np.nan, ""
        if when is not None and when[0] == "elapsed" and started is not None:
            wall, kind = started + int(when[1] * 1e9), "elapsed"
        elif when is not None and when[0] == "wall":
            wall, kind = _localize(when[1], yr, offset), "wall"
        if kind:
            kinds.add(kind)
        if "kv_usage_pct" in fields and "kv_usage" not in fields:
            fields["kv_usage"] = fields["kv_usage_pct"] / 100.0
        rows.append({"order": order, "wall_ns": wall, "clock": kind, **fields, "line": line})
    df = pd.DataFrame(rows)
    if df.empty:
        return (pd.DataFrame(columns=["order", "wall_ns", "clock", "event", "line"]),
                "no scheduler lines in the engine log")
    note = adapter.log_time_note or ""
    if "elapsed" in kinds:
        how = (f"log lines placed by the time since the process started that each line carries, added to the start "
               f"time servelab recorded ({clock.get('process_started')}); {note}")
    elif "wall" in kinds:
        how = (f"log lines placed by their own timestamps (1 s resolution), read at UTC{offset / 3600:+.1f} h; {note}"
               + ("; the server's clock is not synchronised with this machine's here" if clock.get("remote") else ""))
    else:
        how = "log lines carry no usable time: they are listed in log order only, not placed on the timeline"
    return df, how


def _start_shift_ns(case_dir: Path, lines: pd.DataFrame, adapter: Any) -> int:
    """For lines placed by elapsed time: how much later they must sit so that the first slot taken (the adapter's
    ``log_occupancy`` start event) is not before the case's first request left the client (0 when it is not, or
    nothing tells). A lower bound on the start record's lead, never a move earlier."""
    pair = getattr(adapter, "log_occupancy", None)
    p = Path(case_dir) / "requests.jsonl"
    if not pair or lines.empty or not (lines["clock"] == "elapsed").any() or not p.is_file():
        return 0
    sends = [r.send_ns + r.wall_offset_ns for r in read_records(p) if r.send_ns]
    first = lines.loc[(lines["event"] == pair[0]) & (lines["clock"] == "elapsed"), "wall_ns"]
    if not sends or first.empty:
        return 0
    return max(0, int(min(sends) - first.min()))


def _occupancy(lines: pd.DataFrame, adapter: Any) -> pd.DataFrame:
    """Requests holding a slot, from the adapter's (start, end) line events, counted from the excerpt's first line
    (a case starts with nothing in flight)."""
    pair = getattr(adapter, "log_occupancy", None)
    if not pair or lines.empty or lines["wall_ns"].isna().all():
        return pd.DataFrame(columns=["wall_ns", "metric", "value", "source"])
    start, end = pair
    ev = lines[lines["event"].isin([start, end])].dropna(subset=["wall_ns"]).sort_values("order")
    step = np.where(ev["event"] == start, 1, -1)
    return pd.DataFrame({"wall_ns": ev["wall_ns"].astype("int64"), "metric": "slots in use (log)",
                         "value": np.cumsum(step).astype(float), "source": "log (counted)"})


def metric_series(frame: pd.DataFrame, adapter: Any) -> pd.DataFrame:
    """The adapter's ``serverside_series`` from a scrape frame: gauges as they were, counters (``*_total``) as the
    increase since the previous scrape. Columns ``wall_ns``, ``metric`` (our name), ``value``, ``source``."""
    if frame.empty:
        return pd.DataFrame(columns=["wall_ns", "metric", "value", "source"])
    names = adapter.metric_names
    wall = frame.groupby("ts_ns")["wall_ns"].first()
    out = []
    for key in adapter.serverside_series:
        g = gauge_series(frame, {key: names.get(key, "")} if names.get(key) else {}, (key,))
        if g.empty:
            continue
        g = g.sort_values("ts_ns")
        if key.endswith("_total"):
            g["value"] = g["value"].diff().clip(lower=0)
            g = g.iloc[1:]
        g["wall_ns"] = g["ts_ns"].map(wall)
        out.append(g.assign(source="metrics")[["wall_ns", "metric", "value", "source"]])
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=["wall_ns", "metric", "value", "source"])


def server_percentiles(frame: pd.DataFrame, adapter: Any, t0_wall_ns: int | None = None,
                       t1_wall_ns: int | None = None, quantiles: tuple[float, ...] = QUANTILES) -> pd.DataFrame:
    """Per histogram of the adapter (``histogram_series``): observations in the window and bucket-interpolated
    percentiles in ms, with the bounds of the bucket that holds the P95 (the true value lies inside them).
    The window is the scrapes inside [t0, t1] (first to last); every scrape when unset."""
    rows = []
    for key in adapter.histogram_series:
        series = adapter.metric_names.get(key)
        if not series:
            continue
        b = histogram_buckets(frame, series, t0_wall_ns, t1_wall_ns)
        if b.empty:
            continue
        row: dict[str, Any] = {"metric": key.removesuffix("_seconds"), "series": series}
        mean = histogram_mean(frame, series, t0_wall_ns, t1_wall_ns)
        row["mean_ms"] = mean * 1e3 if mean is not None else None
        for q in quantiles:
            r = histogram_quantile(b, q)
            row[f"p{round(q * 100)}_ms"] = r["value"] * 1e3 if r["value"] is not None else None
            if q == 0.95:
                row["p95_bucket_ms"] = (f"({r['lo'] * 1e3:g}, {r['hi'] * 1e3:g}]" if r["lo"] is not None else "")
            row["observations"] = r["total"]
        rows.append(row)
    return pd.DataFrame(rows)


def read_clock(case_dir: Path) -> dict[str, Any]:
    p = Path(case_dir) / "server" / "engine_log_clock.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def read_metrics(case_dir: Path) -> pd.DataFrame:
    p = Path(case_dir) / "server" / "metrics.parquet"
    return pd.read_parquet(p) if p.is_file() else pd.DataFrame(columns=["ts_ns", "wall_ns", "name", "labels", "value",
                                                                       "type"])


def case_serverside(case_dir: Path, adapter: Any, t0_wall_ns: int, t1_wall_ns: int) -> ServerSide:
    """The server-side layer of the case in ``case_dir`` on the window [t0, t1] (wall ns), ``t_s`` from t0."""
    case_dir = Path(case_dir)
    notes: list[str] = []
    frame = read_metrics(case_dir)
    if frame.empty:
        notes.append("no /metrics scrape in this case")
    log_path = case_dir / "server" / "engine_log_excerpt.txt"
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    clock = read_clock(case_dir)
    lines, how = scheduler_lines(text, adapter, clock)
    shift = _start_shift_ns(case_dir, lines, adapter)
    if shift:
        lines.loc[lines["clock"] == "elapsed", "wall_ns"] += shift
        how += (f"; moved {shift / 1e6:.1f} ms later so that the first slot is not taken before the case's first "
                "request was sent (the recorded start precedes the engine's clock start)")
    if clock.get("truncated_head"):
        notes.append("the log excerpt kept only the case's last 200 000 characters")
    # 1 s timestamps (clock "wall"): keep the seconds that hold t0 and t1
    pad = 1_000_000_000 if not lines.empty and (lines["clock"] == "wall").any() else 0
    inside = lines["wall_ns"].between(t0_wall_ns - pad, t1_wall_ns + pad) if not lines.empty else []
    unplaced = lines[lines["wall_ns"].isna()] if not lines.empty else lines
    win_lines = pd.concat([lines[inside], unplaced]) if not lines.empty else lines
    series = pd.concat([metric_series(frame, adapter), _occupancy(lines, adapter)], ignore_index=True)
    if not lines.empty:
        placed = lines.dropna(subset=["wall_ns"])
        for col, name in LOG_SERIES.items():
            if col in placed:
                s = placed.dropna(subset=[col])
                series = pd.concat([series, pd.DataFrame({"wall_ns": s["wall_ns"].astype("int64"),
                                                          "metric": name, "value": s[col].astype(float),
                                                          "source": "log"})], ignore_index=True)
    occ = series[series["source"] == "log (counted)"] if not series.empty else series
    before = occ[occ["wall_ns"].astype("int64") < t0_wall_ns] if not occ.empty else occ
    if not before.empty:                     # counted from events: the state at t0 is known exactly
        series = pd.concat([series, before.iloc[[-1]].assign(wall_ns=t0_wall_ns)], ignore_index=True)
    if not series.empty:
        # scrapes carry this machine's ns clock: cut exactly; log values keep their lines' padding
        own_pad = np.where(series["source"] == "metrics", 0, pad)
        wall = series["wall_ns"].astype("int64")
        series = series[(wall >= t0_wall_ns - own_pad) & (wall <= t1_wall_ns + own_pad)].copy()
        series["value"] = series["value"].astype(float)
        series["t_s"] = (series["wall_ns"].astype("int64") - t0_wall_ns) / 1e9
    series = series.reindex(columns=SERIES_COLUMNS)
    if not win_lines.empty:
        win_lines = win_lines.copy()
        win_lines["t_s"] = (win_lines["wall_ns"] - t0_wall_ns) / 1e9
    hist = server_percentiles(frame, adapter)
    if not adapter.histogram_series:
        notes.append(f"{adapter.name} exposes no latency histograms on /metrics")
    if "kv_usage" not in adapter.metric_names:
        notes.append(f"{adapter.name} exports no KV-cache usage gauge: the KV row shows its other gauges")
    meta_id = case_dir.name
    return ServerSide(meta_id, adapter.name, t0_wall_ns, t1_wall_ns, series, win_lines, hist, how, notes)


def records_window(case_dir: Path, repeat: int = 0) -> tuple[int, int]:
    """(first scheduled send of a measured request — of any request where none has the role ``measure`` — , last
    stream end) of a case's requests of one repeat, warm-up left out, on the wall clock (ns): the window a client
    timeline of that repeat spans."""
    recs = [r for r in read_records(Path(case_dir) / "requests.jsonl") if r.repeat == repeat and r.role != "warmup"]
    if not recs:
        raise ValueError(f"{case_dir}: no measured requests in repeat {repeat}")
    first = [r for r in recs if r.role == "measure"] or recs
    t0 = min(r.scheduled_ns + r.wall_offset_ns for r in first)
    t1 = max((r.end_ns or r.scheduled_ns) + r.wall_offset_ns for r in recs)
    return t0, t1


CLIENT_KEYS = {"ttft": "ttft", "itl": "itl", "e2e": "e2el", "queue": None}


def client_vs_server(summary: dict[str, Any], hist: pd.DataFrame, case_id: str = "") -> pd.DataFrame:
    """The client's TTFT/ITL/E2E percentiles (one metric definition's pooled summary) beside the server's
    histogram percentiles of the same quantity; queue time has only the server's side."""
    rows = []
    for h in hist.to_dict("records") if not hist.empty else []:
        ck = CLIENT_KEYS.get(h["metric"])
        row: dict[str, Any] = {"case": case_id, "metric": h["metric"] if h["metric"] != "queue" else "queue time"}
        for st in ("mean", "p50", "p95", "p99"):
            row[f"client {st} (ms)"] = summary.get(f"{st}_{ck}_ms") if ck else None
            row[f"server {st} (ms)"] = h.get(f"{st}_ms")
        row["server P95 bucket (ms)"] = h.get("p95_bucket_ms", "")
        row["client requests"] = summary.get("completed") if ck else None
        row["server observations"] = h.get("observations")
        rows.append(row)
    return pd.DataFrame(rows)


def side_summary(side: ServerSide) -> dict[str, Any]:
    """One row of what the engine reported over a window: running / queued requests (``/metrics``), KV usage, slots
    counted from the log, scheduler lines, and the server's TTFT P95 where it has a histogram. None where absent."""
    s = side.series

    def stat(metric: str, how: str) -> float | None:
        v = s.loc[s["metric"] == metric, "value"] if not s.empty else pd.Series(dtype=float)
        return float(getattr(v, how)()) if len(v) else None
    kv = stat("kv_usage", "max")
    if kv is None:
        kv = stat("kv_usage (log)", "max")
    h = side.histograms.set_index("metric") if not side.histograms.empty else None
    return {"case": side.case_id, "engine": side.engine, "window (s)": round((side.t1_wall_ns - side.t0_wall_ns) / 1e9, 3),
            "running mean (req)": stat("running", "mean"), "running max (req)": stat("running", "max"),
            "queued max (req)": stat("waiting", "max"), "KV usage max (%)": kv * 100 if kv is not None else None,
            "slots in use max (log)": stat("slots in use (log)", "max"), "scheduler lines": len(side.lines),
            "server TTFT P95 (ms)": (h.loc["ttft", "p95_ms"] if h is not None and "ttft" in h.index else None),
            "notes": "; ".join(side.notes)}


# ---------------------------------------------------------------- the M1 join from the engine's log (no trace)

LOG_PLACEMENT_TOLERANCE_NS = 5_000_000     # log lines are placed on the wall clock within a few ms (see ``clock``)


@dataclass
class LogJoin:
    """Client chunk arrivals joined with the prefills the engine's log times (docs/metrics.md#m1-log-join):
    ``steps`` (one per logged prefill, in ``analyse.trace.stalls``' step schema), ``stalls`` (every decode-stream gap
    above the steady-state P99, with the prefills that overlapped it), ``ttft`` (each injected request's TTFT split
    into queueing, prefill and delivery), the threshold, how many gaps it rests on, and one line of what the log
    allows (``note``) — the tables are empty where the engine does not time prefills in its log."""
    steps: Any
    stalls: Any
    ttft: Any
    threshold_ms: float | None
    steady_gaps: int
    basis: str
    note: str
    timed: bool

    def summary(self) -> dict[str, Any]:
        if not self.timed:
            return {"timed": False, "note": self.note}
        s = self.stalls
        by_prefill = int((s["cause"] == "prefill").sum()) if s.height else 0
        worst = s.sort("gap_ms", descending=True).row(0, named=True) if s.height else None
        ident = self.ttft.filter(self.ttft["identified"]) if self.ttft.height else self.ttft
        return {"timed": True, "stalls": s.height, "by_prefill": by_prefill,
                "threshold_ms": self.threshold_ms, "steady_gaps": self.steady_gaps,
                "worst_gap_ms": worst["gap_ms"] if worst else None,
                "worst_step": worst["longest_step"] if worst else "",
                "injected": self.ttft.height, "ttft_split": ident.height}


def log_join(records: list[Any], side: ServerSide, adapter: Any, stream_roles: tuple[str, ...] = ("measure",),
             inject_roles: tuple[str, ...] = ("inject",)) -> LogJoin:
    """Join one window's client records with the prefills the engine's log times (same host: one wall clock; the
    log lines' placement error is the tolerance). The steady state is the decode streams' gaps outside every
    injected request's [send, first chunk]; a stall is a gap above its P99, attributed to the logged prefills it
    overlapped; an injected request's TTFT splits at its logged prefill."""
    empty = pl.DataFrame(schema=S.STEP_SCHEMA)
    pre = adapter.log_prefills(side.lines)
    if pre is None:
        return LogJoin(empty, pl.DataFrame(), pl.DataFrame(), None, 0, "", adapter.log_steps_note, False)
    steps = pl.DataFrame([{"rank": 0, "window": i, "name": f"task {p['task']}", "kind": "prefill",
                           "start_ns": p["start_ns"], "end_ns": p["end_ns"],
                           "dur_ms": (p["end_ns"] - p["start_ns"]) / 1e6, "span": "log",
                           "prefill_tokens": p["prompt_tokens"], "prefill_reqs": 1, "decode_reqs": None}
                          for i, p in enumerate(sorted(pre, key=lambda p: p["start_ns"]))],
                         schema=S.STEP_SCHEMA) if pre else empty
    gaps = S.client_gaps(records, stream_roles)
    inj = S.injection_windows([r for r in records if r.role in inject_roles])
    thr, n, basis = S.steady_p99(gaps, inj, roles=stream_roles)
    stalls = S.attribute_stalls(gaps, steps, thr) if thr is not None else S.attribute_stalls(gaps.head(0), steps, 0)
    # an injected request's prefill is the logged one of its own prompt length: a background request's short
    # prefill logged inside the injection's window must not be taken for (or added to) it
    sizes = {r.prompt_tokens or r.expected_input_tokens for r in records if r.role in inject_roles}
    own = steps.filter(pl.col("prefill_tokens").is_in(list(sizes))) if steps.height else steps
    ttft = S.ttft_split(records, own, inject_roles, tolerance_ns=LOG_PLACEMENT_TOLERANCE_NS)
    return LogJoin(steps, stalls, ttft, thr, n, basis, adapter.log_steps_note, True)


# ---------------------------------------------------------------- M1's log join on the page

def _short_id(rid: str) -> str:
    return "-".join(str(rid).split("-")[-3:])          # measure-0-4 / inject-0-2000000: role, repeat, index


def m1_stall_sentence(join: Any) -> str:
    """One findings sentence: M1's stalls and what overlapped them, the injected request's TTFT split."""
    if join is None:
        return "M1's stalls could not be joined with the engine's log (case files missing)."
    if not join.timed:
        return f"Stalls in M1 are not attributed on this page: {join.note}."
    sm = join.summary()
    if sm["threshold_ms"] is None:
        return "M1's decode streams left no steady-state gaps to set a stall threshold."
    text = (f"Stalls in M1's treatment (decode-stream gaps above the steady-state P99 {sm['threshold_ms']:.1f} ms, "
            f"from {sm['steady_gaps']} gaps): {sm['stalls']}, {sm['by_prefill']} of them overlapping a logged prefill")
    sp = join.ttft.filter(join.ttft["identified"]) if join.ttft.height else join.ttft
    if sp.height:
        r = sp.row(0, named=True)
        text += (f"; the injected request's TTFT {r['ttft_ms']:.1f} ms = queueing {r['queueing_ms']:.1f} + prefill "
                 f"{r['prefill_ms']:.1f} + delivery {r['delivery_ms']:.1f} ms")
    return text + "."


def m1_stall_summary(join: Any) -> pd.DataFrame:
    """One row per cause: how many decode-stream stalls (gaps above the steady-state P99), on how many streams,
    the worst gap and the logged prefill that overlapped it."""
    if join is None:
        return pd.DataFrame({"note": ["M1 did not run or its case files are missing: no stall attribution"]})
    if not join.timed:
        return pd.DataFrame({"note": [join.note]})
    st = join.stalls.to_pandas()
    if st.empty:
        return pd.DataFrame({"note": [f"no decode-stream gap above the steady-state P99 ({join.threshold_ms:.1f} ms "
                                      f"over {join.steady_gaps} gaps)" if join.threshold_ms is not None
                                      else "no steady-state gaps to set a threshold"]})
    st["cause"] = st["cause"].where(st["cause"] == "prefill", "no logged prefill")
    rows = []
    for cause, g in st.groupby("cause", sort=False):
        w = g.sort_values("gap_ms", ascending=False).iloc[0]
        rows.append({"cause": "overlapped a logged prefill" if cause == "prefill" else "overlapped no logged prefill",
                     "stalls": len(g), "streams": g["request_id"].nunique(), "worst gap (ms)": round(w["gap_ms"], 1),
                     "overlapping prefill": w["longest_step"] or "—",
                     f"threshold: steady P99 (ms, {join.steady_gaps} gaps)": round(join.threshold_ms, 1)})
    return pd.DataFrame(rows)


def m1_stalls_table(join: Any, limit: int = 24) -> pd.DataFrame:
    """Every stall (longest first, up to ``limit``): stream, chunk, gap, and the logged prefills it overlapped."""
    if join is None or not join.timed or join.stalls.height == 0:
        return m1_stall_summary(join)
    st = join.stalls.to_pandas().sort_values("gap_ms", ascending=False).head(limit)
    return pd.DataFrame({"stream": st["request_id"].map(_short_id), "chunk": st["chunk"],
                         "gap (ms)": st["gap_ms"].round(1),
                         "prefill overlap (% of gap)": st["step_cover_pct"].round().astype(int),
                         "overlapping prefills": st["steps"].replace("", "—")}).reset_index(drop=True)


def m1_ttft_split(join: Any) -> pd.DataFrame:
    """Each injected request's TTFT = queueing (send → slot taken) + prefill (the logged prompt evaluation) +
    delivery (prefill end → first chunk at the client)."""
    if join is None or not join.timed:
        return m1_stall_summary(join)
    t = join.ttft.to_pandas()
    if t.empty:
        return pd.DataFrame({"note": ["no injected request completed in M1's first repeat"]})
    return pd.DataFrame({"request": t["request_id"].map(_short_id), "input tokens": t["input_tokens"],
                         "TTFT (ms)": t["ttft_ms"].round(1), "queueing (ms)": t["queueing_ms"].round(1),
                         "prefill (ms)": t["prefill_ms"].round(1), "delivery (ms)": t["delivery_ms"].round(1),
                         "logged prefill": t["prefill_step"].replace("", "not in the log window")})


def lines_table(sides: dict[str, Any], limit: int = 30) -> pd.DataFrame:
    """The scheduler lines of each run's window (``{run: ServerSide}``, e.g. M1's control and treatment) as a table:
    run, time (s), event, the parsed numbers, the line."""
    frames = []
    for run, side in sides.items():
        ln = side.lines
        if ln is None or ln.empty:
            continue
        keep = [c for c in ln.columns if c not in ("order", "wall_ns", "line", "t_s", "event", "clock")]
        df = ln.assign(run=run).rename(columns={"t_s": "t (s)"})
        frames.append(df[["run", "t (s)", "event", *keep, "line"]])
    if not frames:
        return pd.DataFrame({"note": ["no scheduler lines in M1's engine log excerpts"]})
    out = pd.concat(frames, ignore_index=True).sort_values(["run", "t (s)"], na_position="last")
    out = out.groupby("run", sort=False).head(limit).round(4).reset_index(drop=True)
    for col in out.columns:                  # counts (slot, task, tokens, requests) as integers, not 25.00
        v = out[col]
        if v.dtype.kind == "f" and col != "t (s)" and v.dropna().eq(v.dropna().round()).all():
            out[col] = v.astype("Int64")
    return out


def clock_table(sides: dict[str, Any]) -> pd.DataFrame:
    """How each run's log lines were placed in time, and what the engine could not say."""
    if not sides:
        return pd.DataFrame({"note": ["no server-side view: M1 did not run or its case files are missing"]})
    return pd.DataFrame([{"run": run, "engine": s.engine, "log lines in window": len(s.lines),
                          "metric samples in window": len(s.series), "alignment": s.clock,
                          "notes": "; ".join(s.notes)} for run, s in sides.items()])
