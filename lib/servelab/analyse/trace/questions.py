"""The ten questions a Phase 3 timeline must answer (``docs/method.md#timeline-questions``), answered from
one capture.

Each answer carries the numbers it rests on and the trace files they come from, or says "not answerable
from this capture" and why (e.g. no MoE kernels → Q8). Q8 answers from the engine's expert-token counts when the
capture recorded them (``analyse.trace.experts``), else from a kernel-time proxy, and says which.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import polars as pl

from servelab.analyse.trace.analysis import CaptureAnalysis
from servelab.analyse.trace.experts import HOT_FACTOR, IMBALANCED_RATIO, ExpertCounts, expert_imbalance
from servelab.analyse.trace.stalls import OneClock, stall_summary

QUESTIONS = (
    ("Q1", "Prefill 和 Decode 各自的 Top Kernel 是什么？", "What are the top kernels of prefill and of decode?"),
    ("Q2", "NCCL 在关键路径上的暴露时间是多少？", "How much NCCL/communication time is exposed on the critical path?"),
    ("Q3", "通信与计算重叠了多少？", "How much does communication overlap with computation?"),
    ("Q4", "每层之间是否存在 CPU 或同步空洞？", "Are there CPU or synchronisation gaps between layers?"),
    ("Q5", "CUDA Graph 是否覆盖常见 Decode Batch？", "Do CUDA graphs cover the common decode batches?"),
    ("Q6", "所有 Rank 是否同时结束？", "Do all ranks finish (each step) at the same time?"),
    ("Q7", "是否存在固定慢 Rank？", "Is there a fixed slow rank?"),
    ("Q8", "MoE Expert Token 是否严重不均衡？", "Are MoE expert tokens severely imbalanced?"),
    ("Q9", "NSA Indexer 的成本占 Sparse Attention 总成本多少？", "What share of sparse-attention cost is the NSA indexer?"),
    ("Q10", "长 Prefill 到来时，Decode Kernel 为什么被延迟？", "When a long prefill arrives, why are decode kernels delayed?"),
)


SKEW_OK_US = 100.0    # Q6: ranks "finish together" when the p95 step end skew is below this


@dataclass
class Answer:
    id: str
    question: str
    answerable: bool
    answer: str
    evidence: str
    source: str


def _fmt(v: float | None, unit: str = "", nd: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{nd}f}{unit}"


def _kinds(a: CaptureAnalysis) -> list[str]:
    return [k for k in ("prefill", "decode", "mixed", "draft", "other", "all")
            if a.summary.height and k in a.summary["kind"].to_list()]


def _files(a: CaptureAnalysis) -> str:
    files = a.trace_files
    return ", ".join(files) if len(files) <= 4 else f"{files[0]} … {files[-1]} ({len(files)} files)"


def _per_kind(a: CaptureAnalysis, kind: str) -> dict:
    """Sum of a kind's window metrics over ranks, with ratios."""
    s = a.summary.filter(pl.col("kind") == kind)
    span, comm, exp = s["gpu_span_ms"].sum(), s["comm_ms"].sum(), s["exposed_comm_ms"].sum()
    return {"windows": int(s["windows"].sum()), "span_ms": span, "comm_ms": comm, "exposed_ms": exp,
            "exposed_pct": 100 * exp / span if span else None, "comm_pct": 100 * comm / span if span else None,
            "overlap_pct": 100 * (1 - exp / comm) if comm else None,
            "host_ms": s["host_bound_idle_ms"].sum(), "idle_ms": s["idle_ms"].sum(),
            "host_pct": 100 * s["host_bound_idle_ms"].sum() / span if span else None,
            "busy_pct": 100 * s["busy_ms"].sum() / span if span else None, "ranks": s.height}


def _on_cpu(a: CaptureAnalysis) -> bool:
    """An engine on CPU: the op table is its forward's torch ops and gloo collectives (``ops.cpu_device_ops``)."""
    return bool(a.rops) and all(r.device == "cpu" for r in a.rops)


