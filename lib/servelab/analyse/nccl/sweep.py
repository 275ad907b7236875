"""A folder of nccl-tests runs (``servelab.measure.nccl_tests``: ``runs.jsonl`` + ``logs/``) → the per-run verdicts,
the one-variable sweep table with its deltas and noise verdicts, the setting that wins at the model's message sizes,
the P2P matrix, and whether each swept variable reached NCCL (``docs/method.md#comm-runs``).

The sweep follows the project's A/B noise rule (``docs/metrics.md#ab-noise``) on the time per call (µs,
out-of-place, nccl-tests' average over its iterations), per scope, node, collective and size, over the repeats of
each side: ``Δ% = 100 · (mean_setting − mean_baseline) / mean_baseline``; **within noise** when ``|Δ%| ≤ 2 ·
max(CV_baseline, CV_setting)`` or the two sides' min–max ranges overlap, else ``faster`` or ``slower``; fewer than
two repeats on a side: ``no repeats``. Time, not busbw, carries the verdict because it is defined for every rank
count (a 1-rank all-reduce has busbw 0 by nccl-tests' factor 2(n−1)/n); at one size the busbw change is the time
change inverted.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from servelab.analyse.nccl.perf_log import NcclTestRun, parse_run
from servelab.deploy.nccl_info import PREFIX_RE
from servelab.measure.env_reach import nccl_env_lines

NOISE_K = 2.0
SWEEP_SCOPES = ("node", "cross-node")
ENV_SET_RE = re.compile(r"NCCL INFO (?P<var>[A-Z][A-Z0-9_]*) set by environment to (?P<val>[^\s.]+(?:\.\d+)?)\.?\s*$",
                        re.MULTILINE)


class SweepFolderError(ValueError):
    """The folder is not a nccl-tests runs folder (one line saying why)."""


@dataclass
class SweepData:
    """Every run of a folder: its record, its parsed log, and the rows of its size table."""
    folder: Path
    records: list[dict[str, Any]]
    parsed: list[NcclTestRun]
    runs: pd.DataFrame           # one line per run: what ran and its verdict
    rows: pd.DataFrame           # every size-table row, with the run's scope, node, setting, repeat, status
    texts: dict[str, str] = field(default_factory=dict)


def read_records(folder: Path) -> list[dict[str, Any]]:
    folder = Path(folder)
    p = folder / "runs.jsonl"
    if not p.is_file():
        raise SweepFolderError(f"{folder} holds no runs.jsonl: not a folder written by servelab.measure.nccl_tests")
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise SweepFolderError(f"{p} line {i} is not JSON ({exc.msg}); the runner writes one object per line") from None
    if not out:
        raise SweepFolderError(f"{p} is empty: no run was recorded")
    return out


def load_sweep(folder: Path) -> SweepData:
    """Read ``runs.jsonl`` and parse each run's log with its exit code (``perf_log.parse_run``)."""
    folder = Path(folder)
    records = read_records(folder)
    parsed, lines, frames, texts = [], [], [], {}
    for r in records:
        log = folder / str(r.get("log", ""))
        text = log.read_text(errors="replace") if log.is_file() else ""
        texts[r["run_id"]] = text
        run = parse_run(text, r.get("collective", ""), r.get("exit_code"), str(log))
        if not log.is_file():
            run.status, run.reason = "failed", f"log {r.get('log')} missing"
        parsed.append(run)
        oop = run.rows[run.rows.placement == "out-of-place"] if not run.rows.empty else run.rows
        lines.append({
            "run_id": r["run_id"], "scope": r.get("scope", ""), "node": r.get("node", ""),
            "collective": r.get("collective", run.collective), "setting": r.get("setting", "baseline"),
            "repeat": int(r.get("repeat", 1)), "ranks": run.nranks or int(r.get("ranks", 0)), "pair": r.get("pair", ""),
            "exit_code": r.get("exit_code"), "seconds": r.get("seconds"),
            "sizes": int(oop.size_bytes.nunique()) if not oop.empty else 0,
            "peak_busbw_gbps": float(oop.busbw_gbps.max()) if not oop.empty else np.nan,
            "small_msg_time_us": float(oop.time_us.iloc[0]) if not oop.empty else np.nan,
            "status": run.status, "reason": (r.get("note") + "; " if r.get("note") else "") + run.reason,
        })
        if not run.rows.empty:
            frames.append(run.rows.assign(run_id=r["run_id"], scope=r.get("scope", ""), node=r.get("node", ""),
                                          collective=r.get("collective", run.collective),
                                          setting=r.get("setting", "baseline"), repeat=int(r.get("repeat", 1)),
                                          pair=r.get("pair", ""), nranks=run.nranks, status=run.status))
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return SweepData(folder, records, parsed, pd.DataFrame(lines), rows, texts)


