"""What the Phase 2 notebook calls: plan the collectors per node, run them around cases, and turn the
result into the page's tables and figures (compute here, draw in ``figures``, nothing printed).

``run_engine_cases`` is the real thing: it starts the target's engine and runs Phase 1 cases (long
prefill, concurrent prefill, decode, the mixed A/B) with the collectors started on every node before each
case and stopped after it; every sample is sliced to the client's own measurement window of that case
(``meta.json`` ``windows_wall_ns``). ``run_local_cases`` runs synthetic CPU workloads (idle / one hot core /
all cores) to show the collectors' own behaviour without an engine. A cluster target without a live
session gets its collector plan recorded as ``planned`` commands.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from servelab.core.params import PhaseParams, param
from servelab.deploy.hosts import connect, ProcessTracker
from servelab.measure import request_metrics as mx
from servelab.core.paths import samples_root
from servelab.measure.telemetry import collectors as C
from servelab.measure.telemetry.collectors import display_argv
from servelab.analyse.telemetry.figures import timeseries_figure
from servelab.analyse.telemetry.frames import nan_to_dash
from servelab.analyse.telemetry.load import CaseTelemetry, load_case_telemetry
from servelab.analyse.telemetry.parse_smi import parse_smi_csv
from servelab.measure.telemetry.runner import (NOT_CONFIGURED, OK, CollectorStatus, NodePlan, RequiredCollectorError,
                                       read_statuses, start_telemetry)
from servelab.analyse.telemetry.summary import (CATALOG, answer_questions, compare_cases, coverage_table, status_table,
                                        summarize_case, write_metric_csvs)
from servelab.analyse.telemetry.windows import CaseWindow
from servelab.analyse.serverside import case_serverside, side_summary
from servelab.deploy.engines import engine_for
from servelab.deploy.server import start_server, stop_server
from servelab.measure.case import EngineCrash, make_env
from servelab.measure.matrix import dispatch_case, quick_matrix
from servelab.phases.context import PhaseContext
from servelab.report.ledger import evidence_frame, record_evidence
from servelab.report.findings import format_value
from servelab.measure.request_metrics import min_samples

WORKLOAD = (
    "import hashlib, json, sys, threading, time\n"
    "pre, busy, threads, out = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]\n"
    "time.sleep(pre)\n"
    "buf = b'x' * (1 << 20)\n"
    "start = time.time_ns(); end = start + int(busy * 1e9)\n"
    "def spin():\n"
    "    while time.time_ns() < end:\n"
    "        hashlib.sha256(buf).digest()\n"
    "ts = [threading.Thread(target=spin) for _ in range(threads)]\n"
    "[t.start() for t in ts]\n"
    "time.sleep(max(0.0, (end - time.time_ns()) / 1e9)) if not ts else [t.join() for t in ts]\n"
    "stop = time.time_ns()\n"
    "open(out + '.tmp', 'w').write(json.dumps(dict(start_ns=start, end_ns=stop, threads=threads)))\n"
    "import os; os.replace(out + '.tmp', out)\n"
    "time.sleep(120)\n"
)
LOCAL_CASES = [("idle", 0), ("one_hot_core", 1), ("all_cores", 0)]   # all_cores → os.cpu_count() threads
FIGURE_METRICS = ["cpu_busy_pct", "hottest_core_busy_pct", "proc_cpu_pct", "util_gpu_pct", "rdma_tx_gbps"]


@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 2's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase2 --cell``); ``-p`` and ``params/phase2.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase2"
    run_id: str = param("", "empty : new run")
    workload: str = param("engine",
        "engine: Phase 1 cases on the real engine; cpu: synthetic CPU workloads only [one of engine, cpu]")
    cases: list = param([],
        "Phase 1 case ids to replay; empty: P3, the highest-concurrency P4 and the middle D2 point of the "
        "target's scale, D3, D4, M1_control, M1_treatment")
    case_seconds: float = param(4.0, "length of each local CPU workload window (s) [above 0]")
    interval_s: float = param(1.0, "sampling interval of the 1 s collectors (whole seconds for sysstat) [above 0]")
    show_h200_sample: bool = param(True, "also show the recorded 2 x H200 nvidia-smi capture from data/samples")


@dataclass
class Phase2Run:
    """The cases measured in this phase and the tables the page shows."""
    cases: list[CaseTelemetry]
    plan: pd.DataFrame
    statuses: pd.DataFrame
    coverage: pd.DataFrame
    failures: list[str] = field(default_factory=list)


@dataclass
class Phase2Result:
    """Phase 2's result (the phase contract): the cases measured, their summary table, and the recorded H200
    sample with its summary when the page shows it."""
    run: Phase2Run
    table: pd.DataFrame
    h200: list[CaseTelemetry] | None = None
    h200_table: pd.DataFrame | None = None

    @property
    def failures(self) -> list[str]:
        return self.run.failures

    def headline(self) -> dict[str, Any]:
        return headline(self.run, self.table)

    def findings(self) -> list[str]:
        return findings(self.run, self.table, self.h200_table)


def run(ctx: PhaseContext) -> Phase2Result:
    """Phase 2's entry (the phase contract), from the notebook's parameters (``ctx.params``): the Phase 1 cases on
    the engine (``workload`` engine) or the local CPU workloads under the collectors, their summary, and the
    recorded 2 x H200 capture with its summary when ``show_h200_sample``."""
    p = ctx.params
    measured = (run_engine_cases(ctx, p.cases or None, p.interval_s) if p.workload == "engine"
                else run_local_cases(ctx, p.case_seconds, p.interval_s))
    table = summary(ctx, measured)
    h200 = h200_sample_cases() if p.show_h200_sample else None
    return Phase2Result(measured, table, h200, sample_summary(ctx, h200) if h200 else None)


def node_specs(node: Any, pid: int | None, interval_s: float = 1.0, python: str = "python3") -> list[C.CollectorSpec]:
    """The collector set (``docs/method.md#telemetry``) for one target node (GPU, rail and HCA collectors required when the
    node declares GPUs/netdevs/HCAs)."""
    return C.default_collectors(pid=pid, netdevs=list(getattr(node, "netdevs", []) or []) or None,
                                hcas=list(getattr(node, "hcas", []) or []) or None, gpus=int(getattr(node, "gpus", 0)),
                                interval_s=interval_s, python=python)


def collector_plan(ctx: PhaseContext, interval_s: float | None = None) -> pd.DataFrame:
    """Per node: every collector, required or optional, what it records and the program it runs. The complete
    commands — with the engine's pid, known once it started — are in the commands section as executed.
    ``interval_s`` None: the phase's ``interval_s`` parameter (1 s without one)."""
    if interval_s is None:
        interval_s = float(ctx.params.interval_s)
    rows = []
    attached = getattr(ctx.target, "attached", False)
    for node in ctx.target.nodes:
        # an attached server's pid is not known (servelab did not start it): its per-process collectors do not run
        runs = {s.name for s in node_specs(node, None, interval_s)} if attached else None
        for s in node_specs(node, 999999, interval_s):
            progs = [Path(p).name for p in s.requires] or [Path(display_argv(s.argv)[0]).name]
            gone = runs is not None and s.name not in runs
            rows.append({"node": node.name, "role": node.role, "collector": s.name,
                         "required": "not run" if gone else "required" if s.required else "optional",
                         "what": "attached target: servelab did not start the engine, so it has no pid to follow"
                         if gone else s.description,
                         "programs": ", ".join(dict.fromkeys(progs)), "every (s)": None if gone else s.interval_s})
    return pd.DataFrame(rows)