def _dev(a: CaptureAnalysis) -> str:
    return "the forward thread (CPU)" if _on_cpu(a) else "GPU"


def q1(a: CaptureAnalysis) -> Answer:
    top = a.top_kernels
    kinds = [k for k in ("prefill", "decode", "mixed", "all") if top.height and k in top["kind"].to_list()]
    if not kinds:
        return Answer("Q1", QUESTIONS[0][1], False, "not answerable from this capture",
                      "no GPU kernels in the trace", _files(a))
    parts = []
    for k in kinds:
        t = top.filter(pl.col("kind") == k).head(3)
        items = "; ".join(f"{r['kernel']} ({r['cls']}, {r['share_pct']:.1f}%, {r['total_ms']:.2f} ms)"
                          for r in t.iter_rows(named=True))
        parts.append(f"{k}: {items}")
    missing = [k for k in ("prefill", "decode") if k not in kinds]
    ans = " | ".join(parts)
    ev = f"top_kernels table (top {a.top_n} per window kind, kernel time summed over {len(a.rops)} ranks)"
    if missing and "all" not in kinds:
        ev += f"; no {' / '.join(missing)} windows in this capture"
    return Answer("Q1", QUESTIONS[0][1], True, ans, ev, _files(a))


def q2(a: CaptureAnalysis) -> Answer:
    kinds = _kinds(a)
    if not kinds or a.summary["comm_ms"].sum() == 0:
        return Answer("Q2", QUESTIONS[1][1], a.summary.height > 0,
                      "0 ms: no communication kernels in this capture" if a.summary.height
                      else "not answerable from this capture",
                      "no NCCL / custom all-reduce / symmetric-memory / DeepEP kernels in the trace (a single-GPU run "
                      "or unclassified comm kernels — extend the taxonomy rules)", _files(a))
    parts, ev = [], []
    for k in kinds:
        d = _per_kind(a, k)
        if d["comm_ms"]:
            parts.append(f"{k}: {_fmt(d['exposed_ms'], ' ms', 2)} exposed = {_fmt(d['exposed_pct'], '%')} of "
                         f"{'step' if _on_cpu(a) else 'GPU step'} time (comm {_fmt(d['comm_pct'], '%')})")
            ev.append(f"{k}: {d['windows']} windows × ranks, span {_fmt(d['span_ms'], ' ms', 2)}, comm union "
                      f"{_fmt(d['comm_ms'], ' ms', 2)}")
    cbc = a.comm_by_collective
    if cbc.height:
        split = (cbc.group_by("kind", "collective").agg(pl.col("exposed_ms").sum()).sort("kind", "exposed_ms",
                                                                                          descending=[False, True]))
        ev.append("exposed by collective: " + ", ".join(f"{k}/{c} {v:.2f} ms" for k, c, v in split.iter_rows()))
        if "SendRecv" in split["collective"].to_list():
            ev.append("SendRecv (pipeline) kernels include the wait for the other stage, so their exposed time is "
                      "mostly pipeline wait, not link time")
    what = ("exposed = gloo collective time not covered by any compute op of the forward thread (an engine on CPU: "
            "torch's gloo collectives run on their own threads while the forward thread waits)" if _on_cpu(a)
            else "exposed = comm kernel time not covered by any compute kernel on the same GPU")
    return Answer("Q2", QUESTIONS[1][1], True, "; ".join(parts), what + "; " + "; ".join(ev), _files(a))


def q3(a: CaptureAnalysis) -> Answer:
    kinds = [k for k in _kinds(a) if _per_kind(a, k)["comm_ms"]]
    if not kinds:
        return Answer("Q3", QUESTIONS[2][1], False, "not answerable from this capture",
                      "no communication kernels to overlap", _files(a))
    parts = []
    for k in kinds:
        d = _per_kind(a, k)
        parts.append(f"{k}: {_fmt(d['overlap_pct'], '%')} of comm time overlapped by compute")
    streams = a.device_busy["streams"].max() if a.device_busy.height else None
    ev = (f"overlap = 1 − exposed/comm per window kind; the forward ran on {streams} thread(s) per rank"
          if _on_cpu(a) else f"overlap = 1 − exposed/comm per window kind; GPU ops ran on at most {streams} stream(s) per GPU")
    if streams == 1 and not _on_cpu(a):
        ev += " — a single stream serialises comm and compute, so no overlap is possible"
    return Answer("Q3", QUESTIONS[2][1], True, "; ".join(parts), ev, _files(a))


