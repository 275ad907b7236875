"""What the Phase 5 notebook calls: plan and run nccl-tests on the target's nodes (per node, across nodes through a
launcher, the one-variable NCCL sweeps, the P2P matrix — ``servelab.measure.nccl_tests``), read the runs
(``servelab.analyse.nccl.sweep``) or, where nothing can run, the recorded samples; load nccl-tests and NCCL INFO
logs, place the model's message sizes on the curves, and judge the target's transport gate.
Every table it returns is also written into the phase folder."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from servelab.deploy.nccl_gate import GateVerdict, check_gate, verdict_table
from servelab.deploy.nccl_info import NcclInfo, parse_info, parse_info_files, transport_table
from servelab.analyse.nccl import sweep as sw
from servelab.analyse.nccl.msgsize import model_message_sizes, place_on_curves, from_trace
from servelab.analyse.ceiling import ceiling_finding, with_ceiling
from servelab.analyse.nccl.perf_log import NcclTestRun, parse_file, runs_frame, runs_table
from servelab.core.params import did_you_mean, param, ParamError, PhaseParams
from servelab.core.paths import samples_root
from servelab.measure import gloo_sweep as gs
from servelab.measure import nccl_tests as nt
from servelab.core.run import emit_progress, now_iso, read_manifest
from servelab.deploy.engines import engine_for
from servelab.deploy.hosts import HostError, ProcessTracker, connect
from servelab.phases.context import PhaseContext
from servelab.report.ledger import evidence_frame, record_evidence

TWO_RAIL_GATE = {"required_hcas": ["mlx5_0", "mlx5_3"], "require": ["NET/IB", "GDRDMA"]}
SWEEP_SAMPLE = "h200x1-nccl-sweep"          # the recorded 1 x H200 sweep (data/samples/h200x1-nccl-sweep/README.md)
PLANNED_BIN = "nccl-tests/build"            # the folder a planned command names when nccl_tests_bin is not set
SWEEP_SAMPLE_LABEL = ("1 x NVIDIA H200 (NCCL 2.28.9, nccl-tests 2.19.6), recorded 2026-12-02 with "
                      "servelab.measure.nccl_tests: one rank, so busbw is 0 for every collective but send/recv and "
                      "NCCL runs no algorithm; files data/samples/h200x1-nccl-sweep/")


# ---------------------------------------------------------------- running nccl-tests on the target

@dataclass(frozen=True)
class Params(PhaseParams):
    """Phase 5's parameters, defined once: the notebook's ``parameters`` cell is this definition
    written out (``servelab params phase5 --cell``); ``-p`` and ``params/phase5.yaml`` are checked against it."""
    phase: ClassVar[str] = "phase5"
    run_id: str = param("", "empty : new run")
    nccl_tests_logs: list = param([], "nccl-tests output files to read; empty means the recorded 2 x H200 sample")
    nccl_info_logs: list = param([], "NCCL_DEBUG INFO logs of every rank; empty means the recorded sample when showing it")
    hidden_size: int = param(4096, "model hidden size; 4096 is the toy TP 2 model of the recorded traces [min 1]")
    dtype_bytes: int = param(2, "bytes per activation element, 2 for bf16 [min 1]")
    tp: int = param(2, "tensor-parallel degree [min 1]")
    num_layers: int = param(8, "transformer layers, 2 TP all-reduces each [min 1]")
    vocab_size: int = param(0, "vocabulary size for the logits all-gather, 0 means not gathered")
    decode_batch: int = param(32, "running requests per decode step [min 1]")
    prefill_chunk: int = param(4096, "prompt positions per prefill step, the chunk size [min 1]")
    nccl_tests_bin: str = param("",
        "folder holding all_reduce_perf and co on every node; empty means nothing runs here, the run plan is "
        "recorded as planned and the recorded 1 x H200 sweep is shown")
    collectives: list = param(["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv"],
        "baseline runs per node and across nodes")
    sweep: dict = param({"NCCL_ALGO": ["Ring", "Tree"], "NCCL_PROTO": ["Simple", "LL128"], "NCCL_CROSS_NIC": ["0", "1", "2"]},
        "one-variable A/Bs against the baseline; NCCL_CROSS_NIC only across nodes")
    sweep_collectives: list = param(["all_reduce"], "collectives every sweep setting runs")
    repeats: int = param(2, "runs of every setting, the baseline too; 2 or more gives the noise verdict [min 1]")
    min_bytes: str = param("8K", "smallest nccl-tests size (-b)")
    max_bytes: str = param("64M", "largest nccl-tests size (-e)")
    step_factor: int = param(2, "size multiplier between sizes (-f) [min 2]")
    gpus: int = param(0, "GPUs per node; 0 means each node's gpus in the target")
    nodes: list = param([], "target nodes to run on; empty means all")
    launcher: list = param([],
        "cross-node launcher template, e.g. [\"mpirun\", \"-np\", \"{nranks}\", \"-H\", \"{hosts}\", \"{env:-x}\", "
        "\"{cmd}\"]; empty means no cross-node runs")
    ppn: int = param(0, "ranks per node across nodes; 0 means the smallest node's GPU count")
    p2p_matrix: bool = param(True, "sendrecv_perf on every GPU pair of each node")
    cross_node: bool = param(True, "the runs across nodes through the launcher")
    env_check: bool = param(True, "one short NCCL_DEBUG INFO run per setting, proving the variable reached NCCL")
    run_timeout_s: int = param(300, "one nccl-tests run is stopped after this many seconds [min 1]")
    gloo_sweep: bool = param(True,
        "on an SGLang target on this machine's CPU: gloo all-reduce and all-gather from 64 B to max_bytes "
        "with the engine's interpreter, its communication ceiling")

    def plan_settings(self) -> nt.PlanSettings:
        """The nccl-tests plan these parameters ask for (the same names in ``measure.nccl_tests``)."""
        return nt.PlanSettings(collectives=self.collectives, sweep=self.sweep, sweep_collectives=self.sweep_collectives,
                               repeats=self.repeats, min_bytes=self.min_bytes, max_bytes=self.max_bytes,
                               step_factor=self.step_factor, gpus=self.gpus, launcher=list(self.launcher), ppn=self.ppn,
                               cross_node=self.cross_node, p2p_matrix=self.p2p_matrix, env_check=self.env_check,
                               run_timeout_s=self.run_timeout_s)


@dataclass
class CommRuns:
    """The nccl-tests plan for this target and where its runs are: executed here, or the recorded sample."""
    plan: nt.NcclPlan
    table: pd.DataFrame            # one line per planned run: scope, node, collective, setting, repeat, command
    execute: bool
    skipped: list[str]
    folder: Path | None = None
    from_samples: bool = False
    why_not_run: str = ""


def _pick_nodes(target: Any, names: list[str]) -> list[Any]:
    known = [n.name for n in target.nodes]
    for name in names:
        if name not in known:
            raise ParamError(f"node '{name}' is not a node of target {target.name}{did_you_mean(name, set(known))}; "
                             f"its nodes: {', '.join(known)}")
    return [n for n in target.nodes if not names or n.name in names]


def plan_runs(ctx: PhaseContext) -> CommRuns:
    """The whole nccl-tests plan of the parameters (:meth:`Params.plan_settings`) on the target's nodes (``nodes``:
    which; empty: all), checked before anything starts (a bad collective, sweep entry, size, launcher placeholder or
    node name is one line). Without ``nccl_tests_bin`` nothing will run: each command is recorded as ``planned``
    (binaries under ``nccl-tests/build``), a node that declares no GPUs planned with one. Written to
    ``nccl_plan.csv``."""
    p = ctx.params
    picked = _pick_nodes(ctx.target, list(p.nodes or []))
    execute = bool(str(p.nccl_tests_bin).strip())
    try:
        plan = nt.plan_runs(picked, p.nccl_tests_bin if execute else PLANNED_BIN, p.plan_settings(),
                            env=ctx.target.env, gpus_default=0 if execute else 1)
    except nt.NcclPlanError as exc:
        raise ParamError(str(exc)) from None
    why = ""
    if not execute:
        why = "nccl_tests_bin is not set"
        if not any(getattr(n, "gpus", 0) for n in picked):
            why = f"target {ctx.target.name} declares no GPUs and nccl_tests_bin is not set"
    table = pd.DataFrame([{"scope": r.scope, "node": r.node, "collective": r.collective, "setting": r.setting,
                           "repeat": r.repeat, "ranks": r.ranks, "GPU pair": r.pair or "-",
                           "command": " ".join(f"{k}={v}" for k, v in r.env.items()) + (" " if r.env else "")
                           + " ".join(r.argv)} for r in plan.runs])
    table.to_csv(Path(ctx.phase_dir) / "nccl_plan.csv", index=False)
    return CommRuns(plan, table, execute, list(plan.skipped), why_not_run=why)


def run_tests(ctx: PhaseContext, runs: CommRuns, launcher: list[str] | None = None) -> CommRuns:
    """Run the run plan on the target's nodes, or — when it is not to run here — point at the recorded 1 × H200 sweep
    (``ctx.sweep_from_samples``) and record every planned command as ``planned``. Before anything starts every
    node is connected and every binary the run plan uses checked (one line naming the first problem). Each run is a
    tracked process; its command, environment, exit code and log are recorded as ``executed`` as soon as it ends,
    its log kept under ``nccl_runs/logs/``."""
    if not runs.execute:
        for r in runs.plan.runs:
            ctx.log_command("planned", r.argv, title=f"nccl-tests {r.run_id}", host=r.node, env=r.env,
                        note="not executed: " + runs.why_not_run)
        runs.folder, runs.from_samples = samples_root() / SWEEP_SAMPLE, True
        ctx.sweep_from_samples = True
        return runs
    nodes = {n.name: n for n in ctx.target.nodes}
    hosts: dict[str, Any] = {}
    try:
        for name in dict.fromkeys(x for r in runs.plan.runs for x in [r.node, *r.nodes]):
            hosts[name] = connect(nodes[name])
        problems = nt.check_plan(runs.plan, hosts, list(launcher or []))
        if problems:
            raise ParamError(problems[0])
        out = Path(ctx.phase_dir) / "nccl_runs"
        if (out / "runs.jsonl").exists():
            (out / "runs.jsonl").unlink()          # a phase re-run into the same run id starts its record afresh
        total = len(runs.plan.runs)

        def done(res: nt.RunResult) -> None:
            ctx.log_command("executed", res.run.argv, title=f"nccl-tests {res.run.run_id}", host=res.run.node,
                        env=res.run.env, start=res.start, end=res.end, exit_code=res.exit_code,
                        log=str(out / res.log), note=res.note)

        def progress(k: int, n: int, r: nt.PlannedRun) -> None:
            emit_progress(Path(ctx.run_dir), ctx.phase, f"nccl-tests {k + 1} of {total}: {r.run_id}")

        with ProcessTracker() as tracker:
            nt.execute(runs.plan, hosts, out, tracker, {n: getattr(nodes[n], "workdir", "") for n in hosts},
                       on_result=done, progress=progress)
    except HostError as exc:
        raise ParamError(str(exc)) from None
    finally:
        for h in hosts.values():
            h.close()
    runs.folder = out
    return runs


@dataclass
class SweepResult:
    """The runs of one folder and the tables the page shows."""
    data: sw.SweepData
    runs: pd.DataFrame
    table: pd.DataFrame
    wide: pd.DataFrame
    winners: pd.DataFrame
    env: pd.DataFrame
    p2p: pd.DataFrame
    from_samples: bool
    p2p_from_samples: bool = False


def sweep_tables(ctx: PhaseContext, runs: CommRuns, msgs: pd.DataFrame | None = None) -> SweepResult:
    """Read the runs folder: per-run verdicts, the sweep table (Δ time against the baseline under the noise rule,
    ``docs/metrics.md#ab-noise``), the setting that wins at the model's message sizes (a setting NCCL did not
    report reading never wins), whether each swept variable reached NCCL, and the P2P matrix — from the runs, or,
    when none ran here, from the recorded 2 × H200 send/recv (its one GPU pair). Written to ``nccl_sweep_runs.csv``,
    ``nccl_sweep.csv``, ``nccl_sweep_winners.csv``, ``nccl_env_check.csv``, ``nccl_p2p.csv``."""
    data = sw.load_sweep(Path(runs.folder))
    if runs.from_samples:              # the recorded machine's node is not a node of this target: say whose it is
        for frame in (data.runs, data.rows):
            if not frame.empty:
                frame["node"] = "h200x1 (recorded)"
        for rec in data.records:
            rec["node"] = "h200x1 (recorded)"
    table = sw.sweep_table(data)
    env = sw.env_check(data)
    wins = sw.winners(table, msgs if msgs is not None else pd.DataFrame(), env)
    p2p = sw.p2p_matrix(data)
    p2p_samples = False
    if p2p.empty and runs.from_samples:
        sr = [r for r in parse_file(sample_paths()[0]) if r.collective == "sendrecv"]
        if sr:
            p2p, p2p_samples = sw.p2p_from_run(sr[0], "h200x2 (recorded)"), True
    sizes = sorted(set(wins.measured_size_bytes)) if not wins.empty else None
    wide = sw.sweep_wide(table, sizes)
    out = Path(ctx.phase_dir)
    data.runs.to_csv(out / "nccl_sweep_runs.csv", index=False)
    table.to_csv(out / "nccl_sweep.csv", index=False)
    wins.to_csv(out / "nccl_sweep_winners.csv", index=False)
    env.to_csv(out / "nccl_env_check.csv", index=False)
    p2p.to_csv(out / "nccl_p2p.csv", index=False)
    return SweepResult(data, data.runs, table, wide, wins, env, p2p, runs.from_samples, p2p_samples)


def info_from_runs(runs: CommRuns) -> list[str]:
    """The env-check runs' NCCL INFO logs of the first swept setting (every rank of one run)."""
    if runs.from_samples or runs.folder is None:
        return []
    recs = [r for r in sw.read_records(Path(runs.folder)) if r.get("scope") == "env-check"]
    first = [r for r in recs if r.get("setting") == recs[0].get("setting")] if recs else []
    return [str(Path(runs.folder) / r["log"]) for r in first[:1]]