def _cv(x: pd.Series) -> float:
    return float(100 * x.std(ddof=1) / x.mean()) if len(x) > 1 and x.mean() > 0 else np.nan


def sweep_table(data: SweepData, placement: str = "out-of-place") -> pd.DataFrame:
    """Per scope, node, collective, size and setting: runs, mean time (µs) and its CV, mean busbw, and against the
    baseline of the same scope/node/collective/size: Δ time %, Δ busbw % and the noise verdict (module doc). Only
    runs whose verdict is ``ok`` count."""
    cols = ["scope", "node", "collective", "size_bytes", "setting", "runs", "time_us", "time_cv_pct", "busbw_gbps",
            "algbw_gbps", "delta_time_pct", "delta_busbw_pct", "verdict"]
    r = data.rows
    if r.empty:
        return pd.DataFrame(columns=cols)
    r = r[(r.placement == placement) & r.scope.isin(SWEEP_SCOPES) & (r.status == "ok")]
    if r.empty:
        return pd.DataFrame(columns=cols)
    keys = ["scope", "node", "collective", "size_bytes"]
    g = r.groupby([*keys, "setting"], sort=False)
    t = g.agg(runs=("time_us", "size"), time_us=("time_us", "mean"), tmin=("time_us", "min"), tmax=("time_us", "max"),
              busbw_gbps=("busbw_gbps", "mean"), algbw_gbps=("algbw_gbps", "mean")).reset_index()
    t["time_cv_pct"] = g["time_us"].apply(_cv).to_numpy()
    base = t[t.setting == "baseline"].set_index(keys)
    out = []
    for row in t.itertuples(index=False):
        d = row._asdict()
        k = tuple(d[c] for c in keys)
        if row.setting == "baseline" or k not in base.index:
            d.update(delta_time_pct=np.nan, delta_busbw_pct=np.nan,
                     verdict="baseline" if row.setting == "baseline" else "no baseline")
        else:
            b = base.loc[k]
            dt = 100 * (row.time_us - b.time_us) / b.time_us if b.time_us > 0 else np.nan
            db = 100 * (row.busbw_gbps - b.busbw_gbps) / b.busbw_gbps if b.busbw_gbps > 0 else np.nan
            if row.runs < 2 or b.runs < 2:
                verdict = "no repeats"
            elif (abs(dt) <= NOISE_K * np.nanmax([row.time_cv_pct, b.time_cv_pct, 0.0])
                  or (row.tmin <= b.tmax and b.tmin <= row.tmax)):
                verdict = "within noise"
            else:
                verdict = "faster" if dt < 0 else "slower"
            d.update(delta_time_pct=dt, delta_busbw_pct=db, verdict=verdict)
        out.append(d)
    return pd.DataFrame(out)[cols]


def sweep_wide(table: pd.DataFrame, sizes: list[int] | None = None) -> pd.DataFrame:
    """The sweep table one line per scope/node/collective/size: the baseline's busbw and time, then per setting its
    busbw and Δ time % with the verdict (e.g. ``-3.1 % faster``)."""
    if table.empty:
        return pd.DataFrame()
    t = table if sizes is None else table[table.size_bytes.isin(sizes)]
    swept = set(t[t.setting != "baseline"].collective)
    t = t[t.collective.isin(swept)]
    if t.empty:
        return pd.DataFrame()
    keys = ["scope", "node", "collective", "size_bytes"]
    out = []
    for k, g in t.groupby(keys, sort=False):
        d = dict(zip(keys, k))
        b = g[g.setting == "baseline"]
        d["baseline busbw (GB/s)"] = float(b.busbw_gbps.iloc[0]) if len(b) else np.nan
        d["baseline time (µs)"] = float(b.time_us.iloc[0]) if len(b) else np.nan
        for r in g[g.setting != "baseline"].itertuples():
            d[f"{r.setting} busbw (GB/s)"] = r.busbw_gbps
            d[f"{r.setting} Δ time"] = ("-" if pd.isna(r.delta_time_pct) else f"{r.delta_time_pct:+.1f} % {r.verdict}")
        out.append(d)
    return pd.DataFrame(out).rename(columns={"size_bytes": "size (B)"})