def q4(a: CaptureAnalysis) -> Answer:
    g = a.gap_summary
    if g.height == 0:
        return Answer("Q4", QUESTIONS[3][1], False, "not answerable from this capture", "no GPU idle gaps measured",
                      _files(a))
    ins = g.filter(pl.col("position") == "in_step")
    parts = []
    for k in _kinds(a):
        d = _per_kind(a, k)
        gk = ins.filter(pl.col("kind") == k)
        host = gk.filter(pl.col("category") == "host_bound")
        n_host = int(host["gaps"].sum()) if host.height else 0
        big = max(host["max_us"].to_list() or [0])
        idle_pct = _fmt(100 - (d['busy_pct'] or 0), '%')
        parts.append(f"{k}: {'device' if _on_cpu(a) else 'GPU'} idle {_fmt(d['idle_ms'], ' ms', 2)} inside steps ({idle_pct}"
                     f" of span), host-bound {_fmt(d['host_ms'], ' ms', 2)} ({_fmt(d['host_pct'], '%')}) in {n_host} "
                     f"gaps, longest {_fmt(big, ' µs', 0)}")
    sync = int(g["after_sync"].sum())
    ev = (f"gap = hole between busy intervals of {_dev(a)}; host-bound = next op not yet launched when it went idle; "
          f"{sync} gaps followed a synchronising runtime call")
    return Answer("Q4", QUESTIONS[3][1], True, "; ".join(parts), ev, _files(a))


def q5(a: CaptureAnalysis) -> Answer:
    if _on_cpu(a):
        return Answer("Q5", QUESTIONS[4][1], False, "not applicable to this capture",
                      "an engine on CPU has no CUDA graphs: its steps run as torch ops on the forward thread", _files(a))
    g = a.graph
    if g.height == 0:
        return Answer("Q5", QUESTIONS[4][1], False, "not answerable from this capture", "no step windows", _files(a))
    dec = g.filter(pl.col("kind").is_in(["decode", "mixed"]))
    if dec.height == 0:
        return Answer("Q5", QUESTIONS[4][1], False, "not answerable from this capture",
                      "no decode windows (window regex matched no decode steps)", _files(a))
    parts = []
    for r in dec.iter_rows(named=True):
        bs = f" bs={r['bs']}" if r["bs"] is not None else ""
        parts.append(f"{r['kind']}{bs}: {r['windows_graphed']}/{r['windows']} windows graph-launched, "
                     f"{_fmt(r['graph_op_pct'], '%')} of kernels")
    total_w = int(dec["windows"].sum())
    graphed = int(dec["windows_graphed"].sum())
    verdict = "yes" if graphed == total_w else ("partly" if graphed else "no")
    return Answer("Q5", QUESTIONS[4][1], True, f"{verdict}: " + "; ".join(parts),
                  "kernels whose correlation id resolves to cudaGraphLaunch/hipGraphLaunch; a window counts as "
                  "graphed when ≥ 90% of its kernels are", _files(a))