def curves_from_runs(runs: CommRuns) -> tuple[list[str], str]:
    """The logs the curves are drawn from when nccl-tests ran here: the baseline's first repeat of every
    collective, across nodes where that ran, else on the first node (the head, where the model's TP collectives
    run) — and which of the two."""
    if runs.from_samples or runs.folder is None:
        return [], ""
    recs = sw.read_records(Path(runs.folder))
    base = [r for r in recs if r.get("setting") == "baseline" and int(r.get("repeat", 1)) == 1
            and r.get("exit_code") == 0]
    scope = "cross-node" if any(r["scope"] == "cross-node" for r in base) else "node"
    head = next((r["node"] for r in base if r["scope"] == scope), "")
    return ([str(Path(runs.folder) / r["log"]) for r in base if r["scope"] == scope and r["node"] == head],
            "across nodes" if scope == "cross-node" else f"node {head}")


@dataclass
class Phase5Data:
    """Parsed logs and the tables derived from them."""
    runs: list[NcclTestRun]
    curves: pd.DataFrame
    table: pd.DataFrame
    info: NcclInfo | None
    transports: pd.DataFrame
    tuning: pd.DataFrame
    sources: list[str] = field(default_factory=list)


def sample_paths() -> tuple[Path, Path]:
    d = samples_root() / "h200x2"
    return d / "nccl_tests.log", d / "nccl_info.log"