def winners(table: pd.DataFrame, msgs: pd.DataFrame, env: pd.DataFrame | None = None) -> pd.DataFrame:
    """For each of the model's messages (``scenario``, ``collective``, ``msg_bytes``) and each swept scope/node: the
    measured size nearest to it (in log2), the baseline time there, and the setting that is ``faster`` beyond noise
    by the most — or ``baseline`` when none is. With the :func:`env_check` table, a setting whose variable NCCL did
    not report reading on that node never wins: its runs measured the default, whatever they show."""
    cols = ["scope", "node", "scenario", "collective", "msg_bytes", "measured_size_bytes", "baseline_time_us",
            "best_setting", "best_time_us", "delta_time_pct", "verdict", "settings_compared"]
    if table.empty or msgs is None or msgs.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for (scope, node, coll), g in table.groupby(["scope", "node", "collective"], sort=False):
        if (g.setting != "baseline").sum() == 0:
            continue
        for m in msgs[msgs.collective == coll].itertuples():
            sizes = np.array(sorted(g.size_bytes.unique()), dtype=float)
            near = int(sizes[np.argmin(np.abs(np.log2(sizes) - np.log2(float(m.msg_bytes))))])
            at = g[g.size_bytes == near]
            b = at[at.setting == "baseline"]
            others = at[at.setting != "baseline"]
            unproven = set()
            if env is not None and not env.empty:
                e = env[(env.node == node) & (env.verdict != "reached NCCL")]
                unproven = set(e.setting)
            faster = others[(others.verdict == "faster") & ~others.setting.isin(unproven)].sort_values("time_us")
            ignored = sorted(set(others[(others.verdict == "faster") & others.setting.isin(unproven)].setting))
            row = {"scope": scope, "node": node, "scenario": m.scenario, "collective": coll, "msg_bytes": int(m.msg_bytes),
                   "measured_size_bytes": near, "baseline_time_us": float(b.time_us.iloc[0]) if len(b) else np.nan,
                   "settings_compared": len(others)}
            if len(faster):
                w = faster.iloc[0]
                row.update(best_setting=w.setting, best_time_us=w.time_us, delta_time_pct=w.delta_time_pct,
                           verdict="faster beyond noise")
            else:
                verdicts = sorted(set(others[~others.setting.isin(ignored)].verdict))
                row.update(best_setting="baseline", best_time_us=row["baseline_time_us"], delta_time_pct=0.0,
                           verdict="no setting is faster beyond noise" + (f" ({', '.join(verdicts)})" if verdicts else "")
                           + (f"; {', '.join(ignored)} looked faster but NCCL did not report reading "
                              f"{'them' if len(ignored) > 1 else 'it'}: not evidence" if ignored else ""))
            out.append(row)
    return pd.DataFrame(out, columns=cols)


def p2p_matrix(data: SweepData, placement: str = "out-of-place") -> pd.DataFrame:
    """Per node and GPU pair (the ``p2p`` runs: ``sendrecv_perf -g 2`` on ``CUDA_VISIBLE_DEVICES=i,j``): busbw at
    the largest size (GB/s; send/recv busbw = algbw) and time at the smallest (µs), averaged over repeats."""
    cols = ["node", "gpu_a", "gpu_b", "largest_size_bytes", "busbw_gbps", "smallest_size_bytes", "time_us", "status"]
    runs = data.runs[data.runs.scope == "p2p"] if not data.runs.empty else data.runs
    if runs.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for (node, pair), g in runs.groupby(["node", "pair"], sort=False):
        a, b = (int(x) for x in str(pair).split(","))
        rows = data.rows[(data.rows.run_id.isin(g.run_id)) & (data.rows.placement == placement)] if not data.rows.empty \
            else pd.DataFrame()
        ok = (g.status == "ok").all()
        if rows.empty:
            out.append({"node": node, "gpu_a": a, "gpu_b": b, "largest_size_bytes": np.nan, "busbw_gbps": np.nan,
                        "smallest_size_bytes": np.nan, "time_us": np.nan,
                        "status": "; ".join(f"{s}: {r}" for s, r in zip(g.status, g.reason))})
            continue
        hi, lo = rows.size_bytes.max(), rows.size_bytes.min()
        out.append({"node": node, "gpu_a": a, "gpu_b": b, "largest_size_bytes": int(hi),
                    "busbw_gbps": float(rows[rows.size_bytes == hi].busbw_gbps.mean()), "smallest_size_bytes": int(lo),
                    "time_us": float(rows[rows.size_bytes == lo].time_us.mean()),
                    "status": "ok" if ok else "; ".join(sorted(set(g.status)))})
    return pd.DataFrame(out, columns=cols)