def q6(a: CaptureAnalysis) -> Answer:
    if len(a.rops) < 2:
        return Answer("Q6", QUESTIONS[5][1], False, "not answerable from this capture",
                      "only one rank's trace was captured", _files(a))
    s = a.step_skew
    if s.height == 0:
        pp = {r.trace.identity.pp for r in a.rops} - {None}
        why = ("every pipeline stage (DP replica) has a single rank here: stages finish a step at different times "
               "by design — see the PP overlap table" if len(pp) > 1 else "no step window is present on two ranks")
        return Answer("Q6", QUESTIONS[5][1], False, "not answerable from this capture", why, _files(a))
    med, p95, mx = (float(s["end_skew_us"].median()), float(s["end_skew_us"].quantile(0.95, "nearest")),
                    float(s["end_skew_us"].max()))
    worst = s.sort("end_skew_us", descending=True).row(0, named=True)
    al = a.alignment
    note = "; ".join(al.notes)
    verdict = "yes" if p95 < SKEW_OK_US else "no"
    return Answer("Q6", QUESTIONS[5][1], True,
                  f"{verdict}: step end skew median {_fmt(med, ' µs')}, p95 {_fmt(p95, ' µs')}, "
                  f"max {_fmt(mx, ' µs')} "
                  f"({worst['name']}, last rank {worst['last_rank']})",
                  f"{s.height} steps matched across {len(a.rops)} ranks; clock alignment residual "
                  f"{_fmt(al.residual_us, ' µs', 2)} ({'ok' if al.alignment_ok else 'NOT reliable'}); {note}; "
                  f"'yes' needs a p95 end skew below {SKEW_OK_US:g} µs", _files(a))


def q7(a: CaptureAnalysis) -> Answer:
    if len(a.rops) < 2:
        return Answer("Q7", QUESTIONS[6][1], False, "not answerable from this capture",
                      "only one rank's trace was captured", _files(a))
    sr = a.slow_rank
    if sr.get("slow_stage") is not None or a.stages.height:
        # pipeline stages: the per-stage view (GPU time per step per stage) judges them, peers or not
        fixed = f"rank {sr['slow_rank']}" if sr.get("slow_rank") is not None else "no fixed slow rank"
        peers = f"; among ranks of one stage: {fixed}" if a.collective_skew.height or a.step_skew.height else ""
        st = sr.get("stage") or {}
        ans = (f"yes: pipeline stage {sr['slow_stage']} (rank {st.get('ranks')}) holds the pipeline back in steps "
               f"{', '.join(f'{x}–{y}' for x, y in st.get('stretches', []))}, {st.get('ratio', float('nan')):.1f}× "
               f"the other stage's GPU time per step" if sr.get("slow_stage") is not None else "no slow pipeline stage")
        ev = sr.get("stage_evidence", "") + (f" | {sr.get('evidence')}" if sr.get("evidence") else "")
        return Answer("Q7", QUESTIONS[6][1], True, ans + peers, ev, _files(a))
    if a.collective_skew.height == 0 and a.step_skew.height == 0:
        pp = {r.trace.identity.pp for r in a.rops} - {None}
        why = ("every pipeline stage has a single rank: there is no peer in the same stage to be slower than "
               "(stage imbalance shows as bubbles in the PP table)" if len(pp) > 1
               else "no collective or step matched across ranks")
        return Answer("Q7", QUESTIONS[6][1], False, "not answerable from this capture", why, _files(a))
    ans = f"yes: rank {sr['slow_rank']}" if sr.get("slow_rank") is not None else "no fixed slow rank"
    return Answer("Q7", QUESTIONS[6][1], True, ans, sr.get("evidence", ""), _files(a))