def load_logs(ctx: PhaseContext, tests_logs: list[str] | None = None, info_logs: list[str] | None = None,
              label: str = "", runs: CommRuns | None = None) -> Phase5Data:
    """Parse nccl-tests logs and INFO logs: the ones given; else, when nccl-tests ran here (``runs``), its baseline
    runs (:func:`curves_from_runs`) and its env-check INFO logs; else the recorded 2 × H200 samples (then
    ``ctx.from_samples`` is set). Writes ``nccl_tests.csv``, ``nccl_runs.csv``, ``nccl_transports.csv`` and
    ``nccl_tuning.csv`` into the phase folder."""
    default_tests, default_info = sample_paths()
    if not tests_logs and runs is not None and not runs.from_samples:
        tests_logs, where = curves_from_runs(runs)
        if not info_logs:
            info_logs = info_from_runs(runs)
        label = label or f"measured here, {where}"
    if not tests_logs:
        tests_logs, ctx.from_samples = [str(default_tests)], True
    if info_logs is None or info_logs == []:
        info_logs = [str(default_info)] if ctx.from_samples else []
    runs = [r for p in tests_logs for r in parse_file(Path(p))]
    curves = runs_frame(runs, label or ("H200 x2 (recorded)" if ctx.from_samples else ctx.run_id))
    table = runs_table(runs)
    info = parse_info_files([Path(p) for p in info_logs]) if info_logs else None
    transports = transport_table(info) if info else pd.DataFrame()
    tuning = info.tuning if info else pd.DataFrame()
    out = Path(ctx.phase_dir)
    ctx.add_source("samples", "2 × H200 nccl-tests and NCCL INFO logs (data/samples/h200x2), not this target"
                   if ctx.from_samples else "nccl-tests / INFO logs given to this phase: "
                   + ", ".join(Path(p).name for p in [*tests_logs, *info_logs]))
    curves.to_csv(out / "nccl_tests.csv", index=False)
    table.to_csv(out / "nccl_runs.csv", index=False)
    transports.to_csv(out / "nccl_transports.csv", index=False)
    tuning.to_csv(out / "nccl_tuning.csv", index=False)
    return Phase5Data(runs, curves, table, info, transports, tuning, list(tests_logs) + list(info_logs))