def p2p_from_run(run: NcclTestRun, node: str, placement: str = "out-of-place") -> pd.DataFrame:
    """A 2-GPU ``sendrecv_perf`` run read as the P2P matrix entry of its two devices (``#  Rank`` lines)."""
    if run.rows.empty or len(run.devices) != 2:
        return pd.DataFrame()
    rows = run.rows[run.rows.placement == placement]
    hi, lo = rows.size_bytes.max(), rows.size_bytes.min()
    a, b = sorted(int(x) for x in run.devices.device)
    return pd.DataFrame([{"node": node, "gpu_a": a, "gpu_b": b, "largest_size_bytes": int(hi),
                          "busbw_gbps": float(rows[rows.size_bytes == hi].busbw_gbps.mean()),
                          "smallest_size_bytes": int(lo), "time_us": float(rows[rows.size_bytes == lo].time_us.mean()),
                          "status": run.status}])


def p2p_pivot(matrix: pd.DataFrame, value: str = "busbw_gbps") -> pd.DataFrame:
    """One square table per node (stacked): GPU i × GPU j, the pair's value in both triangles, ``-`` on the
    diagonal."""
    if matrix.empty:
        return pd.DataFrame()
    out = []
    for node, g in matrix.groupby("node", sort=False):
        gpus = sorted(set(g.gpu_a) | set(g.gpu_b))
        for i in gpus:
            d: dict[str, Any] = {"node": node, "GPU": i}
            for j in gpus:
                hit = g[((g.gpu_a == i) & (g.gpu_b == j)) | ((g.gpu_a == j) & (g.gpu_b == i))]
                d[f"GPU {j}"] = "-" if i == j else (f"{hit[value].iloc[0]:,.1f}" if len(hit) and hit[value].notna().iloc[0]
                                                   else "n/a")
            out.append(d)
    return pd.DataFrame(out)


def env_check(data: SweepData) -> pd.DataFrame:
    """For each ``env-check`` run (``NCCL_DEBUG=INFO``): the variable and value set, what NCCL's INFO log says it
    read (``<VAR> set by environment to <value>``), and the verdict — ``reached NCCL``, ``NCCL reported another
    value``, ``not reported by NCCL`` (then the sweep's runs of that setting prove nothing about it), or — the
    rank check of every environment-variable A/B (:mod:`servelab.measure.env_reach`, joined by the line's pid) —
    ``not reported by every rank`` when some process that logged NCCL INFO lines never said it read the variable
    (``missing_on``: those processes as ``host:pid``)."""
    cols = ["node", "setting", "variable", "value", "nccl_says", "verdict", "missing_on", "ranks", "status"]
    out = []
    for r in data.records:
        if r.get("scope") != "env-check":
            continue
        var, val = r.get("variable", ""), str(r.get("value", ""))
        text = data.texts.get(r["run_id"], "")
        said = [m["val"] for m in ENV_SET_RE.finditer(text) if m["var"] == var]
        by_pid = {pid: v for (pid, name), v in nccl_env_lines(text).items() if name == var}
        procs = {int(m["pid"]): m["host"] for m in map(PREFIX_RE.search, text.splitlines()) if m is not None}
        missing = [f"{procs[p]}:{p}" for p in sorted(procs) if p not in by_pid]
        run = next((p for p, rec in zip(data.parsed, data.records) if rec is r), None)
        if not said:
            verdict = "not reported by NCCL"
        elif not all(s.rstrip(".") == val for s in said):
            verdict = "NCCL reported another value"
        elif missing:
            verdict = "not reported by every rank"
        else:
            verdict = "reached NCCL"
        out.append({"node": r.get("node", ""), "setting": r.get("setting", ""), "variable": var, "value": val,
                    "nccl_says": ", ".join(dict.fromkeys(said)) or "-", "verdict": verdict,
                    "missing_on": ", ".join(missing) if said and missing else "-",
                    "ranks": run.nranks if run else r.get("ranks"), "status": run.status if run else "-"})
    return pd.DataFrame(out, columns=cols)
