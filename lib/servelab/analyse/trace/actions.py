"""The evidence → likely cause → next A/B table (``docs/method.md#evidence-actions``), applied to measured
trace numbers — and, for the three rows a trace cannot decide, to the same run's other phases.

Every row states the metric, the measured value, the threshold and a status: ``triggered``, ``not
triggered`` or ``not evaluable`` (with the phase whose data would decide it). Thresholds are defaults a
user may override with ``thresholds={...}``.

Three rows come from the tables other phases wrote into the run folder (``run_dir``), never from their code:

- *slow at C=1, TPS improves with concurrency* — Phase 1's ``phase1/matrix.csv``: the VALID decode points' output
  TPS at concurrency 1 and above (:func:`concurrency_row`);
- *KV cache near full for long* — Phase 8's ``phase8/kv_usage.csv``: the KV usage samples of every point
  (:func:`kv_row`);
- *rails unbalanced* — Phase 2's ``phase2/phase2_questions.csv``: its rails question answered per case
  (:func:`rails_row`).

Without the run folder, or where the phase has not run (or read recorded sample data), the row says which phase
to run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import polars as pl

from servelab.analyse.trace.analysis import CaptureAnalysis
from servelab.core.run import read_manifest

DEFAULT_THRESHOLDS = {
    "decode_exposed_comm_pct": 15.0,     # exposed comm / decode GPU step time
    "host_bound_idle_pct": 10.0,         # host-bound GPU idle inside steps / step time
    "indexer_vs_attention": 0.8,         # indexer time / the attention it serves
    "prefill_attention_growth": 1.5,     # exponent of attention time vs prefill tokens
    "decode_delay_factor": 2.0,          # delayed token interval / steady interval
    "gpu_busy_low_pct": 60.0,            # decode GPU busy below this …
    "cpu_thread_busy_pct": 90.0,         # … while the launching thread is this busy
    "concurrency_scaling": 0.5,          # decode TPS at C=N / (N × TPS at C=1): this share of linear scaling or more
    "kv_full_pct": 90.0,                 # KV usage at or above this …
    "kv_full_time_pct": 20.0,            # … in this share of a Phase 8 point's samples
}
# the tables these rows read, relative to the run folder, and the phase that writes each
PHASE1_MATRIX = "phase1/matrix.csv"
PHASE8_KV = "phase8/kv_usage.csv"
PHASE2_QUESTIONS = "phase2/phase2_questions.csv"


@dataclass
class Action:
    evidence: str
    metric: str
    measured: str
    threshold: str
    status: str
    likely_cause: str
    next_ab: str


def _sum_kind(a: CaptureAnalysis, kinds: tuple[str, ...]) -> dict:
    s = a.summary.filter(pl.col("kind").is_in(list(kinds))) if a.summary.height else a.summary
    if s.height == 0:
        return {}
    span = s["gpu_span_ms"].sum()
    return {"span": span, "exposed": s["exposed_comm_ms"].sum(), "comm": s["comm_ms"].sum(),
            "host": s["host_bound_idle_ms"].sum(), "busy": s["busy_ms"].sum()}


def evidence_actions(a: CaptureAnalysis, thresholds: dict[str, float] | None = None,
                     run_dir: str | Path | None = None) -> pl.DataFrame:
    """The table's rows with measured values. Columns: evidence, metric, measured, threshold, status, likely_cause,
    next_ab. ``run_dir`` is the run the capture belongs to: the rows a trace cannot decide are read from its Phase 1,
    8 and 2 tables (module docstring); without it they say which phase to run."""
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    rows: list[Action] = []

    kind = "decode" if _sum_kind(a, ("decode",)) else "mixed"
    d = _sum_kind(a, (kind,))
    if d and d["span"]:
        cbc = a.comm_by_collective.filter(pl.col("kind") == kind) if a.comm_by_collective.height else None
        tp_exp = float(cbc.filter(pl.col("collective") != "SendRecv")["exposed_ms"].sum()) if cbc is not None \
            else d["exposed"]
        sr_exp = float(cbc.filter(pl.col("collective") == "SendRecv")["exposed_ms"].sum()) if cbc is not None else 0.0
        pct = 100 * tp_exp / d["span"]
        meas = f"{pct:.1f}% (all comm {100 * d['comm'] / d['span']:.1f}%"
        meas += f"; PP SendRecv wait {100 * sr_exp / d['span']:.1f}% not counted)" if sr_exp else ")"
        rows.append(Action("Decode 中 NCCL 占比高，且通信未被计算覆盖 (decode comm high and not overlapped)",
                           f"{kind} exposed TP-collective time / GPU step time", meas,
                           f"≥ {th['decode_exposed_comm_pct']:g}%",
                           "triggered" if pct >= th["decode_exposed_comm_pct"] else "not triggered",
                           "TP16 通信受限 (TP communication-bound)", "TP8+PP2; NCCL topology and algorithm"))
    else:
        rows.append(Action("Decode 中 NCCL 占比高，且通信未被计算覆盖", "decode exposed comm / GPU step time", "-",
                           f"≥ {th['decode_exposed_comm_pct']:g}%", "not evaluable (no decode windows)",
                           "TP16 通信受限", "TP8+PP2; NCCL topology and algorithm"))

    rows.append(concurrency_row(run_dir, th))

    worst_kind, worst_pct = None, -1.0
    for k in ("prefill", "decode", "mixed", "all"):
        s = _sum_kind(a, (k,))
        if s and s["span"]:
            p = 100 * s["host"] / s["span"]
            if p > worst_pct:
                worst_kind, worst_pct = k, p
    rows.append(Action("GPU 利用率呈锯齿，Kernel 间有明显空洞 (sawtooth utilisation, holes between kernels)",
                       "host-bound GPU idle inside steps / step time (worst window kind)",
                       f"{worst_pct:.1f}% ({worst_kind})" if worst_kind else "-",
                       f"≥ {th['host_bound_idle_pct']:g}%",
                       ("triggered" if worst_pct >= th["host_bound_idle_pct"] else "not triggered") if worst_kind
                       else "not evaluable", "CPU Scheduler 或 Launch 开销 (CPU scheduler or launch overhead)",
                       "CUDA Graph; async (overlap) scheduling"))

    sr = a.slow_rank or {}
    if len(a.rops) < 2:
        st, meas = "not evaluable (one rank)", "-"
    elif a.collective_skew.height == 0 and a.step_skew.height == 0:
        st, meas = "not evaluable (no peer ranks in the same stage)", "-"
    else:
        st = "triggered" if sr.get("slow_rank") is not None else "not triggered"
        meas = sr.get("evidence", "-")
    rows.append(Action("一个或少数 Rank 长期最慢 (one or a few ranks always slowest)", "last arrival at collectives / steps",
                       meas, "last in ≥ 50% (≥ 2× chance) and ≥ 10 µs late", st,
                       "Expert、NIC 或 NUMA 不均衡 (expert, NIC or NUMA imbalance)", "EPLB; CPU/NIC affinity; rank mapping"))

    if a.stages.height == 0:
        st, meas = "not evaluable (one pipeline stage)", "-"
    else:
        st = "triggered" if sr.get("slow_stage") is not None else "not triggered"
        meas = sr.get("stage_evidence", "-")
    rows.append(Action("一个 PP Stage 长期最慢 (one pipeline stage holds the pipeline back)",
                       "stage GPU time per step / the other stages' (consecutive steps)", meas,
                       "≥ 1.5× for ≥ 3 consecutive steps", st,
                       "Stage 层切分不均或该 Stage 更慢 (uneven layer split, or that stage's GPU / host is slower)",
                       "rebalance layers across stages; compare that stage's GPU clocks, host and launch path"))

    attn = pl.concat([r.ops.filter(pl.col("cls") == "attention").select("subclass", "dur_ns") for r in a.rops],
                     how="vertical_relaxed") if a.rops else pl.DataFrame()
    by = {k: v for k, v in attn.group_by("subclass").agg(pl.col("dur_ns").sum()).iter_rows()} if attn.height else {}
    if by.get("indexer"):
        served = by.get("sparse") or by.get("attention") or 0
        ratio = by["indexer"] / served if served else float("inf")
        rows.append(Action("NSA Indexer 时间接近或超过 Attention (indexer time near or above attention)",
                           "indexer time / attention time", f"{ratio:.2f}×", f"≥ {th['indexer_vs_attention']:g}×",
                           "triggered" if ratio >= th["indexer_vs_attention"] else "not triggered",
                           "稀疏索引收益不足 (sparse indexing does not pay off)", "Indexer backend; top-k; fusion"))
    else:
        rows.append(Action("NSA Indexer 时间接近或超过 Attention", "indexer time / attention time", "-",
                           f"≥ {th['indexer_vs_attention']:g}×", "not evaluable (no indexer kernels)",
                           "稀疏索引收益不足", "Indexer backend; top-k; fusion"))

    rows.append(_attention_growth(a, th))

    rows.append(kv_row(run_dir, th))

    it = a.interference
    hit = it.filter(pl.col("prefill_between_ms") > 0) if it.height else it
    if hit.height and hit["baseline_ms"][0]:
        factor = float(hit["interval_ms"].max()) / float(hit["baseline_ms"][0])
        rows.append(Action("注入长 Prefill 后 Decode TPOT 暴涨 (decode TPOT spikes after a long prefill)",
                           "worst decode token interval / steady interval", f"{factor:.1f}×",
                           f"≥ {th['decode_delay_factor']:g}×",
                           "triggered" if factor >= th["decode_delay_factor"] else "not triggered",
                           "Prefill/Decode 相互干扰 (prefill/decode interference)", "Chunked prefill size; scheduler policy"))
    else:
        rows.append(Action("注入长 Prefill 后 Decode TPOT 暴涨", "worst decode token interval / steady interval", "-",
                           f"≥ {th['decode_delay_factor']:g}×", "not evaluable (no prefill between decode steps)",
                           "Prefill/Decode 相互干扰", "Chunked prefill size; scheduler policy"))

    rows.append(_host_bottleneck(a, th))

    rows.append(rails_row(run_dir))
    return pl.DataFrame([asdict(r) for r in rows])


# ---------------------------------------------------------------- rows from the run's other phases

def _phase_table(run_dir: str | Path | None, rel: str, phase: str, what: str) -> tuple[Any, str]:
    """``(frame, "")`` of a phase's table in the run folder, or ``(None, why not and what to run)``."""
    if run_dir is None:
        return None, f"not evaluable from a trace alone: run Phase {phase[-1]} on the target: {what}"
    manifest = read_manifest(Path(run_dir))
    # a command to paste: the run's own target, never a <placeholder> (none recorded: say so in words)
    target = manifest.get("target")
    todo = (f"run Phase {phase[-1]} in this run (servelab run {phase} --target {target} --run-id "
            f"{Path(run_dir).name}): {what}" if target else f"run Phase {phase[-1]} in this run on its target: {what}")
    entry = (manifest.get("phases") or {}).get(phase) or {}
    path = Path(run_dir) / rel
    if entry.get("from_samples"):
        return None, f"not evaluable: Phase {phase[-1]} read recorded sample data, not this target — {todo}"
    if not path.is_file():
        st = entry.get("status")
        # worded by run order: a later run of that phase does not make this sentence false
        return None, (f"not evaluable: Phase {phase[-1]} {'had ended ' + str(st) + ' without' if st else 'had not written'} "
                      f"{rel} when this was computed — {todo}")
    try:
        return pd.read_csv(path), ""
    except (pd.errors.EmptyDataError, pd.errors.ParserError, OSError) as exc:
        return None, f"not evaluable: {rel} cannot be read ({exc}) — {todo}"