def info_summary(data: Phase5Data) -> pd.DataFrame:
    """NCCL version, nodes, network module, NET devices, GDR state and NCCL_* settings from the INFO log."""
    i = data.info
    if i is None:
        return pd.DataFrame([{"item": "INFO log", "value": "-", "note": "no NCCL_DEBUG=INFO log given"}])
    nets = ", ".join(f"{r.kind}[{r.index}] {r.name}" + (f":{r.port}/{r.link}" if r.kind == "IB" else "")
                     for r in i.net_devices.itertuples()) or "none"
    gdr = ", ".join(f"{r.hca} {'enabled' if r.enabled else 'disabled'} ({r.transport})" for r in i.gdr.itertuples())
    rows = [("NCCL version", i.version or "-"), ("nodes (nNodes)", i.nnodes if i.nnodes is not None else "-"),
            ("ranks", len(i.ranks) or "-"), ("network module", ", ".join(sorted(set(i.network.values()))) or "-"),
            ("NET devices", nets), ("GPU Direct RDMA", gdr or "-"),
            ("NCCL_* from the log", ", ".join(f"{k}={v}" for k, v in i.env.items()) or "none printed"),
            ("notes", " / ".join(i.notes) or "-"), ("warnings", " / ".join(i.warnings[:5]) or "none")]
    return pd.DataFrame(rows, columns=["item", "value"])


def messages(ctx: PhaseContext, data: Phase5Data, hidden_size: int, dtype_bytes: int, tp: int, num_layers: int,
             decode_batch: int, prefill_tokens: int, vocab_size: int = 0, ep: int = 1, top_k: int = 0,
             trace_collectives: pd.DataFrame | None = None) -> pd.DataFrame:
    """The model's collective sizes (decode and prefill steps, or measured trace sizes) placed on the
    measured curves; written to ``model_messages.csv``."""
    sizes = model_message_sizes(hidden_size, dtype_bytes, {f"decode C={decode_batch}": decode_batch,
                                                           f"prefill {prefill_tokens} tok": prefill_tokens},
                                tp, num_layers, vocab_size or None, {f"decode C={decode_batch}": decode_batch,
                                                                     f"prefill {prefill_tokens} tok": 1}, ep, top_k)
    if trace_collectives is not None and not trace_collectives.empty:
        sizes = pd.concat([sizes, from_trace(trace_collectives)], ignore_index=True)
    placed = place_on_curves(sizes, data.curves) if not data.curves.empty else sizes
    placed.to_csv(Path(ctx.phase_dir) / "model_messages.csv", index=False)
    ctx.add_source("model", message_model_label(hidden_size, dtype_bytes, tp, num_layers, ctx.target))
    return placed


def message_model_label(hidden_size: int, dtype_bytes: int, tp: int, num_layers: int, target: Any) -> str:
    """Which model the message sizes are of: the phase's parameters, said so against the target's model."""
    toy = " — the toy model of the recorded traces" if (hidden_size, tp) == (4096, 2) else ""
    return (f"collective message sizes of a model with hidden size {hidden_size}, {num_layers} layers, TP {tp}, "
            f"{dtype_bytes} bytes per element (this phase's parameters{toy}), not read from the target's model "
            f"{getattr(target, 'model', '') or '-'}")


def gate_for_target(ctx: PhaseContext, data: Phase5Data) -> GateVerdict:
    """The target's own gate (``gate:`` in its YAML) against the INFO log; written to ``gate.json``."""
    info = data.info if data.info is not None else parse_info("")
    v = check_gate(ctx.target.gate, info)
    (Path(ctx.phase_dir) / "gate.json").write_text(json.dumps(
        {"target": ctx.target.name, "gate": ctx.target.gate, "verdict": v.verdict, "passed": v.passed,
         "message": v.message, "reasons": v.reasons, "sources": data.sources}, indent=2))
    return v


