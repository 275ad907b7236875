"""Which kernels to look at: each kernel of a Phase 3 table (or of a Kineto trace) labelled with its suspect
category and ranked per window by its time on the critical path; communication kernels are kept out of ``ncu``."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servelab.analyse.trace.load import load_trace
from servelab.analyse.trace.taxonomy import classify_names
from servelab.analyse.trace.windows import DEFAULT_WINDOW_REGEX, window_kind


class KernelTableError(ValueError):
    """A Phase 3 kernel table that lacks what the ranking needs."""


# ---------------------------------------------------------------- suspects

# (suspect label of docs/method.md#kernel-suspects, regex on the kernel name); first match wins. Ordered so that the specific
# DeepSeek-V4 suspects (indexer, sparse MLA) win over the generic classes.
SUSPECTS: tuple[tuple[str, str], ...] = (
    ("NCCL / communication collective", r"nccl|all_?reduce|all_?gather|reduce_?scatter|alltoall|all_to_all|"
                                        r"cross_device_reduce|custom_?ar|deep_ep|deepep|send_?recv"),
    ("NSA indexer / top-k", r"indexer|mqa_logits|topk_transform|index_score|nsa_.*(topk|index)|lightning_index"),
    ("sparse MLA / attention", r"flash_mla_sparse|sparse_mla|sparse_(prefill|decode|attn)|dsa_|nsa_.*(attn|fwd)"),
    ("MoE gate", r"topk_?gating|moe_?gate|grouped_topk|topk_softmax|topk_sigmoid|router|noaux_tc"),
    ("MoE dispatch", r"moe_align|count_and_sort_expert|ep_scatter|moe_permute|permute_.*expert|expand_input|dispatch"),
    ("MoE combine", r"moe_sum|ep_gather|unpermute|finalize_moe|combine"),
    ("MoE grouped GEMM", r"fused_moe|grouped_gemm|group_gemm|m_grouped|masked_gemm|cutlass_moe|moe_gemm|fused_experts"),
    ("MLA / attention", r"flash_?attn|fmha|flash_mla|flashmla|mla|attention|attn|sdpa|BatchPrefill|BatchDecode|"
                        r"flash_fwd|flash_decode|unified_attention"),
    ("FP8 quant / dequant / scale packing", r"dequant|quant|scaled_fp8|fp8|cvt_fp|nvfp4|mxfp|per_token_group|"
                                            r"blockwise_scale"),
    ("dense GEMM", r"gemm|gemv|matmul|nvjet|cublas|cutlass|xmma|wgmma|sm\d+_.*_(tn|nt|nn|tt)|deep_gemm|scaled_mm|"
                   r"splitKreduce"),
    ("RMSNorm / RoPE / KV-store small op", r"rms_?norm|layer_?norm|rotary|rope|reshape_and_cache|store_kv|kv_?cache|"
                                          r"set_mla_kv|elementwise|vectorized|reduce_kernel"),
)
COMM_SUSPECT = SUSPECTS[0][0]
SMALL_KERNEL_US = 10.0     # mean duration under which a frequently launched kernel is a launch-overhead suspect


def suspect_of(name: str) -> str:
    """The suspect category (``docs/method.md#kernel-suspects``) a kernel name falls in (``other`` when none)."""
    for label, rx in SUSPECTS:
        if re.search(rx, name or "", re.IGNORECASE):
            return label
    return "other"


def function_base(name: str) -> str:
    """The kernel's function name as ``ncu --kernel-name-base function`` sees it: no return type, template
    arguments, parameters or namespace (``void at::native::(anonymous namespace)::foo<4>(int)`` → ``foo``)."""
    s = (name or "").strip().replace("(anonymous namespace)", "anonymous_namespace")
    if s.startswith("void "):
        s = s[5:]
    depth, out = 0, []
    for ch in s:
        if ch in "<{[":
            depth += 1
        elif ch in ">}]":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(ch)
    base = "".join(out).strip().split("::")[-1].strip()
    return base.split()[-1] if base.split() else (name or "")


# ---------------------------------------------------------------- ranking the Phase 3 table

def _as_pandas(frame: Any) -> pd.DataFrame:
    if isinstance(frame, pd.DataFrame):
        return frame.copy()
    if hasattr(frame, "to_pandas"):
        return frame.to_pandas()
    raise KernelTableError(f"kernel table must be a pandas or polars DataFrame, got {type(frame).__name__}")


def rank_kernels(frame: Any, window: str | None = None) -> pd.DataFrame:
    """Every kernel of a Phase 3 table ranked by its time on the critical path, with its suspect label.

    Columns: ``rank, window, name, function, class, suspect, count, total_dur_ms, mean_dur_us, share_pct``
    (of the window's summed kernel time), ``ranked_by`` (``exposed_dur_ns`` when the table has it, else
    ``total_dur_ns``), ``small_kernel`` (mean < 10 µs and launched ≥ 100 times: launch overhead / fusion
    suspect), ``ncu_suitable`` and ``why_not``.
    """
    df = _as_pandas(frame)
    missing = [c for c in ("name", "total_dur_ns", "count") if c not in df.columns]
    if missing:
        raise KernelTableError(f"kernel table lacks column(s) {missing}; it has {list(df.columns)}. Needed: name, "
                               f"total_dur_ns (ns), count; optional: class, window, exposed_dur_ns")
    if "window" not in df.columns:
        df["window"] = "whole trace"
    if window is not None:
        df = df[df["window"] == window]
        if df.empty:
            raise KernelTableError(f"kernel table has no rows for window '{window}'")
    if "class" not in df.columns:
        cls = classify_names(df["name"].astype(str).tolist()).to_pandas()
        df["class"] = cls["cls"].to_numpy()
    key = "exposed_dur_ns" if "exposed_dur_ns" in df.columns else "total_dur_ns"
    df = df.groupby(["window", "name", "class"], as_index=False, observed=True).agg(
        total_dur_ns=("total_dur_ns", "sum"), count=("count", "sum"), key_ns=(key, "sum"))
    totals = df.groupby("window")["total_dur_ns"].transform("sum")
    out = pd.DataFrame({
        "window": df["window"], "name": df["name"], "function": df["name"].map(function_base),
        "class": df["class"], "suspect": df["name"].map(suspect_of), "count": df["count"].astype(int),
        "total_dur_ms": df["total_dur_ns"] / 1e6,
        "mean_dur_us": df["total_dur_ns"] / df["count"].clip(lower=1) / 1e3,
        "share_pct": 100.0 * df["total_dur_ns"] / totals.where(totals > 0, np.nan),
        "critical_ms": df["key_ns"] / 1e6, "ranked_by": key,
    })
    out["small_kernel"] = (out["mean_dur_us"] < SMALL_KERNEL_US) & (out["count"] >= 100)
    comm = (out["suspect"] == COMM_SUSPECT) | (out["class"] == "communication")
    out["ncu_suitable"] = ~comm
    out["why_not"] = np.where(comm, "communication kernel: a collective under ncu waits on its peers; "
                                    "measure it in Phase 5 (nccl-tests at the model's message sizes)", "")
    out = out.sort_values(["window", "critical_ms"], ascending=[True, False])
    out["rank"] = out.groupby("window").cumcount() + 1
    return out[["rank", "window", "name", "function", "class", "suspect", "count", "total_dur_ms", "mean_dur_us",
                "share_pct", "critical_ms", "ranked_by", "small_kernel", "ncu_suitable", "why_not"]].reset_index(drop=True)


def top_kernels(frame: Any, n: int = 3, window: str | None = None, include_comm: bool = False) -> pd.DataFrame:
    """The top ``n`` (1–3 in ``docs/method.md#kernels``) kernels per window that ``ncu`` should look at."""
    if not 1 <= n <= 10:
        raise ValueError(f"n must be between 1 and 10 (the method picks 1 to 3), got {n}")
    ranked = rank_kernels(frame, window)
    if not include_comm:
        ranked = ranked[ranked["ncu_suitable"]]
    return ranked.groupby("window", group_keys=False).head(n).reset_index(drop=True)


def kernel_table_from_trace(path: str | Path, window_regex: str | None = None) -> pd.DataFrame:
    """A Phase 3-shaped kernel table from one Kineto trace: GPU kernels grouped by window kind and name.

    Windows are the GPU-side user annotations (``gpu_user_annotation``) whose name matches ``window_regex``
    (default: Phase 3's, :data:`servelab.analyse.trace.windows.DEFAULT_WINDOW_REGEX` — SGLang ``step[EXTEND ...]``,
    ``*_step_N``, ``ProfilerStep#N``); a kernel belongs to the window that contains its start, and the window's
    kind (``prefill``, ``decode``, ``mixed`` ...) is Phase 3's :func:`servelab.analyse.trace.windows.window_kind`.
    Kernels outside every window form ``unannotated``. Durations in ns.
    """
    rx = re.compile(window_regex or DEFAULT_WINDOW_REGEX)
    ev = load_trace(path, cache=False).events.to_pandas()
    cat = ev["cat"].astype(str)
    ker = ev[cat == "kernel"]
    ann = ev[(cat == "gpu_user_annotation") & ev["name"].astype(str).map(lambda n: bool(rx.search(n)))]
    ann = ann.sort_values("ts_ns")
    a_start = ann["ts_ns"].to_numpy(dtype="int64")
    a_end = a_start + ann["dur_ns"].to_numpy(dtype="int64")
    kinds = np.array([window_kind(str(n)) for n in ann["name"]], dtype=object)
    k_start = ker["ts_ns"].to_numpy(dtype="int64")
    idx = np.searchsorted(a_start, k_start, side="right") - 1
    window = np.array(["unannotated"] * len(ker), dtype=object)
    ok = idx >= 0
    ok[ok] = k_start[ok] < a_end[idx[ok]]
    window[ok] = kinds[idx[ok]]
    table = pd.DataFrame({"name": ker["name"].astype(str).to_numpy(), "window": window,
                          "dur_ns": ker["dur_ns"].to_numpy(dtype="int64")})
    out = table.groupby(["window", "name"], as_index=False).agg(total_dur_ns=("dur_ns", "sum"),
                                                                count=("dur_ns", "size"))
    out["class"] = classify_names(out["name"].tolist()).to_pandas()["cls"].to_numpy()
    return out[["name", "class", "total_dur_ns", "count", "window"]]


def load_kernel_table(source: str | Path) -> pd.DataFrame:
    """A kernel table from a CSV/Parquet written by Phase 3, or computed from a Kineto trace file."""
    p = Path(source)
    if not p.exists():
        raise KernelTableError(f"{p}: kernel table or trace not found")
    if p.suffix == ".csv":
        return pd.read_csv(p)
    if p.suffix == ".parquet":
        return pd.read_parquet(p)
    if p.name.endswith((".json", ".json.gz")):
        return kernel_table_from_trace(p)
    raise KernelTableError(f"{p}: expected a .csv/.parquet kernel table or a .json(.gz) Kineto trace")