def concurrency_row(run_dir: str | Path | None, th: dict[str, float]) -> Action:
    """*Slow at C=1, TPS improves clearly with concurrency* from Phase 1's VALID decode points (``matrix.csv``): the
    best output TPS above concurrency 1 against C=1's, as a share of linear scaling. Memory-bound decode (every
    step reads all weights whatever the batch) scales almost linearly: triggered at ≥ ``concurrency_scaling``."""
    base = ("C=1 很慢，并发增加后 TPS 明显改善 (slow at C=1, TPS improves with concurrency)",
            f"decode output TPS at the best C > 1 / (C × TPS at C=1) ({PHASE1_MATRIX})")
    thr = f"≥ {th['concurrency_scaling']:g} of linear"
    cause, nxt = "MoE/权重读取 Memory-bound (memory-bound weight/MoE reads)", "Batch, MoE backend, MTP"
    m, why = _phase_table(run_dir, PHASE1_MATRIX, "phase1", "its decode points D1 and D2 at C=1 and above decide it")
    if m is None:
        return Action(*base, "-", thr, why, cause, nxt)
    need = {"kind", "concurrency", "output_throughput"}
    if not need <= set(m.columns):
        return Action(*base, "-", thr, f"not evaluable: {PHASE1_MATRIX} lacks {sorted(need - set(m.columns))}",
                      cause, nxt)
    d = m[m["kind"] == "decode"]
    if "validity" in d.columns:
        d = d[d["validity"] == "VALID"]
    if "definition" in d.columns and d["definition"].nunique() > 1:     # the same TPS under both definitions
        d = d[d["definition"] == d["definition"].iloc[0]]
    d = d.dropna(subset=["concurrency", "output_throughput"])
    tps = d.groupby("concurrency")["output_throughput"].mean()
    if 1 not in tps.index or len(tps) < 2 or not tps.loc[1] > 0:
        have = ", ".join(f"C={int(c)}" for c in tps.index) or "none"
        return Action(*base, "-", thr, f"not evaluable: Phase 1 has no VALID decode point at C=1 and one above it "
                      f"(VALID decode points: {have}) — run Phase 1 with D1 and D2", cause, nxt)
    above = tps[tps.index > 1]
    best_c = int(above.idxmax())
    gain = float(above.loc[best_c] / tps.loc[1])
    share = gain / best_c
    meas = (f"{share:.2f} of linear: {tps.loc[1]:,.1f} tok/s at C=1 → {above.loc[best_c]:,.1f} at C={best_c} "
            f"({gain:.2f}×; Phase 1, {len(tps)} VALID decode points)")
    return Action(*base, meas, thr, "triggered" if share >= th["concurrency_scaling"] else "not triggered", cause, nxt)


