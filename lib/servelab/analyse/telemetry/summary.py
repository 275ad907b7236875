"""Per-case, per-metric summaries inside the measurement window, between-case changes, and the
Phase 2 questions answered from the data (``docs/method.md#telemetry-questions``).

Rules (``docs/metrics.md#telemetry-summaries``): one ``case_<metric>_summary.csv`` per metric; each row lists the raw files,
the valid sample count, head and worker values, Mean/P95/Max, and the change between cases. Missing
data is ``-`` together with the collector's status — never 0.

Statistics pool every device of a node (all GPUs, all rails) over the window's samples. P95 is
``numpy.percentile(..., 95)`` with linear interpolation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from servelab.analyse.telemetry.frames import nan_to_dash
from servelab.analyse.telemetry.load import CaseTelemetry
from servelab.analyse.telemetry.parse_net import increments
from servelab.measure.telemetry.runner import NOT_CONFIGURED, OK
from servelab.analyse.telemetry.windows import coverage, slice_window

# The metrics every summary lists, per collector (so an absent collector still shows its rows as '-').
CATALOG: dict[str, list[str]] = {
    "nvidia-smi": ["util_gpu_pct", "util_mem_pct", "mem_used_mib", "mem_free_mib", "power_w", "temp_c",
                   "sm_clock_mhz", "mem_clock_mhz", "pstate"],
    "dcgm": ["dcgm_sm_active_pct", "dcgm_sm_occupancy_pct", "dcgm_tensor_active_pct", "dcgm_dram_active_pct",
             "pcie_tx_GBps", "pcie_rx_GBps", "nvlink_tx_GBps", "nvlink_rx_GBps"],
    "mpstat": ["cpu_busy_pct", "cpu_usr_pct", "cpu_sys_pct", "cpu_iowait_pct", "hottest_core_busy_pct"],
    "pidstat": ["proc_cpu_pct", "hottest_thread_cpu_pct", "proc_rss_mib", "proc_cswch_ps", "proc_nvcswch_ps"],
    "numastat": ["numa_top_node_share_pct"],
    "sar-net": ["net_rx_gbps", "net_tx_gbps", "net_rxerr_ps", "net_txerr_ps", "net_rxdrop_ps", "net_txdrop_ps"],
    "ethtool": ["eth_rx_gbps", "eth_tx_gbps", "rdma_vport_rx_gbps", "rdma_vport_tx_gbps"],
    "rdma": ["rdma_tx_gbps", "rdma_rx_gbps"],
    "perf-stat": ["perf_cpus_utilized", "perf_context_switches_per_s"],
}
STAT_COLS = ["n", "mean", "p95", "max"]


def _stats(values: np.ndarray) -> tuple[int, float, float, float]:
    v = values[~np.isnan(values)]
    if len(v) == 0:
        return 0, np.nan, np.nan, np.nan
    return len(v), float(v.mean()), float(np.percentile(v, 95)), float(v.max())


def _roles(nodes: Iterable[str], roles: dict[str, str] | None) -> dict[str, str]:
    nodes = list(dict.fromkeys(nodes))
    if roles:
        return {n: roles.get(n, "worker") for n in nodes}
    return {n: ("head" if i == 0 else "worker") for i, n in enumerate(nodes)}


def summarize_case(case: CaseTelemetry, roles: dict[str, str] | None = None,
                   catalog: dict[str, list[str]] | None = None) -> pd.DataFrame:
    """One row per (collector, metric): head/worker status, valid samples, mean, P95, max, raw files.

    ``roles`` maps node → ``head``/``worker`` (default: the first node with a status is the head).
    Values are NaN where there is no data; ``*_status`` says why (collector status, or ``ok, no
    samples in window``).
    """
    catalog = catalog or CATALOG
    if case.window is None:
        raise ValueError(f"case {case.case_id}: no measurement window — summaries are only computed inside one")
    inside = slice_window(case.samples, case.window)
    st_by = {(s.node, s.collector): s for s in case.statuses}
    role = _roles([s.node for s in case.statuses] + list(inside["node"].unique()), roles)
    rows = []
    for collector, metrics in catalog.items():
        for metric in metrics:
            row: dict[str, object] = {"case": case.case_id, "collector": collector, "metric": metric}
            raw = []
            for r in ("head", "worker"):
                nodes = [n for n, x in role.items() if x == r]
                vals = inside[(inside.metric == metric) & inside.node.isin(nodes)]["value"].to_numpy(dtype=float)
                n, mean, p95, mx = _stats(vals)
                sts = [st_by.get((nd, collector)) for nd in nodes]
                names = sorted({s.status for s in sts if s} or {NOT_CONFIGURED}) if nodes else ["no node"]
                status = "/".join(names)
                if status == OK and n == 0:
                    status = "ok, no samples in window"
                raw += [s.raw_file for s in sts if s and s.started]
                row.update({f"{r}_status": status, f"{r}_n": n, f"{r}_mean": mean, f"{r}_p95": p95, f"{r}_max": mx})
            row["raw_files"] = " ".join(sorted(set(raw)))
            rows.append(row)
    return pd.DataFrame(rows)


def summarize_by_device(case: CaseTelemetry, metrics: list[str]) -> pd.DataFrame:
    """Per node and device (GPU, core, rail, thread): samples, mean, P95, max inside the window."""
    inside = slice_window(case.samples, case.window)
    inside = inside[inside.metric.isin(metrics)]
    rows = []
    for (node, metric, dev), g in inside.groupby(["node", "metric", "device"]):
        n, mean, p95, mx = _stats(g["value"].to_numpy(dtype=float))
        rows.append((case.case_id, node, metric, dev, n, mean, p95, mx))
    return pd.DataFrame(rows, columns=["case", "node", "metric", "device", "n", "mean", "p95", "max"])


def compare_cases(summary: pd.DataFrame, baseline: str | None = None) -> pd.DataFrame:
    """Add ``head_mean_change_pct`` / ``worker_mean_change_pct``: change of each case's mean against the
    ``baseline`` case (default: the first case) for the same metric; NaN where either side is missing."""
    if summary.empty:
        return summary
    base_case = baseline or summary["case"].iloc[0]
    if base_case not in set(summary["case"]):
        raise ValueError(f"baseline case '{base_case}' is not among {sorted(set(summary['case']))}")
    base = summary[summary.case == base_case].set_index(["collector", "metric"])
    out = summary.copy()
    for r in ("head", "worker"):
        b = out.set_index(["collector", "metric"]).index.map(base[f"{r}_mean"].to_dict()).to_numpy(dtype=float)
        cur = out[f"{r}_mean"].to_numpy(dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[f"{r}_mean_change_pct"] = np.where(np.abs(b) > 0, 100 * (cur - b) / np.abs(b), np.nan)
    out["baseline_case"] = base_case
    return out


def write_metric_csvs(summary: pd.DataFrame, out_dir: Path) -> list[Path]:
    """One ``case_<metric>_summary.csv`` per metric (rows = cases) plus ``telemetry_summary.csv``;
    missing numbers written as ``-``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, g in summary.groupby("metric", sort=False):
        p = out_dir / f"case_{metric}_summary.csv"
        nan_to_dash(g.reset_index(drop=True)).to_csv(p, index=False)
        paths.append(p)
    p = out_dir / "telemetry_summary.csv"
    nan_to_dash(summary).to_csv(p, index=False)
    return paths + [p]


