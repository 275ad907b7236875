"""What the Phase 5 notebook calls: load nccl-tests and NCCL INFO logs (recorded samples or a run's
own), place the model's message sizes on the curves, and judge the target's transport gate.
Every table it returns is also written into the phase folder."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from servelab.deploy.nccl_gate import GateVerdict, check_gate, verdict_table
from servelab.deploy.nccl_info import NcclInfo, parse_info, parse_info_files, transport_table
from servelab.analyse.nccl.msgsize import model_message_sizes, place_on_curves, from_trace
from servelab.analyse.nccl.perf_log import NcclTestRun, parse_file, runs_frame, runs_table
from servelab.core.paths import samples_root
from servelab.core.run import read_manifest
from servelab.report.ledger import evidence_frame, record_evidence

TWO_RAIL_GATE = {"required_hcas": ["mlx5_0", "mlx5_3"], "require": ["NET/IB", "GDRDMA"]}


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


def load_logs(ctx: Any, tests_logs: list[str] | None = None, info_logs: list[str] | None = None,
              label: str = "") -> Phase5Data:
    """Parse nccl-tests logs and INFO logs (default: the recorded 2 × H200 samples; then
    ``ctx.from_samples`` is set). Writes ``nccl_tests.csv``, ``nccl_runs.csv``, ``nccl_transports.csv``
    and ``nccl_tuning.csv`` into the phase folder."""
    default_tests, default_info = sample_paths()
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


def messages(ctx: Any, data: Phase5Data, hidden_size: int, dtype_bytes: int, tp: int, num_layers: int,
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
    return placed


def gate_for_target(ctx: Any, data: Phase5Data) -> GateVerdict:
    """The target's own gate (``gate:`` in its YAML) against the INFO log; written to ``gate.json``."""
    info = data.info if data.info is not None else parse_info("")
    v = check_gate(ctx.target.gate, info)
    (Path(ctx.phase_dir) / "gate.json").write_text(json.dumps(
        {"target": ctx.target.name, "gate": ctx.target.gate, "verdict": v.verdict, "passed": v.passed,
         "message": v.message, "reasons": v.reasons, "sources": data.sources}, indent=2))
    return v


def engine_gate_record(ctx: Any) -> dict[str, Any]:
    """The transport gate as judged at this run's last engine start (``manifest["gate"]``, written by the engine
    start of a target that declares ``gate:``); ``{}`` when no gated engine was started in this run."""
    return dict(read_manifest(Path(ctx.run_dir)).get("gate") or {})


def engine_gate(ctx: Any) -> pd.DataFrame:
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
        out.append(f"At the model's real message sizes{src}: " + "; ".join(parts) + ".")
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


def record_h1(ctx: Any, data: Phase5Data, msgs: pd.DataFrame) -> pd.DataFrame:
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