def kv_row(run_dir: str | Path | None, th: dict[str, float]) -> Action:
    """*KV cache near full for long* from Phase 8's KV usage samples (``kv_usage.csv``: the engine's KV gauge, or on
    llama.cpp the tokens of the slots being processed over their capacity): per point the share of samples at or
    above ``kv_full_pct``; triggered when a point spends ≥ ``kv_full_time_pct`` of its samples there. Retractions and
    preemptions are not in Phase 8's tables (Phase 1's server metrics and the engine log have them)."""
    base = ("KV Cache 长期接近满并发生重算 (KV cache near full, recomputation)",
            f"share of a point's KV usage samples ≥ {th['kv_full_pct']:g}% ({PHASE8_KV})")
    thr = f"≥ {th['kv_full_time_pct']:g}% of a point's samples"
    cause, nxt = "HBM 容量不足 (HBM capacity)", "FP8 KV; concurrency and context limits"
    kv, why = _phase_table(run_dir, PHASE8_KV, "phase8", "its KV usage samples decide it")
    if kv is None:
        return Action(*base, "-", thr, why, cause, nxt)
    if not {"metric", "value", "point"} <= set(kv.columns) or kv.empty:
        return Action(*base, "-", thr, f"not evaluable: {PHASE8_KV} holds no KV usage samples (the engine exposes "
                      "no KV gauge and no slots)", cause, nxt)
    metric = "kv_usage" if (kv["metric"] == "kv_usage").any() else "kv_active"
    k = kv[kv["metric"] == metric].dropna(subset=["value"])
    if k.empty:
        return Action(*base, "-", thr, f"not evaluable: {PHASE8_KV} has no kv_usage or kv_active samples", cause, nxt)
    full = th["kv_full_pct"] / 100
    per = k.groupby("point")["value"].agg(peak="max", n="size", full=lambda v: float((v >= full).mean()))
    worst = per.sort_values(["full", "peak"], ascending=False).iloc[0]
    name = per.sort_values(["full", "peak"], ascending=False).index[0]
    meas = (f"{100 * worst['full']:.0f}% of {int(worst['n'])} samples ≥ {th['kv_full_pct']:g}% in {name} (peak "
            f"{100 * per['peak'].max():.1f}% over {len(per)} point(s); {metric}); retractions not in Phase 8's tables")
    trig = 100 * worst["full"] >= th["kv_full_time_pct"]
    return Action(*base, meas, thr, "triggered" if trig else "not triggered", cause, nxt)