def _log(ctx: PhaseContext, label: str, argv: list[str], title: str, **kw: Any) -> None:
    ctx.log_command(label, display_argv(argv), title=title, **kw)


def run_local_cases(ctx: PhaseContext, case_seconds: float = 4.0, interval_s: float = 1.0) -> Phase2Run:
    """Run the collectors around three short real workloads on this machine (idle, one hot core, all
    cores). Each workload stamps its own busy window (the client's clock); telemetry starts before and
    stops after it. Collectors that fail closed are reported in ``failures`` (the case is kept, marked)."""
    plan = collector_plan(ctx, interval_s)
    ctx.add_source("live", "collectors around synthetic CPU workloads on this machine")
    if not ctx.target.is_local:
        for r in plan.itertuples():
            _log(ctx, "planned", r.command.split(), f"telemetry {r.node} {r.collector}",
                 note="bound to Phase 1 cases on cluster targets")
        return Phase2Run([], plan, pd.DataFrame(), pd.DataFrame(),
                         ["cluster target: collectors are planned here and run around the Phase 1 cases"])
    node = ctx.target.nodes[0]
    host = connect(node)
    cases, failures = [], []
    for name, threads in LOCAL_CASES:
        threads = (os.cpu_count() or 1) if name == "all_cores" else threads
        case_id = f"phase2_{name}"
        cdir = ctx.case_dir(case_id)
        stamp = cdir / "telemetry" / "client_window.json"
        stamp.parent.mkdir(parents=True, exist_ok=True)
        if stamp.exists():
            stamp.unlink()
        wl = [sys.executable, "-c", WORKLOAD, "2.0", str(case_seconds), str(threads), str(stamp)]
        child = subprocess.Popen(wl, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = time.time()
        specs = node_specs(node, child.pid, interval_s, python=sys.executable)
        session = None
        try:
            session = start_telemetry(cdir, [NodePlan(host, specs, node=node.name)], grace_s=0.5)
            while not stamp.exists() and child.poll() is None and time.time() - started < case_seconds + 30:
                time.sleep(0.1)
            time.sleep(interval_s + 0.3)          # let the sample that closes the window be written
            result = session.stop()
            failures += [f"{case_id}: {f}" for f in result.failures]
        except RequiredCollectorError as exc:
            failures.append(f"{case_id}: {exc}")
        finally:
            child.kill()
            child.wait()
        _log(ctx, "executed", wl, f"{case_id} workload", host=node.name,       # the exact argv, script included
             start=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), exit_code=0)
        log_collectors(ctx, case_id, cdir, [(node.name, specs)])
        window = None
        if stamp.exists():
            w = json.loads(stamp.read_text())
            window = CaseWindow(case_id, int(w["start_ns"]), int(w["end_ns"]), f"{threads} busy thread(s)")
        else:
            failures.append(f"{case_id}: the workload wrote no window stamps")
        cases.append(load_case_telemetry(cdir, case_id, window))
    valid = [c for c in cases if c.window is not None]
    return Phase2Run(cases, plan, status_table(cases), coverage_table(valid), failures)