def q8_from_counts(ec: ExpertCounts, source: str) -> Answer:
    """Q8 from the engine's expert-token counts (``analyse.trace.experts``): per layer max/mean tokens per expert,
    the imbalance ratio and the hot experts."""
    t = expert_imbalance(ec)
    t = t.filter(pl.col("tokens") > 0)
    if t.height == 0:
        return Answer("Q8", QUESTIONS[7][1], False, "not answerable from this capture",
                      f"the expert-distribution record ({ec.mode}) holds no routed token: no MoE forward ran while it "
                      "recorded", source)
    worst = t.sort("imbalance", descending=True).row(0, named=True)
    bad = t.filter(pl.col("imbalance") >= IMBALANCED_RATIO)
    verdict = (f"yes: {bad.height} of {t.height} MoE layers have max/mean ≥ {IMBALANCED_RATIO:g}" if bad.height
               else f"no: every MoE layer's max/mean is below {IMBALANCED_RATIO:g}")
    per_layer = "; ".join(f"layer {r['layer']}: max {r['max_tokens']} / mean {r['mean_tokens']:.1f} = "
                          f"{r['imbalance']:.2f}, hot {r['hot_experts'] or '-'}, idle {r['idle_experts']}"
                          for r in t.head(8).iter_rows(named=True))
    more = f" (+{t.height - 8} more layers in the table)" if t.height > 8 else ""
    ans = (f"{verdict}; worst layer {worst['layer']}: the hottest expert took {worst['top_share_pct']:.1f}% of its "
           f"{worst['tokens']} token assignments ({worst['imbalance']:.2f}× the mean of {worst['mean_tokens']:.1f})")
    ev = (f"from expert counts: SGLang's expert-distribution recorder (mode {ec.mode}, ranks {ec.ranks}, "
          f"{ec.passes} forward passes with routed tokens, {ec.experts} experts × {ec.layers} layers; a token counts "
          f"once per expert it is routed to); hot = ≥ {HOT_FACTOR:g}× the layer mean. {per_layer}{more}"
          + ("; " + "; ".join(ec.notes) if ec.notes else ""))
    return Answer("Q8", QUESTIONS[7][1], True, ans, ev, source)


def q8(a: CaptureAnalysis, experts: ExpertCounts | None = None) -> Answer:
    """From the engine's expert counts when the capture has them (``experts``); else the kernel-time proxy (MoE
    GEMM time per rank), which says so."""
    if experts is not None:
        return q8_from_counts(experts, ", ".join(experts.files))
    moe = a.breakdown.filter(pl.col("cls") == "moe") if a.breakdown.height else a.breakdown
    if moe.height == 0:
        return Answer("Q8", QUESTIONS[7][1], False, "not answerable from this capture",
                      "no expert counts recorded with this capture and no MoE kernels (gate / dispatch / grouped GEMM "
                      "/ combine) in the trace — a dense model, unclassified MoE kernels (extend the taxonomy rules), "
                      "or an engine started without its expert-distribution recorder", _files(a))
    per_rank = []
    for r in a.rops:
        o = r.ops.filter((pl.col("cls") == "moe") & (pl.col("subclass") == "grouped_gemm"))
        if o.height == 0:
            o = r.ops.filter(pl.col("cls") == "moe")
        per_rank.append((r.rank, float(o["dur_ns"].sum()) / 1e6))
    vals = [v for _, v in per_rank]
    mean = sum(vals) / len(vals) if vals else 0
    ratio = max(vals) / mean if mean else None
    slowest = max(per_rank, key=lambda x: x[1])[0] if per_rank else None
    if len(per_rank) < 2:
        return Answer("Q8", QUESTIONS[7][1], False, "not answerable from this capture",
                      f"MoE kernels present ({sum(vals):.2f} ms) but only one rank and no expert counts recorded: "
                      "per-expert token counts are not in Kineto traces and a single rank gives no cross-rank "
                      "comparison (start the engine with its expert-distribution recorder)", _files(a))
    verdict = "likely imbalanced" if ratio and ratio >= IMBALANCED_RATIO else "no strong imbalance visible"
    return Answer("Q8", QUESTIONS[7][1], True,
                  f"{verdict}: per-rank MoE GEMM time max/mean = {_fmt(ratio, '', 2)} (slowest rank {slowest})",
                  "from the kernel-time proxy (no expert counts were recorded with this capture): MoE GEMM time per "
                  "rank; per-expert token counts are not in Kineto traces (start the engine with its "
                  "expert-distribution recorder for exact counts)", _files(a))