def rails_row(run_dir: str | Path | None) -> Action:
    """*Traffic on the two rails clearly unbalanced* from Phase 2's answers to its rails question
    (``phase2_questions.csv``: every rail carries traffic and the spread of per-rail means ≤ 20 %, per case):
    triggered when a case answers no; not evaluable when no case had rail counters."""
    base = ("两条 Rail 流量明显不均 (traffic on the two rails clearly unbalanced)",
            f"per-rail traffic in each case's window ({PHASE2_QUESTIONS})")
    thr = "a rail idle, or the spread of per-rail means > 20%"
    cause, nxt = "NIC Mapping 或 NCCL 拓扑 (NIC mapping or NCCL topology)", "HCA list; NCCL_CROSS_NIC; NUMA affinity"
    q, why = _phase_table(run_dir, PHASE2_QUESTIONS, "phase2", "its per-rail counters in each case window decide it")
    if q is None:
        return Action(*base, "-", thr, why, cause, nxt)
    if not {"question", "answer"} <= set(q.columns):
        return Action(*base, "-", thr, f"not evaluable: {PHASE2_QUESTIONS} has no question/answer columns", cause, nxt)
    r = q[q["question"].astype(str).str.contains("rails", case=False)]
    answered = r[r["answer"].isin(["yes", "no"])]
    case = r["case"] if "case" in r.columns else r.index.astype(str)
    if answered.empty:
        ev = str(r["evidence"].iloc[0]) if len(r) and "evidence" in r.columns else "no rails question"
        return Action(*base, "-", thr, f"not evaluable: Phase 2 had no rail counters in any of its {len(r)} case "
                      f"window(s) ({ev}) — run it on the cluster's nodes with the rdma/ethtool collectors", cause, nxt)
    bad = answered[answered["answer"] == "no"]
    show = bad if not bad.empty else answered
    ev = "; ".join(f"{c}: {e}" for c, e in zip(case.loc[show.index], show.get("evidence", show["answer"]))
                   )[:400]
    meas = f"{len(bad)} of {len(answered)} case(s) unbalanced — {ev}"
    return Action(*base, meas, thr, "triggered" if not bad.empty else "not triggered", cause, nxt)