def log_collectors(ctx: PhaseContext, case_id: str, cdir: Path, plans: list[tuple[str, list[Any]]]) -> None:
    """Each collector's command after its case, as its status says: ``executed`` where it started, ``planned`` with
    why where it did not (a binary not found, no hardware, a failed probe) — a collector that did not run is never
    shown as executed."""
    ran = {(st.node, st.collector): st for st in read_statuses(cdir)}
    for node, specs in plans:
        for spec in specs:
            st = ran.get((node, spec.name))
            if st is not None and st.started:
                _log(ctx, "executed", spec.argv, f"{case_id} {spec.name}", host=node, env=dict(spec.env))
            else:
                why = st.reason if st is not None and st.reason else "it did not start"
                _log(ctx, "planned", spec.argv, f"{case_id} {spec.name} (not run)", host=node, env=dict(spec.env),
                     note=f"not run: {why}")


# the Phase 2 replay (docs/method.md#phase2), scaled: P3, the highest-concurrency P4 point, the middle D2 point
# (local: P4_c4 and D2_c8; cluster: P4_c16 and D2_c32), D3/D4 and M1
def engine_case_ids(target: Any) -> list[str]:
    """The Phase 1 cases Phase 2 replays by default on ``target`` (ids of its scale's quick matrix)."""
    ids = [c.case_id for c in quick_matrix(target)]
    p4 = [i for i in ids if i.startswith("P4_c")]
    d2 = [i for i in ids if i.startswith("D2_c")]
    picked = ["P3", p4[-1] if p4 else "", d2[len(d2) // 2] if d2 else "",
              *(i for i in ids if i.startswith(("D3", "D4"))), "M1_control", "M1_treatment"]
    return [i for i in picked if i and i in ids]


def run_engine_cases(ctx: PhaseContext, case_ids: list[str] | None = None, interval_s: float = 1.0,
                     health_timeout_s: float = 900.0) -> Phase2Run:
    """Start the engine, and around each Phase 1 case run every collector on every node; slice to the case's
    exact measurement window. Cases are stored as ``hw-<case>`` so they never overwrite Phase 1's."""
    plan = collector_plan(ctx, interval_s)
    ctx.add_source("live", f"collectors around Phase 1 cases on {ctx.target.name}")
    specs_cases = [replace(c, case_id=f"hw-{c.case_id}")
                   for c in quick_matrix(ctx.target, list(case_ids or engine_case_ids(ctx.target)))]
    cases: list[CaseTelemetry] = []
    failures: list[str] = []
    with ProcessTracker() as tracker:
        srv = start_server(ctx.target, ctx.phase_dir / "logs", tracker, run_dir=ctx.run_dir, phase=ctx.phase,
                           health_timeout_s=health_timeout_s)
        try:
            env = make_env(srv, ctx.run_dir, phase=ctx.phase)
            for case in specs_cases:
                cdir = ctx.case_dir(case.case_id)
                # the nodes the server runs on (Slurm: those it gave; attached: those declared, none = client side and
                # /metrics only); no per-process collector where servelab does not hold the engine's own pid
                plans = [NodePlan(srv.hosts[n.name], node_specs(n, srv.handles[n.name].pid if n.name in srv.handles
                                                                 and srv.slurm_job is None else None, interval_s,
                                                                 python=sys.executable if n.kind == "local" else "python3"),
                                  node=n.name, workdir=n.workdir) for n in srv.target.nodes if n.name in srv.hosts]
                session = None
                try:
                    session = start_telemetry(cdir, plans, grace_s=0.5)
                    try:
                        dispatch_case(env, case)
                    finally:
                        time.sleep(interval_s + 0.3)      # the sample that closes the window
                        result = session.stop()
                        failures += [f"{case.case_id}: {f}" for f in result.failures]
                        log_collectors(ctx, case.case_id, cdir, [(p.node, p.specs) for p in plans])
                except RequiredCollectorError as exc:
                    failures.append(f"{case.case_id}: {exc}")
                except EngineCrash as exc:
                    failures.append(f"{case.case_id}: {exc}")
                    cases.append(load_case_telemetry(cdir, case.case_id, _case_window(cdir, case.case_id)))
                    break
                cases.append(load_case_telemetry(cdir, case.case_id, _case_window(cdir, case.case_id)))
        finally:
            stop_server(srv, tracker, run_dir=ctx.run_dir, phase=ctx.phase)
    valid = [c for c in cases if c.window is not None]
    return Phase2Run(cases, plan, status_table(cases), coverage_table(valid), failures)


def _case_window(cdir: Path, case_id: str) -> CaseWindow | None:
    """The client's measurement window of a case (first start to last end over its repeats), epoch ns."""
    meta = json.loads((cdir / "meta.json").read_text()) if (cdir / "meta.json").exists() else {}
    wins = meta.get("windows_wall_ns") or []
    if not wins:
        return None
    return CaseWindow(case_id, int(min(w[0] for w in wins)), int(max(w[1] for w in wins)),
                      f"{meta.get('case', {}).get('purpose', '')} (client window)")


def summary(ctx: PhaseContext, run: Phase2Run, baseline: str | None = None) -> pd.DataFrame:
    """Per-case per-metric summary with between-case changes; writes ``case_<metric>_summary.csv`` and
    ``telemetry_summary.csv`` into the phase folder; returns it with ``-`` for missing values."""
    cases = [c for c in run.cases if c.window is not None]
    if not cases:
        return pd.DataFrame()
    roles = {n.name: n.role for n in ctx.target.nodes}
    table = compare_cases(pd.concat([summarize_case(c, roles) for c in cases], ignore_index=True), baseline)
    write_metric_csvs(table, Path(ctx.phase_dir))
    return nan_to_dash(table)


def engine_view(ctx: PhaseContext, run: Phase2Run) -> pd.DataFrame:
    """Per engine case, what the engine itself reported inside the same client window as the telemetry: running and
    queued requests, KV usage, slots or batch lines from its log, server TTFT P95 (docs/metrics.md#server-side).
    A case without an engine (the CPU workloads) has no row; none at all is said in one row."""
    rows = []
    for c in run.cases:
        cdir = Path(ctx.run_dir) / "cases" / c.case_id
        if c.window is None or not (cdir / "server" / "engine_log_excerpt.txt").exists():
            continue
        engine = json.loads((cdir / "meta.json").read_text()).get("engine", "")
        rows.append(side_summary(case_serverside(cdir, engine_for(engine), c.window.start_ns, c.window.end_ns)))
    if not rows:
        return pd.DataFrame({"note": ["no engine case in this run (workload=cpu): the engine's own view is absent"]})
    return pd.DataFrame(rows)


def _finite(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def headline_metrics(table: pd.DataFrame, metrics: list[str] | None = None) -> pd.DataFrame:
    """The summary narrowed to a few metrics, one row per (metric, case), for reading on the page."""
    metrics = metrics or ["cpu_busy_pct", "hottest_core_busy_pct", "proc_cpu_pct", "hottest_thread_cpu_pct",
                          "util_gpu_pct", "dcgm_sm_active_pct", "rdma_tx_gbps", "net_tx_gbps"]
    if table.empty:
        return table
    cols = ["metric", "case", "head_status", "head_n", "head_mean", "head_p95", "head_max", "head_mean_change_pct"]
    t = table[table.metric.isin(metrics)][cols].copy()
    # the P95 with the samples it rests on, or "max of N" where too few (the summary table keeps the numbers)
    t["head_p95"] = [mx.percentile_cell({"n_v": int(n), "p95_v_x": p, "max_v_x": m}, "v", 95, "x", 1)
                     if _finite(n) and _finite(p) and _finite(m) else p
                     for n, p, m in zip(t["head_n"], t["head_p95"], t["head_max"])]
    return t.sort_values(["metric", "case"], key=lambda s: s.map({m: i for i, m in enumerate(metrics)})
                         if s.name == "metric" else s).reset_index(drop=True)


def questions(run: Phase2Run, ctx: PhaseContext | None = None) -> pd.DataFrame:
    """The telemetry questions (``docs/method.md#telemetry-questions``) for every case (hot core, machine saturation,
    NUMA, rails, errors, GPU
    throttling, memory headroom) with the evidence and the collector status behind each answer."""
    netdevs = [d for n in ctx.target.nodes for d in n.netdevs] if ctx is not None else None
    frames = [answer_questions(c, netdevs) for c in run.cases if c.window is not None]
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if ctx is not None and not out.empty:
        out.to_csv(Path(ctx.phase_dir) / "phase2_questions.csv", index=False)
    return out


def figure(run: Phase2Run, metrics: list[str] | None = None):
    """Time series of the headline metrics, every case window shaded."""
    frames = [c.samples for c in run.cases if not c.samples.empty]
    samples = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["metric"])
    return timeseries_figure(samples, [c.window for c in run.cases if c.window], metrics or FIGURE_METRICS)


def read_windows_txt(path: Path) -> list[CaseWindow]:
    """``<name> start|end <epoch seconds>`` lines (the device capture's ``windows.txt``) → windows."""
    starts: dict[str, int] = {}
    out = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[1] not in ("start", "end"):
            continue
        ns = int(round(float(parts[2]) * 1e9))
        if parts[1] == "start":
            starts[parts[0]] = ns
        elif parts[0] in starts:
            out.append(CaseWindow(parts[0], starts.pop(parts[0]), ns, "recorded workload window"))
    return out


def h200_sample_cases() -> list[CaseTelemetry]:
    """Recorded 2 x H200 nvidia-smi captures as cases. ``data/samples/h200x2-device`` has the
    workloads' own start/end stamps (``windows.txt``): one case per workload. Without it, the older
    ``data/samples/h200x2/smi.csv`` is one case spanning the whole capture (no stamps were recorded)."""
    dev = samples_root() / "h200x2-device"
    if (dev / "smi.csv").exists() and (dev / "windows.txt").exists():
        samples = parse_smi_csv((dev / "smi.csv").read_text(), "h200x2")
        raw = "data/samples/h200x2-device/smi.csv"
        windows = read_windows_txt(dev / "windows.txt")
    else:
        path = samples_root() / "h200x2" / "smi.csv"
        if not path.exists():
            raise FileNotFoundError(f"sample capture missing: {path}")
        samples = parse_smi_csv(path.read_text(), "h200x2")
        raw = "data/samples/h200x2/smi.csv"
        windows = [CaseWindow("h200x2_nccl_tests", int(samples.ts_ns.min()), int(samples.ts_ns.max()),
                              "whole capture (nccl-tests running)")]
    st = [CollectorStatus("h200x2", "nvidia-smi", False, OK, "recorded sample", "smi", raw, started=True,
                          interval_s=0.2)]
    return [CaseTelemetry(w.case_id, w, samples, pd.DataFrame(), st) for w in windows]


def sample_summary(ctx: PhaseContext, cases: list[CaseTelemetry]) -> pd.DataFrame:
    """Per-case GPU summary of the recorded capture with the change against the first case (written to
    ``h200x2_smi_summary.csv``)."""
    cat = {"nvidia-smi": CATALOG["nvidia-smi"]}
    table = compare_cases(pd.concat([summarize_case(c, catalog=cat) for c in cases], ignore_index=True))
    table = table.drop(columns=[c for c in table.columns if c.startswith("worker_")])
    table.to_csv(Path(ctx.phase_dir) / "h200x2_smi_summary.csv", index=False)
    ctx.add_source("samples", "a recorded 2 × H200 nvidia-smi capture (data/samples/h200x2-device), shown "
                              "beside this target's telemetry")
    return nan_to_dash(table)


def headline(run: Phase2Run, table: pd.DataFrame) -> dict[str, Any]:
    """A few numbers for the run manifest: cases, failures, and per case the machine's CPU busy mean and its
    hottest core — as a P95 where enough samples hold one (20, ``request_metrics.min_samples``), else as the
    maximum of the samples there are, labelled so."""
    out: dict[str, Any] = {"cases": len(run.cases), "telemetry_failures": len(run.failures)}
    if not table.empty:
        busy = {r.case: r for r in table[table.metric == "cpu_busy_pct"].itertuples()}
        for r in table[table.metric == "hottest_core_busy_pct"].itertuples():
            if r.head_p95 == "-" or r.head_max == "-":
                continue
            n = int(r.head_n)
            b = busy.get(r.case)
            mean = "" if b is None or b.head_mean == "-" else f"machine busy mean {float(b.head_mean):.1f} %, "
            hot = (f"hottest core P95 {float(r.head_p95):.1f} % (n={n})" if n >= min_samples(95)
                   else f"hottest core {float(r.head_max):.1f} % (max of {n} sample{'' if n == 1 else 's'})")
            out[f"{r.case}_cpu"] = mean + hot
    missing = sorted({s.collector for c in run.cases for s in c.statuses if s.status not in (OK,)})
    out["collectors_not_ok"] = ", ".join(missing) or "none"
    return out


__all__ = ["Phase2Run", "collector_plan", "run_local_cases", "summary", "headline_metrics", "questions", "figure",
           "h200_sample_cases", "read_windows_txt", "sample_summary", "headline", "NOT_CONFIGURED"]


# the resources a reader asks "did it rise?" about, with their words and units (findings box)
RISE_METRICS: dict[str, tuple[str, str]] = {
    "hottest_core_busy_pct": ("hottest core busy", "%"), "cpu_busy_pct": ("machine CPU busy", "%"),
    "proc_cpu_pct": ("engine process CPU", "% of a core"), "hottest_thread_cpu_pct": ("engine's hottest thread", "%"),
    "cpu_iowait_pct": ("CPU I/O wait", "%"), "util_gpu_pct": ("GPU utilisation", "%"),
    "dcgm_sm_active_pct": ("SM active", "%"), "dcgm_tensor_active_pct": ("tensor pipe active", "%"),
    "dcgm_dram_active_pct": ("DRAM active", "%"), "util_mem_pct": ("GPU memory-controller utilisation", "%"),
    "power_w": ("GPU power", "W"), "mem_used_mib": ("GPU memory used", "MiB"), "pcie_tx_GBps": ("PCIe TX", "GB/s"),
    "nvlink_tx_GBps": ("NVLink TX", "GB/s"), "rdma_tx_gbps": ("RDMA TX", "Gbit/s"),
    "rdma_rx_gbps": ("RDMA RX", "Gbit/s"), "net_tx_gbps": ("network TX", "Gbit/s"),
    "net_rx_gbps": ("network RX", "Gbit/s"), "proc_rss_mib": ("engine resident memory", "MiB"),
}


def risers(table: pd.DataFrame, case: str, baseline: str, top: int = 2) -> list[str]:
    """The resources whose mean rose most in ``case`` against ``baseline`` ('hottest core busy mean 34 → 80 %'): a
    percentage by at least 10 points, anything else by at least 25 %; at most ``top``, largest first."""
    if table.empty:
        return []
    t = table[table["metric"].isin(list(RISE_METRICS))]
    mean = pd.to_numeric(t["head_mean"], errors="coerce")
    base = dict(zip(t.loc[t["case"] == baseline, "metric"], mean[t["case"] == baseline]))
    rows = []
    for metric, value in zip(t.loc[t["case"] == case, "metric"], mean[t["case"] == case]):
        a = base.get(metric)
        if a is None or pd.isna(a) or pd.isna(value):
            continue
        label, unit = RISE_METRICS[metric]
        if unit.startswith("%"):
            score = value - a if value - a >= 10 else None
        else:
            score = 100 * (value - a) / abs(a) if a and value >= 1.25 * a else (1e6 if not a and value > 0 else None)
        if score is not None:
            rows.append((unit.startswith("%"), score,        # plain numbers: 1,120 → 1,470 MiB, never 1.12e+03
                         f"{label} mean {format_value(float(a))} → {format_value(float(value))} {unit}"))
    rows.sort(key=lambda r: (not r[0], -r[1]))
    return [r[2] for r in rows[:top]]


def findings(run: Phase2Run, table: pd.DataFrame, sample: pd.DataFrame | None = None) -> list[str]:
    """What Phase 2 found, in sentences for the page's findings box: which resource rose in which case (against
    the first case), the telemetry questions answered yes, what was missing, and the recorded H200 sample."""
    out: list[str] = []
    cases = [c.case_id for c in run.cases if c.window is not None]
    if not cases:
        out.append("No case window was measured: " + ("; ".join(run.failures) or "no case ran") + ".")
    else:
        base = cases[0]
        rose = []
        for case in cases[1:]:
            r = risers(table, case, base)
            rose.append(f"in {case}: " + ("; ".join(r) if r else "nothing rose by 10 points / 25 % or more"))
        out.append(f"{len(cases)} case windows measured; against {base}, "
                   + (" — ".join(rose) if rose else "no other case to compare") + ".")
        q = questions(run)
        if not q.empty:
            yes = q[q["answer"] == "yes"]
            if len(yes):
                out.append("Telemetry questions answered yes: " + "; ".join(
                    f"{r.case}: {r.question.rstrip('?')} ({r.evidence})" for r in yes.head(3).itertuples())
                    + (" …" if len(yes) > 3 else "") + ".")
            else:
                out.append(f"No telemetry question was answered yes ({int((q['answer'] == 'no').sum())} no, "
                           f"{int((q['answer'] == '-').sum())} without data).")
    missing = sorted({s.collector for c in run.cases for s in c.statuses if s.status != OK})
    if missing:
        out.append("Collectors without data here (shown as -, never as 0): " + ", ".join(missing) + ".")
    if run.failures:
        out.append(f"{len(run.failures)} telemetry failure(s) (fail-closed): " + "; ".join(run.failures[:3]) + ".")
    if sample is not None and not sample.empty:
        s_cases = list(dict.fromkeys(sample["case"]))
        parts = [f"{c}: " + ("; ".join(risers(sample, c, s_cases[0])) or "no rise") for c in s_cases[1:]]
        if parts:
            out.append(f"From recorded sample data (2 × H200 nvidia-smi), against {s_cases[0]}: " + " — ".join(parts)
                       + ".")
    return out


# ---------------------------------------------------------------- evidence for the ledger (H5)

HOT_CORE_QUESTION = "Is a single CPU core saturated (hot core) while the machine is not?"


def h5_evidence(run: Phase2Run, questions_table: pd.DataFrame) -> tuple[str, str, dict[str, Any]]:
    """(verdict, summary, numbers) about H5 (CPU scheduler / launch leaves GPU gaps) from the hot-core question
    (hottest core P95 ≥ 90 % while the machine mean < 75 %), only where the target has a GPU to leave idle:
    a hot core in any case → *supported*; answered *no* in every case → *refuted*; no GPU samples or no mpstat
    answer → *inconclusive*."""
    gpu = any(not c.samples.empty and "util_gpu_pct" in set(c.samples["metric"]) for c in run.cases)
    q = questions_table[questions_table["question"] == HOT_CORE_QUESTION] if not questions_table.empty else \
        pd.DataFrame(columns=["case", "answer", "evidence"])
    answered = q[q["answer"].isin(["yes", "no"])]
    nums = {"gpu_samples": gpu, "cases_answered": int(len(answered)), "hot_core_cases": int((q["answer"] == "yes").sum())}
    each = "; ".join(f"{r.case}: {r.answer} ({r.evidence})" for r in q.itertuples())
    if answered.empty:
        return "inconclusive", f"the hot-core question has no answer in any case ({each or 'no case measured'})", nums
    if not gpu:
        return "inconclusive", (f"no GPU on this target, so a busy core cannot leave GPU gaps — hot core: {each}"), nums
    if (answered["answer"] == "yes").any():
        return "supported", f"a single core saturated while the machine was not — {each}", nums
    return "refuted", f"no hot core in any case — {each}", nums


def record_h5(ctx: PhaseContext, run: Phase2Run) -> pd.DataFrame:
    """Record H5 from this phase's telemetry questions (see :func:`h5_evidence`)."""
    verdict, summary, nums = h5_evidence(run, questions(run, ctx))
    tables = [t for t in ("phase2_questions.csv", "telemetry_summary.csv") if (Path(ctx.phase_dir) / t).is_file()]
    return evidence_frame([record_evidence(ctx, "H5", verdict, summary,
                                           anchor="The-telemetry-questions,-answered-from-the-data", table=tables,
                                           numbers=nums)])