def q9(a: CaptureAnalysis) -> Answer:
    ops = pl.concat([r.ops.filter(pl.col("cls") == "attention").select("subclass", "dur_ns") for r in a.rops],
                    how="vertical_relaxed") if a.rops else pl.DataFrame()
    if ops.height == 0 or ops.filter(pl.col("subclass") == "indexer").height == 0:
        return Answer("Q9", QUESTIONS[8][1], False, "not answerable from this capture",
                      "no NSA/DSA indexer kernels (e.g. *mqa_logits*, *indexer*) in the trace — the model has no "
                      "sparse-attention indexer or its kernels are unclassified", _files(a))
    by = {k: v / 1e6 for k, v in ops.group_by("subclass").agg(pl.col("dur_ns").sum()).iter_rows()}
    idx, sparse, dense = by.get("indexer", 0.0), by.get("sparse", 0.0), by.get("attention", 0.0)
    attn = sparse if sparse else dense
    total = idx + attn
    return Answer("Q9", QUESTIONS[8][1], True,
                  f"indexer {idx:.2f} ms = {100 * idx / total:.1f}% of indexer+attention ({idx / attn:.2f}× the "
                  f"attention it serves)" if attn else f"indexer {idx:.2f} ms, no attention kernels found",
                  f"attention subclasses: indexer {idx:.2f} ms, sparse {sparse:.2f} ms, other attention {dense:.2f} ms "
                  "(all ranks)", _files(a))


def _q10_clock(clock: OneClock) -> tuple[str, str] | None:
    """Q10 from one clock (client chunk arrivals + the trace's steps): (answer, evidence), or None when no
    client-observed stall overlapped a prefill step."""
    st = stall_summary(clock)
    pre = clock.prefill_stalls
    if st["p99_itl_ms"] is None or pre.height == 0:
        return None
    worst = pre.sort("gap_ms", descending=True).row(0, named=True)
    dec = clock.steps.filter(pl.col("prefill_tokens").fill_null(0) == 0)
    dec_ms = float(dec["dur_ms"].median()) if dec.height else None
    ratio = f" ({worst['longest_step_ms'] / dec_ms:.0f}× the median decode step of {dec_ms:.1f} ms)" \
        if dec_ms and worst["longest_step_ms"] else ""
    ans = (f"{pre['request_id'].n_unique()} decode stream(s) stalled up to {worst['gap_ms']:.1f} ms between tokens "
           f"(steady-state P99 ITL {st['p99_itl_ms']:.1f} ms) while the engine ran the step '{worst['longest_step']}'"
           f"{ratio}: " + ("the prefill ran in the same engine step as their decodes, so every decode token of that "
                           "step waited for the whole prefill" if "decode" in worst["longest_step"] else
                           "the engine ran the prefill as a step of its own, and their next decode step waited for it"))
    where = "on the host's wall clock" if clock.clock.get("shared_clock", True) else \
        f"on the client's clock: {clock.clock.get('method', '')}"
    ev = (f"one clock (client chunk arrivals and trace steps {where}; "
          f"{clock.clock.get('bound', '')}); {st['stalls']} gaps above the P99 ({st['steady_basis']}, "
          f"{st['steady_gaps']} gaps) overlapped traced steps, {pre.height} of them a prefill step; "
          f"worst: {worst['request_id']} chunk {worst['chunk']}, steps {worst['steps']}")
    if st["outside_trace"]:
        ev += (f"; {st['outside_trace']} more gaps above the P99 (up to {st['outside_worst_ms']:.0f} ms) fell outside "
               "the traced steps (the profiler starting or writing its trace): not attributable")
    return ans, ev