def _attention_growth(a: CaptureAnalysis, th: dict) -> Action:
    base = ("长 ISL 的 Attention 时间异常增长 (attention time grows abnormally with long ISL)",
            "attention ms vs prefill tokens (log-log slope)")
    pts = []
    for r in a.rops:
        w = r.windows.filter((pl.col("phase") == "prefill") & pl.col("toks").is_not_null())
        if w.height == 0:
            continue
        at = (r.ops.filter((pl.col("cls") == "attention") & pl.col("window").is_not_null())
              .group_by("window").agg(pl.col("dur_ns").sum().alias("ns")))
        j = w.join(at, on="window", how="inner")
        pts += [(t, ns) for t, ns in zip(j["toks"].to_list(), j["ns"].to_list()) if t and ns]
    sizes = sorted({t for t, _ in pts})
    if len(sizes) < 2:
        return Action(*base, "-", f"slope ≥ {th['prefill_attention_growth']:g}",
                      "not evaluable (needs prefill steps of ≥ 2 token counts, e.g. an ISL sweep)",
                      "Prefill Kernel 或 Chunking 问题", "Prefill backend; chunk size")
    xs = [math.log(t) for t, _ in pts]
    ys = [math.log(ns) for _, ns in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return Action(*base, f"{slope:.2f} over {sizes[0]}–{sizes[-1]} tokens", f"slope ≥ {th['prefill_attention_growth']:g}",
                  "triggered" if slope >= th["prefill_attention_growth"] else "not triggered",
                  "Prefill Kernel 或 Chunking 问题 (prefill kernel or chunking)", "Prefill backend; chunk size")


def _host_bottleneck(a: CaptureAnalysis, th: dict) -> Action:
    base = ("GPU 利用率低但 CPU 单核满载 (GPU under-used while one CPU core is saturated)",
            "decode GPU busy % / launching thread busy %")
    d = _sum_kind(a, ("decode",)) or _sum_kind(a, ("all",))
    ct = a.cpu_threads
    if not d or ct.height == 0:
        return Action(*base, "-", "-", "not evaluable (no decode windows or CPU events)",
                      "Host 端瓶颈", "Frontend, tokenizer, scheduler")
    gpu = 100 * d["busy"] / d["span"] if d["span"] else 0.0
    cpu = float(ct["busy_pct"].max())
    trig = gpu < th["gpu_busy_low_pct"] and cpu >= th["cpu_thread_busy_pct"]
    return Action(*base, f"GPU {gpu:.1f}% / CPU thread {cpu:.1f}%",
                  f"GPU < {th['gpu_busy_low_pct']:g}% and CPU ≥ {th['cpu_thread_busy_pct']:g}%",
                  "triggered" if trig else "not triggered", "Host 端瓶颈 (host-side bottleneck)",
                  "Frontend, tokenizer, scheduler")