def engine_gate_record(ctx: PhaseContext) -> dict[str, Any]:
    """The transport gate as judged at this run's last engine start (``manifest["gate"]``, written by the engine
    start of a target that declares ``gate:``); ``{}`` when no gated engine was started in this run."""
    return dict(read_manifest(Path(ctx.run_dir)).get("gate") or {})


def engine_gate(ctx: PhaseContext) -> pd.DataFrame:
    """The run's enforced gate verdict, from the manifest: which phase started the engine, when, the verdict,
    its message and each reason, and the rank logs it read (``docs/method.md#transport-gate``)."""
    g = engine_gate_record(ctx)
    if not g:
        why = ("the target declares no gate" if not ctx.target.gate else
               "no engine of this target was started in this run yet (Phase 0 or 1 starts one)")
        return pd.DataFrame([{"item": "verdict", "value": "not judged"}, {"item": "why", "value": why}])
    rows = [("verdict", g.get("verdict", "-")), ("judged at the engine start of", g.get("phase") or "-"),
            ("when", g.get("when", "-")), ("engine", "stopped by the gate" if g.get("engine_stopped") else "kept running"),
            ("message", g.get("message", "-"))]
    rows += [(f"reason {i + 1}", r) for i, r in enumerate(g.get("reasons") or [])]
    rows += [(f"log of {n}", p) for n, p in sorted((g.get("logs") or {}).items())]
    return pd.DataFrame(rows, columns=["item", "value"])


def two_rail_gate_on_log(data: Phase5Data) -> pd.DataFrame:
    """What the reference two-rail gate (mlx5_0 + mlx5_3 with NET/IB + GDRDMA, ``docs/method.md#transport-gate``)
    says about this log — for a
    single-node log it must refuse, and the message says what was found instead."""
    if data.info is None:
        return pd.DataFrame([{"item": "verdict", "value": "-"}, {"item": "message", "value": "no INFO log given"}])
    return verdict_table(check_gate(TWO_RAIL_GATE, data.info))


def headline(data: Phase5Data, verdict: GateVerdict) -> dict[str, Any]:
    t = data.table
    out: dict[str, Any] = {"gate": verdict.verdict, "runs_ok": int((t.status == "ok").sum()) if not t.empty else 0,
                           "runs_not_ok": int((t.status != "ok").sum()) if not t.empty else 0}
    for r in t.itertuples():
        out[f"{r.collective}_peak_busbw_gbps"] = r.peak_busbw_gbps
        out[f"{r.collective}_small_msg_time_us"] = r.small_msg_time_us
    return out