def _fmt(x: float, unit: str = "", digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}{unit}"


def answer_questions(case: CaseTelemetry, netdevs: list[str] | None = None) -> pd.DataFrame:
    """The Phase 2 questions for one case (``docs/method.md#telemetry-questions``), answered from the samples inside its window.

    Columns: case, question, answer (``yes``/``no``/``-``), evidence, source status. ``-`` means the
    data to answer is missing; the status column says which collector and why.
    """
    inside = slice_window(case.samples, case.window)
    st = {}
    for s in case.statuses:
        st.setdefault(s.collector, set()).add(f"{s.node}:{s.status}")

    def status(*collectors: str) -> str:
        parts = [", ".join(sorted(st[c])) if c in st else f"{c}: {NOT_CONFIGURED}" for c in collectors]
        return "; ".join(f"{c} [{p}]" if c in st else p for c, p in zip(collectors, parts))

    def vals(metric: str) -> pd.DataFrame:
        return inside[inside.metric == metric]

    rows = []
    q = "Is a single CPU core saturated (hot core) while the machine is not?"
    hot, allc = vals("hottest_core_busy_pct"), vals("cpu_busy_pct")
    thr = vals("thread_cpu_pct")
    if hot.empty or allc.empty:
        rows.append((q, "-", "no mpstat samples in the window", status("mpstat")))
    else:
        hp95, amean = float(np.percentile(hot.value, 95)), float(allc.value.mean())
        top = thr.groupby("device")["value"].mean().sort_values(ascending=False) if not thr.empty else pd.Series(dtype=float)
        tinfo = f"; hottest engine thread {top.index[0]} mean {top.iloc[0]:.0f}%" if len(top) else ""
        ans = "yes" if hp95 >= 90 and amean < 75 else "no"
        rows.append((q, ans, f"hottest core P95 {hp95:.0f}% busy, machine mean {amean:.0f}%{tinfo}",
                     status("mpstat", "pidstat")))
    q = "Is the whole machine CPU saturated or waiting on I/O?"
    io = vals("cpu_iowait_pct")
    if allc.empty:
        rows.append((q, "-", "no mpstat samples in the window", status("mpstat")))
    else:
        m, iw = float(allc.value.mean()), float(io.value.mean()) if not io.empty else float("nan")
        rows.append((q, "yes" if m >= 85 or iw >= 10 else "no", f"busy mean {m:.0f}%, iowait mean {_fmt(iw, '%')}",
                     status("mpstat")))
    q = "Does the engine's memory span NUMA nodes (remote access risk)?"
    share, nn = vals("numa_top_node_share_pct"), vals("numa_nodes")
    if share.empty:
        rows.append((q, "-", "no numastat samples in the window", status("numastat")))
    else:
        nodes = int(nn.value.max()) if not nn.empty else 0
        s = float(share.value.min())
        if nodes <= 1:
            rows.append((q, "no", f"the machine has {nodes} NUMA node: all memory is local", status("numastat")))
        else:
            rows.append((q, "yes" if s < 90 else "no", f"largest node holds {s:.0f}% of the engine memory "
                         f"({nodes} nodes)", status("numastat")))
    q = "Do all rails carry traffic, and are they balanced?"
    rail = inside[inside.metric.isin(["rdma_tx_gbps", "rdma_vport_tx_gbps", "eth_tx_gbps"])]
    if netdevs:
        rail = rail[rail.device.isin(netdevs) | rail.source.eq("rdma")]
    if rail.empty:
        rows.append((q, "-", "no RDMA/NIC counter samples in the window", status("rdma", "ethtool")))
    else:
        metric = next(m for m in ("rdma_tx_gbps", "rdma_vport_tx_gbps", "eth_tx_gbps") if m in set(rail.metric))
        per = rail[rail.metric == metric].groupby(["node", "device"])["value"].mean()
        idle = per[per < 0.01]
        spread = (per.max() - per.min()) / per.max() * 100 if per.max() > 0 else float("nan")
        ans = "yes" if idle.empty and spread == spread and spread <= 20 else "no"
        ev = ", ".join(f"{n}/{d} {v:.2f}" for (n, d), v in per.items())
        rows.append((q, ans, f"{metric} mean per rail: {ev} (spread {_fmt(spread, '%', 0)})", status("rdma", "ethtool")))
    q = "Any NIC/RDMA errors, drops, pauses or congestion in the window?"
    inc = increments(case.counters, case.window.start_ns, case.window.end_ns) if not case.counters.empty else None
    sar_err = inside[inside.metric.isin(["net_rxerr_ps", "net_txerr_ps", "net_rxdrop_ps", "net_txdrop_ps"])]
    if (inc is None or inc.empty) and sar_err.empty:
        rows.append((q, "-", "no counter samples in the window", status("sar-net", "ethtool", "rdma")))
    else:
        bad = inc[inc.increment > 0] if inc is not None and not inc.empty else pd.DataFrame()
        sar_bad = float(sar_err.value.sum()) if not sar_err.empty else 0.0
        ev = ", ".join(f"{r.device} {r.counter} +{r.increment:.0f}" for r in bad.itertuples()) if len(bad) else ""
        ev = ev or "no counter increased"
        ev += f"; sar errors/drops per-s sum {sar_bad:.2f}" if not sar_err.empty else ""
        rows.append((q, "yes" if len(bad) or sar_bad > 0 else "no", ev, status("sar-net", "ethtool", "rdma")))
    q = "Did GPU clocks drop or the GPU leave P0 (throttling)?"
    clk, ps = vals("sm_clock_mhz"), vals("pstate")
    if clk.empty:
        rows.append((q, "-", "no nvidia-smi samples in the window", status("nvidia-smi")))
    else:
        lo, hi = float(clk.value.min()), float(clk.value.max())
        worst = float(ps.value.max()) if not ps.empty else float("nan")
        rows.append((q, "yes" if lo < 0.9 * hi or worst > 0 else "no",
                     f"SM clock {lo:.0f}–{hi:.0f} MHz, worst P-state P{_fmt(worst, '', 0)}", status("nvidia-smi")))
    q = "How much GPU memory is left (headroom)?"
    free = vals("mem_free_mib")
    if free.empty:
        rows.append((q, "-", "no nvidia-smi samples in the window", status("nvidia-smi")))
    else:
        mn = float(free.value.min())
        rows.append((q, "yes" if mn < 4096 else "no", f"min free {mn / 1024:.1f} GiB on the tightest GPU "
                     "(answer 'yes' = under 4 GiB)", status("nvidia-smi")))
    out = pd.DataFrame(rows, columns=["question", "answer", "evidence", "source status"])
    out.insert(0, "case", case.case_id)
    return out


def coverage_table(cases: list[CaseTelemetry]) -> pd.DataFrame:
    """Window coverage of every source of every case (see ``windows.coverage``)."""
    frames = [coverage(c.samples, c.window, {(s.node, s.collector): s.interval_s for s in c.statuses})
              for c in cases if c.window is not None]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
        columns=["case", "node", "source", "samples", "covered"])


def status_table(cases: list[CaseTelemetry]) -> pd.DataFrame:
    """Every collector's status per case and node (required flag, reason, raw file, bytes)."""
    rows = [(c.case_id, s.node, s.collector, s.required, s.status, s.reason, s.raw_file, s.raw_bytes)
            for c in cases for s in c.statuses]
    return pd.DataFrame(rows, columns=["case", "node", "collector", "required", "status", "reason", "raw_file",
                                       "raw_bytes"])