def q10(a: CaptureAnalysis, clock: OneClock | None = None) -> Answer:
    """From the GPU kernels (decode steps that followed prefill work) and, with ``clock`` (the case's client chunk
    arrivals joined with its trace steps, ``analyse.trace.stalls.one_clock``), from the client-observed stalls and
    the steps that overlapped them — which also answers it for a trace without GPU kernels (vLLM on CPU)."""
    it = a.interference
    from_clock = _q10_clock(clock) if clock is not None else None
    if it.height == 0 or it.filter(pl.col("prefill_between_ms") > 0).height == 0:
        if from_clock is not None:
            return Answer("Q10", QUESTIONS[9][1], True, from_clock[0], from_clock[1], _files(a))
        why = ("no prefill work ran between decode steps in the captured windows (capture the mixed scenario: "
               "decode background + injected long prefill)")
        if clock is not None and not clock.clock.get("joined", True):
            why += f"; client and trace not joined: {clock.clock.get('method', '')}"
        elif clock is not None:
            why += f"; no client-observed stall overlapped a prefill step ({len(clock.steps)} traced steps)"
        return Answer("Q10", QUESTIONS[9][1], False, "not answerable from this capture", why, _files(a))
    hit = it.filter(pl.col("prefill_between_ms") > 0).sort("delay_ms", descending=True)
    worst = hit.row(0, named=True)
    streams = a.device_busy["streams"].max() if a.device_busy.height else None
    why = (f"decode step '{worst['name']}' (rank {worst['rank']}) arrived {worst['delay_ms']:.2f} ms later than the "
           f"steady interval of {worst['baseline_ms']:.2f} ms because the prefill ({worst['prefill_windows']}) "
           f"held {_dev(a)} for {worst['prefill_span_ms']:.2f} ms ({worst['prefill_between_ms']:.2f} ms of "
           f"{'ops' if _on_cpu(a) else 'kernels'}) ahead of it")
    if streams == 1:
        why += ("; all work ran on one thread, so the decode ops could not start until the prefill finished" if _on_cpu(a)
                else "; all work ran on one stream, so the decode kernels could not start until the prefill finished")
    ev = (f"{hit.height} decode steps followed prefill work (all ranks); token interval = GPU end − previous decode "
          f"step's GPU end; worst step's launches waited {worst['queued_ms']:.2f} ms from CPU launch to GPU start")
    if from_clock is not None:
        why += f". Client side: {from_clock[0]}"
        ev += f"; {from_clock[1]}"
    return Answer("Q10", QUESTIONS[9][1], True, why, ev, _files(a))


def _no_gpu(a: CaptureAnalysis) -> list[Answer]:
    why = ("the capture holds no GPU kernels (CPU-only run, e.g. vLLM on CPU, or a profiler started without the "
           "CUDA activity): every timeline question needs GPU kernels")
    return [Answer(qid, zh, False, "not answerable from this capture", why, _files(a)) for qid, zh, _ in QUESTIONS]


def truncated_ranks(a: CaptureAnalysis) -> list[str]:
    """One sentence per rank whose trace file was cut mid-write (``meta["truncated"]``, read up to where it ends):
    its file, the events and steps read."""
    out = []
    for r in a.rops:
        t = r.trace.meta.get("truncated")
        if t:
            out.append(f"rank {r.rank}'s trace {r.trace.path.name} is truncated (cut mid-write): analysed up to "
                       f"where it ends, {t.get('events_read', 0)} events and {r.steps_read} of {r.windows.height} steps read, "
                       f"its later steps missing")
    return out


def ten_questions(a: CaptureAnalysis, experts: ExpertCounts | None = None) -> pl.DataFrame:
    """The ten questions as a table: id, question, answerable, answer, evidence, source (trace files).
    ``experts``: the engine's expert counts recorded with this capture (Q8 answers from them)."""
    if sum(r.ops.height for r in a.rops) == 0:
        rows = [asdict(x) for x in _no_gpu(a)]
        if experts is not None:
            rows[7] = asdict(q8(a, experts))
    else:
        rows = [asdict(f(a)) for f in (q1, q2, q3, q4, q5, q6, q7)] + [asdict(q8(a, experts))] + \
            [asdict(f(a)) for f in (q9, q10)]
    cut = truncated_ranks(a)
    if cut:
        note = "; ".join(cut)
        for row in rows:
            if row["answerable"]:        # every answer reads every rank: the cut one's missing end weakens it
                row["evidence"] = f"{row['evidence']}; weakened — {note}"
    en = {q[0]: q[2] for q in QUESTIONS}
    df = pl.DataFrame(rows)
    return df.with_columns(pl.col("id").replace_strict(en, return_dtype=pl.String).alias("question_en")) \
        .select("id", "question", "question_en", "answerable", "answer", "evidence", "source")