def _size(nbytes: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= f:
            return f"{nbytes / f:,.3g} {unit}"
    return f"{int(nbytes)} B"


def findings(data: Phase5Data, verdict: GateVerdict, msgs: pd.DataFrame | None = None,
             from_samples: bool = False, engine_gate: dict[str, Any] | None = None) -> list[str]:
    """What Phase 5 found, in sentences for the page's findings box: the transport gate's verdict, the bus
    bandwidth and time the model's own messages get on the measured curves, the peaks they are far from, and the
    runs' status."""
    src = " (from recorded sample data, 2 × H200)" if from_samples else ""
    def why(v: GateVerdict) -> str:
        return "; ".join(r.split("; NCCL said")[0] for r in v.reasons[:3])
    if verdict.configured:
        out = [f"Transport gate of this target: {verdict.verdict}" + (f" — {why(verdict)}" if verdict.reasons else "")
               + "."]
    else:
        out = [f"Transport gate: {verdict.message}."]
    if engine_gate:
        out.insert(0, f"At this run's engine start ({engine_gate.get('phase') or '-'}) the enforced transport gate said "
                      f"{engine_gate.get('verdict', '-')}" + ("; the engine was stopped and nothing was measured"
                                                              if engine_gate.get("engine_stopped") else "")
                   + (" — " + "; ".join(r.split("; NCCL said")[0] for r in engine_gate["reasons"][:3])
                      if engine_gate.get("reasons") else "") + ".")
    if data.info is not None:
        ref = check_gate(TWO_RAIL_GATE, data.info)
        out.append(f"The reference two-rail gate (mlx5_0 + mlx5_3, NET/IB + GDRDMA) on this INFO log{src}: "
                   f"{ref.verdict}" + (f" — {why(ref)}" if ref.reasons else "") + ".")
    if msgs is not None and not msgs.empty and "busbw_gbps" in msgs.columns:
        parts = []
        for r in msgs.itertuples():
            if pd.isna(r.busbw_gbps):
                parts.append(f"{r.scenario} {r.collective} of {_size(r.msg_bytes)}: outside the measured range")
                continue
            parts.append(f"{r.scenario} {r.collective} of {_size(r.msg_bytes)} gets {r.busbw_gbps:,.1f} GB/s busbw, "
                         f"{r.time_us:,.1f} µs per call, {r.step_time_us:,.0f} µs per step ({int(r.calls_per_step)} "
                         f"calls)")
        out.append(f"At the message sizes of the model in this phase's parameters (hidden size, layers, TP — not read "
                   f"from the served model){src}: " + "; ".join(parts) + ".")
    t = data.table
    if not t.empty:
        ok = t[t["status"] == "ok"]
        peaks = "; ".join(f"{r.collective} {r.peak_busbw_gbps:,.1f} GB/s (smallest message {r.small_msg_time_us:,.1f} µs)"
                          for r in ok.itertuples())
        out.append(f"Peak busbw of the nccl-tests runs{src}, which a 1 GiB test reports and decode never sees: "
                   + (peaks or "none ok") + ".")
        bad = t[t["status"] != "ok"]
        if len(bad):
            out.append(f"{len(bad)} of {len(t)} nccl-tests runs not ok: " + "; ".join(
                f"{r.collective} {r.status} ({r.reason})" for r in bad.itertuples()) + ".")
    elif not data.runs:
        out.append("No nccl-tests run was read: no bandwidth to report.")
    return out


# ---------------------------------------------------------------- evidence for the ledger (H1)

H1_DECODE_COMM_PCT = 15.0     # the evidence → action threshold of exposed TP-collective time in a decode step


def _decode_step_ms(run_dir: Path) -> tuple[float | None, bool]:
    """The median decode step (ms, median over ranks) of this run's Phase 3 capture, and whether that capture
    was a recorded sample; ``(None, False)`` without Phase 3 decode windows."""
    p = Path(run_dir) / "phase3" / "trace_summary.csv"
    try:
        s = pd.read_csv(p) if p.is_file() else pd.DataFrame()
    except (pd.errors.EmptyDataError, pd.errors.ParserError):
        s = pd.DataFrame()
    if s.empty or not {"kind", "median_step_ms"} <= set(s.columns) or s[s["kind"] == "decode"].empty:
        return None, False
    sample = bool(read_manifest(Path(run_dir)).get("phases", {}).get("phase3", {}).get("from_samples"))
    return float(s[s["kind"] == "decode"]["median_step_ms"].median()), sample


@dataclass
class Phase5Result:
    """Phase 5's result (the phase contract): the nccl-tests runs (planned or executed here), the parsed logs, the
    model's messages on the curves, the sweep tables, the target's gate verdict and the gate as judged at this
    run's last engine start."""
    comm: CommRuns
    data: Phase5Data
    msgs: pd.DataFrame
    sweep: SweepResult
    verdict: GateVerdict
    engine_gate: dict[str, Any] = field(default_factory=dict)
    from_samples: bool = False

    def headline(self) -> dict[str, Any]:
        return {**headline(self.data, self.verdict), **sweep_headline(self.comm, self.sweep)}

    def findings(self) -> list[str]:
        return (sweep_findings(self.comm, self.sweep)
                + findings(self.data, self.verdict, self.msgs, self.from_samples, self.engine_gate)
                + self.engine_ceiling[1])
    engine_ceiling: tuple[pd.DataFrame, list[str]] = (pd.DataFrame(), [])    # :func:`engine_collectives`
    gloo: pd.DataFrame = field(default_factory=pd.DataFrame)             # :func:`gloo_ceiling`


def run(ctx: PhaseContext) -> Phase5Result:
    """Phase 5's entry (the phase contract), from the notebook's parameters (``ctx.params``): plan the nccl-tests
    runs, run them (or point at the recorded sweep), parse the logs, place the model's messages on the curves, read
    the sweep, and judge the target's gate."""
    p = ctx.params
    comm = plan_runs(ctx)
    comm = run_tests(ctx, comm, p.launcher)
    data = load_logs(ctx, p.nccl_tests_logs, p.nccl_info_logs, runs=comm)
    msgs = messages(ctx, data, p.hidden_size, p.dtype_bytes, p.tp, p.num_layers, p.decode_batch,
                    p.prefill_chunk, p.vocab_size)
    sweep = sweep_tables(ctx, comm, msgs)
    verdict = gate_for_target(ctx, data)
    gloo = gloo_ceiling(ctx, p.gloo_sweep, p.max_bytes, p.step_factor, p.run_timeout_s)
    return Phase5Result(comm, data, msgs, sweep, verdict, engine_gate_record(ctx), ctx.from_samples,
                        engine_collectives(ctx, data, gloo), gloo)


GLOO_MIN_BYTES = 64        # a CPU engine's collectives are small (a tiny model's decode all-reduce: a few hundred B)


def gloo_ceiling(ctx: PhaseContext, run_it: bool = True, max_bytes: str = "64M", step_factor: int = 2,
                 timeout_s: int = 300) -> pd.DataFrame:
    """The CPU engine's communication ceiling (``measure.gloo_sweep``): gloo all-reduce and all-gather from 64 B to
    ``max_bytes`` with the engine's own interpreter and as many ranks as its TP group (at least 2), written to
    ``gloo_sweep.csv`` (Phase 3 reads it beside its capture). One row with a note where it does not apply."""
    adapter = engine_for(ctx.target.engine)
    if not run_it:
        return pd.DataFrame({"note": ["gloo_sweep is off"]})
    python = adapter.gloo_python(ctx.target)
    if python is None:
        return pd.DataFrame({"note": [f"target {ctx.target.name}'s ranks do not talk through gloo on this machine's "
                                      "CPU: its ceiling is nccl-tests'"]})
    world = max(2, adapter.topology(ctx.target.launch)["tp"])
    out = Path(ctx.phase_dir) / "gloo_runs"
    plan = gs.plan(python, world, gs.sizes(GLOO_MIN_BYTES, nt.size_bytes(max_bytes), step_factor), out)
    emit_progress(Path(ctx.run_dir), ctx.phase, f"gloo sweep: {world} ranks, all-reduce and all-gather")
    start = now_iso()
    try:
        with ProcessTracker() as tracker:
            plan = gs.run_sweep(plan, tracker, timeout_s=timeout_s)
    except gs.GlooSweepError as exc:
        raise RuntimeError(str(exc)) from None
    finally:
        for r, argv in enumerate(plan.argv):
            ctx.log_command("executed", argv, title=f"gloo sweep rank {r}", host="local", env=plan.env,
                        start=start, end=now_iso(), log=str(plan.logs[r]),
                        exit_code=plan.exit_codes[r] if r < len(plan.exit_codes) else None)
    rows = plan.rows
    rows.to_csv(Path(ctx.phase_dir) / "gloo_sweep.csv", index=False)
    return rows


def gloo_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The sweep as the page shows it: one line per collective and size."""
    if rows.empty or "note" in rows.columns:
        return rows
    t = rows[["collective", "nranks", "size_bytes", "time_us", "algbw_gbps", "busbw_gbps", "status"]]
    return t.rename(columns={"nranks": "ranks", "size_bytes": "size (B)", "time_us": "time (µs)",
                             "algbw_gbps": "algbw (GB/s)", "busbw_gbps": "busbw (GB/s)"}).round(
        {"time (µs)": 1, "algbw (GB/s)": 3, "busbw (GB/s)": 3})


def engine_collectives(ctx: PhaseContext, data: Phase5Data, gloo: pd.DataFrame | None = None
                       ) -> tuple[pd.DataFrame, list[str]]:
    """The engine's collectives as Phase 3 of this run captured them (``phase3/collectives_vs_ceiling.csv``)
    against this phase's curves (``analyse.ceiling.with_ceiling``) — the gloo sweep's on a CPU engine, nccl-tests'
    otherwise — and the finding; empty with a note when Phase 3 has not run in this run."""
    f = Path(ctx.run_dir) / "phase3" / "collectives_vs_ceiling.csv"
    if not f.is_file():
        return pd.DataFrame({"note": ["Phase 3 has not captured this run's collectives: servelab run phase3 --target "
                                      f"<target> --run-id {ctx.run_id}, then this phase again"]}), []
    if gloo is not None and not gloo.empty and "note" not in gloo.columns:
        curves, source = gloo, "gloo ceiling measured here"
    else:
        curves, source = data.curves, ("ceiling measured here" if not ctx.from_samples else "recorded H200 ceiling")
    t = with_ceiling(pd.read_csv(f), curves)
    t.to_csv(Path(ctx.phase_dir) / "engine_vs_ceiling.csv", index=False)
    text = ceiling_finding(t, source)
    return t, [f"The engine's collectives (Phase 3): {text}"] if text else []


def record_h1(ctx: PhaseContext, data: Phase5Data, msgs: pd.DataFrame) -> pd.DataFrame:
    """H1 (TP cross-node communication exposed on every layer) from the model's decode collectives placed on the
    measured curves (``model_messages.csv``): their time per decode step against this run's Phase 3 median
    decode step. *supported* at ≥ 15 % of the step, *refuted* below — only for curves that cross nodes (the INFO
    log's nNodes > 1 or NET connections); one-node curves, no INFO log or no decode step: *inconclusive*."""
    dec = pd.DataFrame()
    if not msgs.empty and {"scenario", "step_time_us"} <= set(msgs.columns):
        dec = msgs[msgs["scenario"].astype(str).str.startswith("decode") & msgs["step_time_us"].notna()]
    comm_us = float(dec["step_time_us"].sum()) if not dec.empty else None
    net = int(data.transports["net_connections"].sum()) if "net_connections" in data.transports.columns else 0
    nnodes = data.info.nnodes if data.info is not None else None
    step_ms, step_sample = _decode_step_ms(ctx.run_dir)
    nums: dict[str, Any] = {"decode_comm_us_per_step": comm_us, "nnodes": nnodes, "net_connections": net,
                            "decode_step_ms": step_ms, "threshold_pct": H1_DECODE_COMM_PCT}
    tables = ["model_messages.csv", "nccl_tests.csv", "nccl_transports.csv"]
    if comm_us is None:
        verdict, summary = "inconclusive", "no decode message of the model falls on the measured curves"
    else:
        what = (f"the model's decode collectives ({', '.join(sorted(set(dec['collective'].astype(str))))}) cost "
                f"{comm_us:.0f} µs per step on these curves")
        if data.info is None:
            verdict, summary = "inconclusive", f"{what}; no NCCL INFO log: whether the curves cross nodes is unknown"
        elif (nnodes or 1) <= 1 and net == 0:
            verdict, summary = "inconclusive", (f"{what}; the curves are from one node (no NET channel): H1 is "
                                                "about cross-node TP collectives — run nccl-tests across the nodes")
        elif step_ms is None:
            verdict, summary = "inconclusive", (f"{what} across {nnodes} nodes; no decode step time in this run "
                                                "(Phase 3 on a capture of this target gives it)")
        else:
            pct = 100 * comm_us / (1000 * step_ms)
            nums["decode_comm_pct_of_step"] = round(pct, 2)
            tables.append("phase3/trace_summary.csv")
            verdict = "supported" if pct >= H1_DECODE_COMM_PCT else "refuted"
            summary = (f"{what} across {nnodes} nodes: {pct:.1f}% of the {step_ms:.2f} ms median decode step "
                       f"(Phase 3), threshold {H1_DECODE_COMM_PCT:g}%")
    sample = bool(ctx.from_samples) or step_sample
    ev = record_evidence(ctx, "H1", verdict, summary, anchor="The-model's-messages-on-the-measured-curves",
                         table=tables, numbers=nums, from_samples=sample)
    return evidence_frame([ev])


# ---------------------------------------------------------------- the page's views of the runs

def run_summary(runs: CommRuns, res: SweepResult | None = None) -> pd.DataFrame:
    """Where the runs on this page come from, how many of each scope, and what was left out and why."""
    plan = runs.plan
    count = pd.Series([r.scope for r in plan.runs]).value_counts() if plan.runs else pd.Series(dtype=int)
    rows = [("source", "executed on the target in this run" if runs.execute else
             "recorded sample data/samples/" + SWEEP_SAMPLE + " (not measured in this run)")]
    if runs.why_not_run:
        rows.append(("why nothing ran here", runs.why_not_run + "; every command of the run plan is recorded as planned"))
    rows += [(f"planned {scope} runs", int(count.get(scope, 0))) for scope in nt.SCOPES]
    rows.append(("nccl-tests folder", plan.bin_dir))
    if res is not None and not res.runs.empty:
        bad = res.runs[res.runs.status != "ok"]
        rows.append(("runs read", len(res.runs)))
        rows.append(("runs not ok", f"{len(bad)}" + (": " + "; ".join(f"{r.run_id} {r.status} ({r.reason})"
                                                                       for r in bad.head(5).itertuples())
                                                    if len(bad) else "")))
    rows += [("left out", s) for s in runs.skipped]
    return pd.DataFrame(rows, columns=["item", "value"])


def p2p_view(res: SweepResult, value: str = "busbw_gbps") -> pd.DataFrame:
    """The P2P matrix of each node as a square table (``busbw_gbps`` at the largest size, or ``time_us`` at the
    smallest)."""
    return sw.p2p_pivot(res.p2p, value)


def sweep_findings(runs: CommRuns, res: SweepResult) -> list[str]:
    """The sweep and the P2P matrix in sentences for the findings box."""
    out = []
    src = f" (recorded sample, {SWEEP_SAMPLE})" if res.from_samples else ""
    if runs.execute:
        bad = res.runs[res.runs.status != "ok"] if not res.runs.empty else res.runs
        out.append(f"nccl-tests ran {len(res.runs)} times on {', '.join(dict.fromkeys(res.runs.node))}"
                   + (f"; {len(bad)} not ok ({'; '.join(f'{r.run_id}: {r.status}' for r in bad.head(3).itertuples())})"
                      if len(bad) else ", every run ok") + ".")
    else:
        out.append(f"Nothing ran on the target: {runs.why_not_run}. Its {len(runs.plan.runs)} nccl-tests commands are "
                   "recorded as planned (one GPU per node where a node declares none), and the sweep shown is the "
                   "recorded 1 × H200 one — one rank, where NCCL runs no algorithm, so no setting can change anything.")
    if not res.env.empty:
        miss = res.env[res.env.verdict != "reached NCCL"]
        if len(miss):
            out.append(f"NCCL did not report reading {', '.join(sorted(set(miss.setting)))} in the NCCL_DEBUG=INFO runs on "
                       f"{', '.join(sorted(set(miss.node)))}, {int(miss.ranks.max())} rank(s) each: the sweep's runs "
                       "with those settings measured NCCL's own choice, whatever their numbers say.")
        else:
            out.append(f"Every swept variable reached NCCL{src} (its INFO log names each value).")
    if not res.winners.empty:
        parts = []
        for w in res.winners.itertuples():
            where = f"{w.scope} {w.node}"
            if w.best_setting == "baseline":
                parts.append(f"{w.scenario} {w.collective} (~{_size(w.measured_size_bytes)}, {where}): no setting "
                             "faster than the baseline beyond noise")
            else:
                parts.append(f"{w.scenario} {w.collective} (~{_size(w.measured_size_bytes)}, {where}): "
                             f"{w.best_setting} {w.delta_time_pct:+.1f} % time per call")
        out.append(f"At the model's message sizes{src}: " + "; ".join(parts) + ".")
    if not res.p2p.empty and res.p2p.busbw_gbps.notna().any():
        p = res.p2p.dropna(subset=["busbw_gbps"])
        lo = p.loc[p.busbw_gbps.idxmin()]
        recorded = " (recorded 2 × H200 send/recv, its one GPU pair)" if res.p2p_from_samples else ""
        if len(p) == 1:
            out.append(f"P2P matrix{recorded}: GPU {int(lo.gpu_a)}–{int(lo.gpu_b)} of {lo.node}: send/recv busbw "
                       f"{lo.busbw_gbps:,.1f} GB/s at {_size(lo.largest_size_bytes)}, {lo.time_us:,.1f} µs for "
                       f"{_size(lo.smallest_size_bytes)}.")
        else:
            out.append(f"P2P matrix{recorded}: {len(p)} GPU pairs, send/recv busbw at {_size(lo.largest_size_bytes)} "
                       f"from {p.busbw_gbps.min():,.1f} to {p.busbw_gbps.max():,.1f} GB/s (slowest: {lo.node} GPU "
                       f"{int(lo.gpu_a)}–{int(lo.gpu_b)}), smallest-message time {p.time_us.min():,.1f}–"
                       f"{p.time_us.max():,.1f} µs.")
    return out


def sweep_headline(runs: CommRuns, res: SweepResult) -> dict[str, Any]:
    bad = int((res.runs.status != "ok").sum()) if not res.runs.empty else 0
    return {"nccl_tests_runs": len(res.runs), "nccl_tests_runs_not_ok": bad,
            "nccl_tests_source": "executed" if runs.execute else "recorded sample"}
