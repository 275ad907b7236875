"""Phase 6 — kernel deep-dive: the top kernels of a Phase 3 capture, ``ncu`` commands, ``ncu`` CSV import, roofline.

The seeds (§11, and §3 of the rendered plan): pick from the timeline the 1–3 kernels that contribute most to the
critical path, then use Nsight Compute on a *small reproduction* — never a long ``ncu`` over the full service
(its overhead is very high and the report huge). Analyse SM and tensor-core utilisation, DRAM throughput and
L2 hit rate, occupancy, register and shared-memory pressure, warp stall reasons, kernel shape and batch/token
count, and how many small kernels are launched. NCCL kernels are listed (their share matters) but not sent to
``ncu``: a collective serialised under ``ncu`` waits on its peers; Phase 5 measures communication.

Input from Phase 3 (the trace analyser writes it; any pandas or polars frame with these columns):

=================  ======  ===================================================================================
name               str     kernel name as in the trace
class              str     kernel class (``gemm``, ``attention``, ``moe``, ``communication``, ...); optional,
                           filled from :mod:`servelab.analyse.trace.taxonomy` when absent
total_dur_ns       int     summed GPU duration of the kernel in the window, ns
count              int     launches in the window
window             str     window kind (``prefill``, ``decode``, ``mixed``, ``whole trace``); optional
exposed_dur_ns     int     optional: time of the kernel on the critical path (not overlapped); when present
                           the ranking uses it instead of ``total_dur_ns``
=================  ======  ===================================================================================

``ncu`` CSV layouts read by :func:`read_ncu_csv` (documented in the Nsight Compute CLI guide,
https://docs.nvidia.com/nsight-compute/NsightComputeCli/index.html, "Console Output" / ``--csv`` /
``--page``; checked against a real ``ncu 2025.3`` capture on an H200, ``data/samples/ncu/``):

- **details** (the default page; also what ``--metrics`` alone prints): one row per kernel × metric with the
  columns ``"ID","Process ID","Process Name","Host Name","Kernel Name",...,"Section Name","Metric Name",
  "Metric Unit","Metric Value"`` (newer releases add ``"Block Size","Grid Size","Device","CC"`` and rule
  columns ``"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"``; rule rows
  carry an empty metric name and are returned separately as ncu's own advice);
- **raw** (``--page raw``): one row per kernel; the header names the identity columns then one column per
  metric id (``dram__bytes_read.sum`` ...); the second row holds the units (identity cells empty).

Both may be preceded by ``==PROF==`` lines and the application's own output. Values use the en-US thousands
separator (``1,215,000,000.00``); ``n/a`` is missing. Units are scaled by SI factors of 1000 unless the
capture used ``--print-units base`` (the commands built here do); :func:`to_base_unit` undoes the scaling.

Roofline peaks (:data:`GPU_PEAKS`) are data with their source: the H200 spec sheet, and next to it the best
rates observed in the shipped H200 capture (bf16 GEMM ≈ 805 TFLOP/s, elementwise ≈ 3.7 TB/s of DRAM traffic).
"""
from __future__ import annotations

import csv
import io
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go


class NcuFormatError(ValueError):
    """An ``ncu`` CSV file whose layout is not one of the documented ones (details, raw)."""


class KernelTableError(ValueError):
    """A Phase 3 kernel table that lacks what the ranking needs."""


# ---------------------------------------------------------------- seeds' suspects

# (suspect label of the seeds §11, regex on the kernel name); first match wins. Ordered so that the specific
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
    """The seeds' §11 suspect category a kernel name falls in (``other`` when none)."""
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
    """Every kernel of a Phase 3 table ranked by its time on the critical path, with the seeds' suspect label.

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
        from servelab.analyse.trace.taxonomy import classify_names
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
    """The top ``n`` (1–3 in the seeds) kernels per window that ``ncu`` should look at."""
    if not 1 <= n <= 10:
        raise ValueError(f"n must be between 1 and 10 (the seeds pick 1 to 3), got {n}")
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
    from servelab.analyse.trace.load import load_trace
    from servelab.analyse.trace.taxonomy import classify_names
    from servelab.analyse.trace.windows import DEFAULT_WINDOW_REGEX, window_kind
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


# ---------------------------------------------------------------- the ncu command builder

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats",
            "SchedulerStats", "ComputeWorkloadAnalysis")
# counters for the roofline (flops by precision from SASS instruction counts, DRAM bytes, time) and the tensor pipe
ROOFLINE_METRICS = (
    "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
    "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum", "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum",
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum", "smsp__sass_thread_inst_executed_op_hadd_pred_on.sum",
    "smsp__sass_thread_inst_executed_op_hmul_pred_on.sum", "smsp__sass_thread_inst_executed_op_hfma_pred_on.sum",
    "smsp__sass_thread_inst_executed_op_dadd_pred_on.sum", "smsp__sass_thread_inst_executed_op_dmul_pred_on.sum",
    "smsp__sass_thread_inst_executed_op_dfma_pred_on.sum", "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
    "sm__ops_path_tensor_src_fp16_dst_fp32.sum", "sm__ops_path_tensor_src_fp8.sum",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
)


@dataclass
class NcuSpec:
    """What one ``ncu`` run collects. Defaults follow the seeds: few launches of one kernel, the sections the
    seeds' §11 questions need, the roofline counters, and clocks left alone (``--clock-control none``: the
    device machines' rule, and the GPU keeps the clocks the service would see)."""
    kernel_regex: str = ""                 # --kernel-name regex:<...> (matched against --kernel-name-base)
    kernel_name_base: str = "function"     # function | demangled | mangled
    launch_skip: int = 0                   # matching launches to skip first (past warm-up / graph capture)
    launch_count: int = 1                  # matching launches to profile
    sections: tuple[str, ...] = SECTIONS
    metrics: tuple[str, ...] = ROOFLINE_METRICS
    target_processes: str = "all"          # all: also the engine's spawned worker processes
    profile_from_start: bool = True        # False: profile only between cudaProfilerStart/Stop in the program
    clock_control: str | None = "none"     # none | base | None (= ncu's default, which locks base clocks)
    cache_control: str | None = None       # all (flush caches between replays, ncu default) | none
    replay_mode: str | None = None         # kernel (default) | application | range | app-range
    export: str = ""                       # -o <file>: also write the .ncu-rep report
    force_overwrite: bool = True
    csv: bool = True                       # print CSV on stdout
    page: str | None = "raw"               # raw | details | None
    print_units_base: bool = True          # values in base units (byte, nsecond): no auto-scaling
    extra: tuple[str, ...] = ()


def ncu_command(app_argv: Sequence[str], spec: NcuSpec | None = None, ncu: str = "ncu") -> list[str]:
    """The ``ncu`` argv that profiles ``app_argv`` (the small reproduction) according to ``spec``."""
    spec = spec or NcuSpec()
    if not app_argv:
        raise ValueError("ncu_command needs the reproduction's argv (the program ncu launches)")
    if spec.launch_count < 1 or spec.launch_skip < 0:
        raise ValueError(f"launch_count must be ≥ 1 and launch_skip ≥ 0, got {spec.launch_count}/{spec.launch_skip}")
    for key, allowed in (("kernel_name_base", ("function", "demangled", "mangled")),
                         ("clock_control", ("none", "base", None)), ("cache_control", ("all", "none", None)),
                         ("replay_mode", ("kernel", "application", "range", "app-range", None)),
                         ("page", ("raw", "details", "source", "session", None)),
                         ("target_processes", ("all", "application-only"))):
        if getattr(spec, key) not in allowed:
            raise ValueError(f"NcuSpec.{key} must be one of {allowed}, got {getattr(spec, key)!r}")
    if spec.kernel_regex:
        re.compile(spec.kernel_regex)
    argv = [ncu, "--target-processes", spec.target_processes]
    if spec.kernel_regex:
        argv += ["--kernel-name-base", spec.kernel_name_base, "--kernel-name", f"regex:{spec.kernel_regex}"]
    argv += ["--launch-skip", str(spec.launch_skip), "--launch-count", str(spec.launch_count)]
    if not spec.profile_from_start:
        argv += ["--profile-from-start", "off"]
    for s in spec.sections:
        argv += ["--section", s]
    if spec.metrics:
        argv += ["--metrics", ",".join(spec.metrics)]
    if spec.clock_control:
        argv += ["--clock-control", spec.clock_control]
    if spec.cache_control:
        argv += ["--cache-control", spec.cache_control]
    if spec.replay_mode:
        argv += ["--replay-mode", spec.replay_mode]
    if spec.export:
        argv += ["--export", spec.export]
        if spec.force_overwrite:
            argv += ["--force-overwrite"]
    if spec.csv:
        argv += ["--csv"]
        if spec.page:
            argv += ["--page", spec.page]
        if spec.print_units_base:
            argv += ["--print-units", "base"]
    argv += list(spec.extra)
    return argv + [str(a) for a in app_argv]


def ncu_import_command(report: str, page: str = "raw", ncu: str = "ncu") -> list[str]:
    """Re-print a saved ``.ncu-rep`` as CSV (``ncu --import R --csv --page raw|details --print-units base``)."""
    if page not in ("raw", "details"):
        raise ValueError(f"page must be raw or details, got {page!r}")
    return [ncu, "--import", report, "--csv", "--page", page, "--print-units", "base"]


def default_repro_argv(target: Any, batch_size: int = 1, input_len: int = 1024, output_len: int = 8) -> list[str]:
    """A small single-batch reproduction for the target's engine (what ``ncu`` wraps).

    SGLang: ``sglang.bench_one_batch`` (no server, one static batch); vLLM: ``vllm bench latency``; llama.cpp:
    ``llama-bench``. The TP/PP degree of the target is kept so the kernels see the service's shapes.
    """
    la = dict(getattr(target, "launch", {}) or {})
    model = getattr(target, "model", "MODEL")
    tp, pp = int(la.get("tp_size", 1)), int(la.get("pp_size", 1))
    if target.engine == "sglang":
        argv = [la.get("python", "python3"), "-m", "sglang.bench_one_batch", "--model-path", model,
                "--batch-size", str(batch_size), "--input-len", str(input_len), "--output-len", str(output_len),
                "--tp-size", str(tp)]
        if la.get("trust_remote_code"):
            argv.append("--trust-remote-code")
        return argv
    if target.engine == "vllm":
        argv = [la.get("python", "python3"), "-m", "vllm.entrypoints.cli.main", "bench", "latency", "--model", model,
                "--batch-size", str(batch_size), "--input-len", str(input_len), "--output-len", str(output_len),
                "--tensor-parallel-size", str(tp), "--num-iters-warmup", "1", "--num-iters", "1"]
        if pp > 1:
            argv += ["--pipeline-parallel-size", str(pp)]
        return argv
    return ["llama-bench", "-m", model, "-p", str(input_len), "-n", str(output_len), "-b", str(max(batch_size, 1)),
            "-r", "1"]


def planned_ncu_commands(top: pd.DataFrame, app_argv: Sequence[str], launch_skip: int = 20, launch_count: int = 3,
                         export_dir: str = "ncu") -> pd.DataFrame:
    """One ``ncu`` command per top kernel (regex on its function name), skipping warm-up launches.

    Columns: ``window, rank, function, argv`` (list) and ``command`` (display string).
    """
    rows = []
    for _, k in top.iterrows():
        fn = k["function"] or function_base(k["name"])
        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{k['window']}_{k['rank']}_{fn}")[:80].strip("_")
        spec = NcuSpec(kernel_regex=re.escape(fn), launch_skip=launch_skip, launch_count=launch_count,
                       export=f"{export_dir}/{slug}")
        argv = ncu_command(app_argv, spec)
        rows.append({"window": k["window"], "rank": int(k["rank"]), "function": fn, "argv": argv,
                     "command": shlex.join(argv)})
    return pd.DataFrame(rows, columns=["window", "rank", "function", "argv", "command"])


# ---------------------------------------------------------------- the ncu CSV import

IDENTITY_COLUMNS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Kernel Time", "Context",
                    "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name")
RULE_COLUMNS = ("Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type", "Estimated Speedup")


@dataclass
class NcuReport:
    """A parsed ``ncu`` CSV: tidy metrics, the kernels, ncu's own rule advice, and what preceded the table."""
    path: str
    layout: str                      # details | raw
    metrics: pd.DataFrame            # kernel, id, section, metric, unit, value, value_base, unit_base
    kernels: pd.DataFrame            # id, kernel, function, block_size, grid_size, device, cc, process
    rules: pd.DataFrame = field(default_factory=pd.DataFrame)   # id, kernel, section, rule, type, description, speedup
    notes: list[str] = field(default_factory=list)              # ==PROF== / ==WARNING== lines


def parse_number(text: Any) -> float:
    """An ncu value as float: en-US thousands separators removed; ``n/a``/empty → NaN; non-numbers → NaN."""
    if text is None:
        return math.nan
    s = str(text).strip().replace(",", "")
    if s in ("", "n/a", "N/A", "nan", "-"):
        return math.nan
    try:
        return float(s)
    except ValueError:
        return math.nan


_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "k": 1e3}


def to_base_unit(value: float, unit: str) -> tuple[float, str]:
    """Undo ncu's SI auto-scaling (factor 1000; ncu 2025.3 writes ``ns``/``us``/``ms``, ``Kbyte``, ``Gbyte/s``,
    ``Ghz``, ``Kbyte/block``; older releases ``nsecond``/``usecond``/``byte/second``):
    ``(2.0, "Mbyte")`` → ``(2e6, "byte")``, ``(3.0, "us")`` → ``(3000, "ns")``, ``(1.2, "Tbyte/s")`` →
    ``(1.2e12, "byte/s")``, ``(1.98, "Ghz")`` → ``(1.98e9, "hz")``, ``(213.19, "Kbyte/block")`` → ``(213190, "byte/block")``.

    Time is expressed in nanoseconds (ncu's own base for ``gpu__time_duration``); other units unchanged.
    """
    u = (unit or "").strip()
    if not u or math.isnan(value):
        return value, u
    time_div = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, None: 1.0}
    m = re.fullmatch(r"([KMGTPk]?)byte(?:/(?:(n|u|m)?s(?:econd)?)|(/block))?", u)
    if m:
        v = value * _PREFIX[m.group(1)]
        if m.group(3):
            return v, "byte/block"
        if u.endswith(("/s", "second")):
            return v / time_div[m.group(2)], "byte/s"
        return v, "byte"
    m = re.fullmatch(r"(n|u|m|)s(?:econd)?", u)
    if m:
        return value * {"n": 1.0, "u": 1e3, "m": 1e6, "": 1e9}[m.group(1)], "ns"
    m = re.fullmatch(r"([KMGT]?)hz", u, re.IGNORECASE)
    if m:
        return value * _PREFIX[m.group(1).upper() if m.group(1) else ""], "hz"
    m = re.fullmatch(r"cycle/(n|u|m|)s(?:econd)?", u)
    if m:
        return value / time_div[m.group(1)], "hz"
    m = re.fullmatch(r"([KMGT])(inst|cycle|warp|block|thread|sector|request)(.*)", u)
    if m:
        return value * _PREFIX[m.group(1)], m.group(2) + m.group(3)
    return value, u


def _split_preamble(text: str, path: str) -> tuple[list[str], str]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith('"ID"'):
            return [ln for ln in lines[:i] if ln.startswith("==")], "\n".join(lines[i:])
    errors = [ln for ln in lines if ln.startswith("==ERROR==")]
    hint = f"; ncu said: {' | '.join(errors[:3])}" if errors else ""
    raise NcuFormatError(f"{path}: no ncu CSV header (a line starting with '\"ID\"') found{hint}. Expected the output "
                         f"of `ncu --csv` (details page) or `ncu --csv --page raw`")


def read_ncu_csv(path_or_text: str | Path, text: str | None = None) -> NcuReport:
    """Read an ``ncu --csv`` output (details or raw page) into an :class:`NcuReport` (tidy metrics frame).

    ``path_or_text`` is a file path; pass ``text`` to parse a string (then the first argument names it in errors).
    """
    where = str(path_or_text)
    if text is None:
        p = Path(path_or_text)
        if not p.is_file():
            raise NcuFormatError(f"{p}: no such ncu CSV file")
        text = p.read_text(errors="replace")
    notes, body = _split_preamble(text, where)
    # program output after the table (ncu prints ==PROF== Disconnected...) is dropped
    body_lines = [ln for ln in body.splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(body_lines))))
    header = [h.strip() for h in rows[0]]
    if "Metric Name" in header and "Metric Value" in header:
        return _read_details(where, header, rows[1:], notes)
    if "Kernel Name" in header and len(rows) >= 2 and all(not c.strip() for c in rows[1][:header.index("Kernel Name") + 1]):
        return _read_raw(where, header, rows[1], rows[2:], notes)
    raise NcuFormatError(f"{where}: unknown ncu CSV layout. Header: {header[:16]}{' ...' if len(header) > 16 else ''}. "
                         f"Expected the details page (columns 'Kernel Name', 'Section Name', 'Metric Name', "
                         f"'Metric Unit', 'Metric Value') or the raw page (identity columns then one column per "
                         f"metric, second row = units with empty identity cells)")


def _kernel_rows(records: list[dict[str, str]]) -> pd.DataFrame:
    seen: dict[str, dict[str, Any]] = {}
    for r in records:
        kid = r.get("ID", "")
        if kid not in seen:
            seen[kid] = {"id": int(parse_number(kid)) if not math.isnan(parse_number(kid)) else kid,
                         "kernel": r.get("Kernel Name", ""), "function": function_base(r.get("Kernel Name", "")),
                         "block_size": r.get("Block Size", ""), "grid_size": r.get("Grid Size", ""),
                         "device": r.get("Device", ""), "cc": r.get("CC", ""), "process": r.get("Process Name", ""),
                         "stream": r.get("Stream", "")}
    return pd.DataFrame(list(seen.values()), columns=["id", "kernel", "function", "block_size", "grid_size", "device",
                                                      "cc", "process", "stream"])


def _tidy(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["kernel", "id", "section", "metric", "unit", "value_text"])
    df["value"] = df["value_text"].map(parse_number)
    base = [to_base_unit(v, u) for v, u in zip(df["value"], df["unit"])]
    df["value_base"] = [b[0] for b in base]
    df["unit_base"] = [b[1] for b in base]
    return df


def _read_details(where: str, header: list[str], rows: list[list[str]], notes: list[str]) -> NcuReport:
    for need in ("ID", "Kernel Name", "Metric Unit"):
        if need not in header:
            raise NcuFormatError(f"{where}: details-page CSV without the '{need}' column; header: {header}")
    recs = [dict(zip(header, r)) for r in rows if len(r) >= len(header) - len(RULE_COLUMNS)]
    if not recs:
        raise NcuFormatError(f"{where}: the ncu CSV has a header but no kernel rows (no kernel matched the filter?)")
    tidy, rules = [], []
    for r in recs:
        kid = int(parse_number(r["ID"])) if not math.isnan(parse_number(r["ID"])) else r["ID"]
        if r.get("Metric Name", "").strip():
            tidy.append({"kernel": r["Kernel Name"], "id": kid, "section": r.get("Section Name", ""),
                         "metric": r["Metric Name"], "unit": r.get("Metric Unit", ""),
                         "value_text": r.get("Metric Value", "")})
        if r.get("Rule Name", "").strip():
            rules.append({"id": kid, "kernel": r["Kernel Name"], "section": r.get("Section Name", ""),
                          "rule": r["Rule Name"], "type": r.get("Rule Type", ""),
                          "description": r.get("Rule Description", ""),
                          "speedup_type": r.get("Estimated Speedup Type", ""),
                          "speedup_pct": parse_number(r.get("Estimated Speedup", ""))})
    rules_df = pd.DataFrame(rules, columns=["id", "kernel", "section", "rule", "type", "description", "speedup_type",
                                            "speedup_pct"]).drop_duplicates()
    return NcuReport(where, "details", _tidy(tidy), _kernel_rows(recs), rules_df, notes)


def _read_raw(where: str, header: list[str], units: list[str], rows: list[list[str]], notes: list[str]) -> NcuReport:
    if "ID" not in header:
        raise NcuFormatError(f"{where}: raw-page CSV without the 'ID' column; header: {header[:12]}")
    ident = [i for i, h in enumerate(header) if h in IDENTITY_COLUMNS]
    metric_cols = [i for i in range(len(header)) if i not in ident]
    if not metric_cols:
        raise NcuFormatError(f"{where}: raw-page CSV with no metric columns; header: {header}")
    recs, tidy = [], []
    for r in rows:
        if len(r) != len(header):
            raise NcuFormatError(f"{where}: raw-page row with {len(r)} cells, header has {len(header)}: {r[:5]}")
        rec = dict(zip(header, r))
        recs.append(rec)
        kid = int(parse_number(rec["ID"])) if not math.isnan(parse_number(rec["ID"])) else rec["ID"]
        for i in metric_cols:
            tidy.append({"kernel": rec.get("Kernel Name", ""), "id": kid, "section": "raw", "metric": header[i],
                         "unit": units[i] if i < len(units) else "", "value_text": r[i]})
    if not recs:
        raise NcuFormatError(f"{where}: the ncu CSV has a header but no kernel rows (no kernel matched the filter?)")
    return NcuReport(where, "raw", _tidy(tidy), _kernel_rows(recs), pd.DataFrame(), notes)


# ---------------------------------------------------------------- derived metrics

# quantity → candidates: raw metric ids, or (section, details label). First found wins.
DERIVED: dict[str, tuple[Any, ...]] = {
    "duration_ns": ("gpu__time_duration.sum", ("GPU Speed Of Light Throughput", "Duration")),
    "sm_throughput_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed",
                          ("GPU Speed Of Light Throughput", "Compute (SM) Throughput")),
    "memory_throughput_pct": ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
                              ("GPU Speed Of Light Throughput", "Memory Throughput")),
    "dram_throughput_pct": ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                            "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                            ("GPU Speed Of Light Throughput", "DRAM Throughput")),
    "tensor_pipe_pct": ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
                        "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"),
    "l2_hit_rate_pct": ("lts__t_sector_hit_rate.pct", ("Memory Workload Analysis", "L2 Hit Rate")),
    "l1_hit_rate_pct": ("l1tex__t_sector_hit_rate.pct", ("Memory Workload Analysis", "L1/TEX Hit Rate")),
    "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", ("Occupancy", "Achieved Occupancy")),
    "theoretical_occupancy_pct": ("sm__maximum_warps_per_active_cycle_pct", ("Occupancy", "Theoretical Occupancy")),
    "registers_per_thread": ("launch__registers_per_thread", ("Launch Statistics", "Registers Per Thread")),
    "shared_mem_static_bytes": ("launch__shared_mem_per_block_static",
                                ("Launch Statistics", "Static Shared Memory Per Block")),
    "shared_mem_dynamic_bytes": ("launch__shared_mem_per_block_dynamic",
                                 ("Launch Statistics", "Dynamic Shared Memory Per Block")),
    "block_threads": ("launch__block_size", ("Launch Statistics", "Block Size")),
    "grid_blocks": ("launch__grid_size", ("Launch Statistics", "Grid Size")),
    "dram_bytes": ("dram__bytes.sum",),
    "dram_bytes_read": ("dram__bytes_read.sum",),
    "dram_bytes_write": ("dram__bytes_write.sum",),
}
# SASS thread-instruction counters → flops (an FMA is 2 flops); the ncu roofline section counts the same way
FLOP_COUNTERS: dict[str, tuple[tuple[str, float], ...]] = {
    "fp32": (("smsp__sass_thread_inst_executed_op_fadd_pred_on.sum", 1), ("smsp__sass_thread_inst_executed_op_fmul_pred_on.sum", 1),
             ("smsp__sass_thread_inst_executed_op_ffma_pred_on.sum", 2)),
    "fp16": (("smsp__sass_thread_inst_executed_op_hadd_pred_on.sum", 1), ("smsp__sass_thread_inst_executed_op_hmul_pred_on.sum", 1),
             ("smsp__sass_thread_inst_executed_op_hfma_pred_on.sum", 2)),
    "fp64": (("smsp__sass_thread_inst_executed_op_dadd_pred_on.sum", 1), ("smsp__sass_thread_inst_executed_op_dmul_pred_on.sum", 1),
             ("smsp__sass_thread_inst_executed_op_dfma_pred_on.sum", 2)),
}
# tensor-core work: sm__ops_path_tensor_* count operations (FLOPs, 2 per multiply-add) per source type. Checked on
# the H200 capture: a 4096×4096×6144 bf16 GEMM reads exactly 2·M·N·K; with N = 14336 on 320-wide tiles it reads
# 2·M·14400·K — the counter counts the executed MMA work, tile padding included.
TENSOR_COUNTERS: dict[str, tuple[str, ...]] = {
    "bf16_tensor": ("sm__ops_path_tensor_src_bf16_dst_fp32.sum",),
    "fp16_tensor": ("sm__ops_path_tensor_src_fp16_dst_fp32.sum", "sm__ops_path_tensor_src_fp16_dst_fp16.sum"),
    "fp8_tensor": ("sm__ops_path_tensor_src_fp8.sum",),
}
STALL_RES = (re.compile(r"^smsp__average_warps_issue_stalled_(?P<reason>[a-z_0-9]+?)_per_issue_active\.ratio$"),
             re.compile(r"^smsp__average_warp_latency_issue_stalled_(?P<reason>[a-z_0-9]+?)\.ratio$"),
             re.compile(r"^smsp__pcsamp_warps_issue_stalled_(?P<reason>[a-z_0-9]+?)$"))
# "selected" is the issuing warp itself and "not_issued" a total, not stall reasons
NOT_STALLS = ("selected", "not_issued")


def _lookup(m: pd.DataFrame, candidates: tuple[Any, ...]) -> tuple[float, str]:
    for c in candidates:
        if isinstance(c, tuple):
            hit = m[(m["section"] == c[0]) & (m["metric"] == c[1])]
        else:
            hit = m[m["metric"] == c]
        vals = hit["value_base"].dropna()
        if not vals.empty:
            return float(vals.iloc[0]), c if isinstance(c, str) else f"{c[0]} / {c[1]}"
    return math.nan, ""


def derived_metrics(report: NcuReport) -> pd.DataFrame:
    """One row per profiled kernel launch: the seeds' §11 quantities (units in the column names).

    ``sm_throughput_pct, tensor_pipe_pct, dram_throughput_pct, l2_hit_rate_pct, achieved_occupancy_pct,
    registers_per_thread, shared_mem_*_bytes, duration_ns, dram_bytes``, flops per precision, and
    ``top_stalls`` (the three largest warp stall reasons, cycles per issued instruction). NaN = not collected.
    """
    out = []
    for (kid, kernel), m in report.metrics.groupby(["id", "kernel"], sort=False):
        row: dict[str, Any] = {"id": kid, "kernel": kernel, "function": function_base(kernel)}
        for q, cands in DERIVED.items():
            row[q], _ = _lookup(m, cands)
        if math.isnan(row["dram_bytes"]) and not (math.isnan(row["dram_bytes_read"]) and math.isnan(row["dram_bytes_write"])):
            row["dram_bytes"] = np.nansum([row["dram_bytes_read"], row["dram_bytes_write"]])
        row["shared_mem_bytes"] = np.nansum([row["shared_mem_static_bytes"], row["shared_mem_dynamic_bytes"]]) \
            if not (math.isnan(row["shared_mem_static_bytes"]) and math.isnan(row["shared_mem_dynamic_bytes"])) else math.nan
        for prec, parts in FLOP_COUNTERS.items():
            vals = [(_lookup(m, (name,))[0], mult) for name, mult in parts]
            row[f"flops_{prec}"] = sum(v * w for v, w in vals if not math.isnan(v)) \
                if any(not math.isnan(v) for v, _ in vals) else math.nan
        for prec, names in TENSOR_COUNTERS.items():
            vals = [_lookup(m, (n,))[0] for n in names]
            row[f"flops_{prec}"] = float(np.nansum(vals)) if any(not math.isnan(v) for v in vals) else math.nan
        stalls = []
        for metric, val in zip(m["metric"], m["value_base"]):
            for rx in STALL_RES:
                mm = rx.match(metric)
                if mm and not math.isnan(val) and mm.group("reason") not in NOT_STALLS:
                    stalls.append((mm.group("reason"), float(val)))
                    break
        stalls.sort(key=lambda t: -t[1])
        row["top_stalls"] = ", ".join(f"{r} {v:.2f}" for r, v in stalls[:3]) if stalls else "-"
        out.append(row)
    return pd.DataFrame(out)


def stall_reasons(report: NcuReport) -> pd.DataFrame:
    """Warp stall reasons per kernel (cycles per issued instruction), largest first: ``id, kernel, reason, value``."""
    rows = []
    for kid, kernel, metric, val in zip(report.metrics["id"], report.metrics["kernel"], report.metrics["metric"],
                                        report.metrics["value_base"]):
        for rx in STALL_RES:
            mm = rx.match(metric)
            if mm and not math.isnan(val) and mm.group("reason") not in NOT_STALLS:
                rows.append({"id": kid, "kernel": function_base(kernel), "reason": mm.group("reason"), "value": val})
                break
    df = pd.DataFrame(rows, columns=["id", "kernel", "reason", "value"])
    return df.sort_values(["id", "value"], ascending=[True, False]).reset_index(drop=True)


# ---------------------------------------------------------------- roofline

@dataclass(frozen=True)
class Peak:
    gpu: str
    quantity: str        # dram_bytes_per_s | fp32 | fp16 | fp64 | bf16_tensor | fp16_tensor | fp8_tensor
    value: float         # bytes/s or flop/s, dense (no structured sparsity)
    kind: str            # spec | measured
    source: str


GPU_PEAKS: tuple[Peak, ...] = (
    Peak("H200", "dram_bytes_per_s", 4.8e12, "spec", "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e"),
    Peak("H200", "bf16_tensor", 989e12, "spec", "NVIDIA H200 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with "
                                                "sparsity, i.e. ~989 TFLOPS dense"),
    Peak("H200", "fp16_tensor", 989e12, "spec", "NVIDIA H200 datasheet (SXM): FP16 Tensor Core 1,979 TFLOPS sparse / 2"),
    Peak("H200", "fp8_tensor", 1979e12, "spec", "NVIDIA H200 datasheet (SXM): FP8 Tensor Core 3,958 TFLOPS sparse / 2"),
    Peak("H200", "fp32", 67e12, "spec", "NVIDIA H200 datasheet (SXM): FP32 67 TFLOPS"),
    Peak("H200", "fp64", 34e12, "spec", "NVIDIA H200 datasheet (SXM): FP64 34 TFLOPS"),
    Peak("H200", "fp16", 134e12, "spec", "derived: 2 x FP32 (GH100 runs packed half2 at twice the FP32 rate; "
                                         "NVIDIA H100 architecture whitepaper)"),
    Peak("H200", "bf16_tensor", 805e12, "measured", "best observed: the 4096x4096x7168 bf16 GEMM of "
                                                    "data/samples/ncu/h200_toy_layer_raw.csv (ncu, clocks unlocked); "
                                                    "a lower bound of the real ceiling"),
    Peak("H200", "dram_bytes_per_s", 3.68e12, "measured", "best observed: the bf16 elementwise kernel of "
                                                          "data/samples/ncu/h200_toy_layer_raw.csv (dram__bytes / "
                                                          "duration); a lower bound of the real ceiling"),
)


def peaks_table(gpu: str = "H200") -> pd.DataFrame:
    """The roofline ceilings of ``gpu`` with their sources (spec sheet and measured here)."""
    rows = [p.__dict__ for p in GPU_PEAKS if p.gpu == gpu]
    if not rows:
        known = sorted({p.gpu for p in GPU_PEAKS})
        raise ValueError(f"no roofline peaks for GPU '{gpu}'; known: {known}")
    df = pd.DataFrame(rows)
    df["display"] = [f"{v / 1e12:.2f} TB/s" if q == "dram_bytes_per_s" else f"{v / 1e12:.0f} TFLOP/s"
                     for q, v in zip(df["quantity"], df["value"])]
    return df


def _peak(gpu: str, quantity: str, kind: str) -> float:
    for p in GPU_PEAKS:
        if p.gpu == gpu and p.quantity == quantity and p.kind == kind:
            return p.value
    for p in GPU_PEAKS:
        if p.gpu == gpu and p.quantity == quantity:
            return p.value
    return math.nan


def roofline(derived: pd.DataFrame, gpu: str = "H200", kind: str = "spec",
             flops_override: dict[str, float] | None = None) -> pd.DataFrame:
    """Place each kernel on the roofline of ``gpu``: its dominant precision (the one with most flops),
    arithmetic intensity (flops / DRAM bytes), achieved flop/s (flops / duration), the attainable ceiling
    ``min(peak, bandwidth × intensity)``, whether it sits left (memory-bound) or right (compute-bound) of the
    ridge point, and the fraction of the ceiling reached.

    ``flops_override`` maps a function name to a flop count computed from shapes (e.g. ``2·M·N·K`` for a
    GEMM) where the counters are absent; such rows say ``flops_source = "override"``.
    """
    bw = _peak(gpu, "dram_bytes_per_s", kind)
    rows = []
    for _, r in derived.iterrows():
        precs = {c[len("flops_"):]: r[c] for c in derived.columns if c.startswith("flops_") and not pd.isna(r[c])}
        src = "counters"
        if flops_override and r["function"] in flops_override:
            precs = {"bf16_tensor": float(flops_override[r["function"]])}
            src = "override"
        prec, flops = (max(precs.items(), key=lambda t: t[1]) if precs else ("-", math.nan))
        dram, dur = r.get("dram_bytes", math.nan), r.get("duration_ns", math.nan)
        ai = flops / dram if dram and dram > 0 and not math.isnan(flops) else math.nan
        achieved = flops / (dur * 1e-9) if dur and dur > 0 and not math.isnan(flops) else math.nan
        peak = _peak(gpu, prec, kind) if prec != "-" else math.nan
        ridge = peak / bw if bw and not math.isnan(peak) else math.nan
        attainable = min(peak, bw * ai) if not (math.isnan(ai) or math.isnan(peak)) else math.nan
        rows.append({"id": r["id"], "function": r["function"], "precision": prec, "flops": flops,
                     "flops_source": src if prec != "-" else "none", "dram_bytes": dram, "duration_us": dur / 1e3,
                     "intensity_flop_per_byte": ai, "achieved_tflops": achieved / 1e12,
                     "dram_tb_per_s": (dram / (dur * 1e-9) / 1e12) if dur and dur > 0 else math.nan,
                     "peak_tflops": peak / 1e12, "ridge_flop_per_byte": ridge,
                     "attainable_tflops": attainable / 1e12,
                     "bound": ("-" if math.isnan(ai) or math.isnan(ridge) else
                               "memory" if ai < ridge else "compute"),
                     "pct_of_roof": 100.0 * achieved / attainable if attainable and not math.isnan(attainable) else math.nan})
    return pd.DataFrame(rows)


def roofline_figure(roof: pd.DataFrame, gpu: str = "H200", kind: str = "spec") -> go.Figure:
    """Log-log roofline: the DRAM slope and one flat roof per precision present (``kind`` ceilings solid, the
    measured-here ceilings dashed), kernels as points coloured by precision (names on hover)."""
    bw = _peak(gpu, "dram_bytes_per_s", kind)
    fig = go.Figure()
    pts = roof.dropna(subset=["intensity_flop_per_byte", "achieved_tflops"])
    pts = pts[(pts["intensity_flop_per_byte"] > 0) & (pts["achieved_tflops"] > 0)]
    lo = max(min([0.1] + pts["intensity_flop_per_byte"].tolist()) / 2, 1e-3)
    hi = max([1e4] + (pts["intensity_flop_per_byte"] * 4).tolist())
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#9d755d")
    precs = sorted(set(pts["precision"])) or ["bf16_tensor"]
    for i, prec in enumerate(precs):
        color = palette[i % len(palette)]
        for k, dash in ((kind, "solid"),) + ((("measured", "dash"),) if kind != "measured" else ()):
            peak = next((p.value for p in GPU_PEAKS if p.gpu == gpu and p.quantity == prec and p.kind == k), math.nan)
            mbw = next((p.value for p in GPU_PEAKS if p.gpu == gpu and p.quantity == "dram_bytes_per_s" and p.kind == k), bw)
            if math.isnan(peak):
                continue
            fig.add_trace(go.Scatter(x=xs, y=np.minimum(peak, mbw * xs) / 1e12, mode="lines",
                                     line=dict(color=color, dash=dash), name=f"{k} roof {prec}: {peak / 1e12:.0f} "
                                     f"TFLOP/s, {mbw / 1e12:.1f} TB/s"))
        part = pts[pts["precision"] == prec]
        if len(part):
            fig.add_trace(go.Scatter(x=part["intensity_flop_per_byte"], y=part["achieved_tflops"], mode="markers",
                                     marker=dict(size=10, color=color, line=dict(width=1, color="black")),
                                     name=f"kernels ({prec})", text=part["function"],
                                     customdata=np.stack([part["pct_of_roof"], part["bound"]], axis=-1),
                                     hovertemplate="%{text}<br>AI %{x:.2f} flop/B<br>%{y:.2f} TFLOP/s<br>"
                                                   "%{customdata[0]:.0f}% of roof, %{customdata[1]}-bound<extra></extra>"))
    fig.update_xaxes(type="log", title="arithmetic intensity (flop per DRAM byte)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s")
    fig.update_layout(title=f"Roofline on {gpu} ({kind} ceilings solid, measured here dashed)", height=520)
    return fig


def top_kernels_figure(ranked: pd.DataFrame, n: int = 10) -> go.Figure:
    """One panel per window: its ``n`` largest kernels by critical-path ms, largest on top, coloured by the seeds'
    suspect. The ``unannotated`` window (kernels outside every step) is left out when step windows exist."""
    from plotly.subplots import make_subplots
    df = ranked
    if set(df["window"]) - {"unannotated"}:
        df = df[df["window"] != "unannotated"]
    windows = list(dict.fromkeys(df.sort_values("window")["window"]))
    fig = make_subplots(rows=max(len(windows), 1), cols=1, subplot_titles=[f"window: {w}" for w in windows] or [""],
                        vertical_spacing=0.16 if len(windows) > 1 else 0.1)
    palette = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d", "#ff9da6",
               "#bab0ac", "#8c564b", "#17becf")
    colors = {s: palette[i % len(palette)] for i, s in enumerate(sorted(set(df["suspect"])))}
    shown: set[str] = set()
    for i, w in enumerate(windows, start=1):
        part = df[df["window"] == w].nlargest(n, "critical_ms").iloc[::-1]
        labels = [f"#{r} {f[:70]}" for r, f in zip(part["rank"], part["function"])]
        for suspect, sub in part.groupby("suspect", sort=False):
            idx = [labels[j] for j, s in enumerate(part["suspect"]) if s == suspect]
            fig.add_trace(go.Bar(y=idx, x=sub["critical_ms"], orientation="h", name=suspect, legendgroup=suspect,
                                 marker_color=colors[suspect], showlegend=suspect not in shown,
                                 customdata=np.stack([sub["count"], sub["mean_dur_us"], sub["share_pct"]], axis=-1),
                                 hovertemplate="%{y}<br>%{x:.2f} ms, %{customdata[0]} launches, %{customdata[1]:.1f} µs "
                                               "mean, %{customdata[2]:.1f}% of window<extra></extra>"), row=i, col=1)
            shown.add(suspect)
        fig.update_yaxes(categoryorder="array", categoryarray=labels, row=i, col=1)
        fig.update_xaxes(title_text="ms in the captured window", row=i, col=1)
    fig.update_layout(height=max(360, (22 * n + 90) * max(len(windows), 1)), barmode="stack",
                      title="Kernels on the critical path, per window")
    return fig


# ---------------------------------------------------------------- Phase 6 composition

@dataclass
class Phase6Result:
    """What the Phase 6 notebook shows."""
    source: str                       # where the kernel table came from
    ranked: pd.DataFrame
    top: pd.DataFrame
    commands: pd.DataFrame
    ncu_files: list[str] = field(default_factory=list)
    ncu_metrics: pd.DataFrame = field(default_factory=pd.DataFrame)
    derived: pd.DataFrame = field(default_factory=pd.DataFrame)
    stalls: pd.DataFrame = field(default_factory=pd.DataFrame)
    rules: pd.DataFrame = field(default_factory=pd.DataFrame)
    roof: pd.DataFrame = field(default_factory=pd.DataFrame)
    peaks: pd.DataFrame = field(default_factory=pd.DataFrame)


# the shipped real captures (2 × H200, 2026-11-29) Phase 6 falls back to
SAMPLE_TRACES = ("h200x2-pp2/traces/20261129215256-TP-0-PP-0.trace.json.gz",)
SAMPLE_NCU = ("ncu/h200_toy_layer_raw.csv", "ncu/ncu_raw.csv")


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


def run_phase6(ctx: Any, kernel_source: str = "", ncu_csv: Sequence[str] = (), top_n: int = 3,
               repro: Sequence[str] = (), launch_skip: int = 20, launch_count: int = 3, gpu: str = "H200") -> Phase6Result:
    """Phase 6 in one call: rank kernels, plan ``ncu`` commands (recorded as ``planned``), import ``ncu`` CSVs.

    ``kernel_source``: a Phase 3 table or trace; empty = the shipped sample (``data/samples/``), and the
    phase is marked ``from_samples``. ``ncu_csv``: ``ncu --csv`` outputs to import; empty = the shipped
    ``data/samples/ncu/*.csv`` when present (also ``from_samples``).
    """
    from servelab.core.paths import samples_root
    from servelab.phases.context import log_command
    if kernel_source:
        source = str(kernel_source)
    else:
        cands = [samples_root() / p for p in SAMPLE_TRACES if (samples_root() / p).is_file()]
        if not cands:
            raise KernelTableError(f"no kernel_source given and none of the sample traces {SAMPLE_TRACES} exists "
                                   f"under {samples_root()}")
        source = str(cands[0])
        ctx.from_samples = True
    table = load_kernel_table(source)
    ranked = rank_kernels(table)
    top = top_kernels(table, n=top_n)
    if set(top["window"]) - {"unannotated"}:     # step windows exist: kernels outside them are not the target
        top = top[top["window"] != "unannotated"].reset_index(drop=True)
    app = list(repro) or default_repro_argv(ctx.target)
    cmds = planned_ncu_commands(top, app, launch_skip=launch_skip, launch_count=launch_count,
                                export_dir=str(ctx.phase_dir / "ncu"))
    for _, c in cmds.iterrows():
        log_command(ctx, "planned", c["argv"], title=f"ncu {c['window']} #{c['rank']} {c['function']}",
                    note="small reproduction under Nsight Compute; not executed by servelab")
    files = [str(f) for f in ncu_csv]
    if not files:
        files = [str(samples_root() / p) for p in SAMPLE_NCU if (samples_root() / p).is_file()]
        if files:
            ctx.from_samples = True
    res = Phase6Result(source=source, ranked=ranked, top=top, commands=cmds, ncu_files=files, peaks=peaks_table(gpu))
    reports = [read_ncu_csv(f) for f in files]
    if reports:
        res.ncu_metrics = pd.concat([r.metrics.assign(file=Path(r.path).name) for r in reports], ignore_index=True)
        res.derived = pd.concat([derived_metrics(r).assign(file=Path(r.path).name) for r in reports], ignore_index=True)
        res.stalls = pd.concat([stall_reasons(r).assign(file=Path(r.path).name) for r in reports], ignore_index=True)
        rules = [r.rules.assign(file=Path(r.path).name) for r in reports if not r.rules.empty]
        res.rules = pd.concat(rules, ignore_index=True) if rules else pd.DataFrame()
        res.roof = roofline(res.derived, gpu=gpu)
        res.roof.insert(0, "file", res.derived["file"].to_numpy())
        res.ncu_metrics.to_csv(ctx.phase_dir / "ncu_metrics.csv", index=False)
        res.derived.to_csv(ctx.phase_dir / "ncu_derived.csv", index=False)
        res.roof.to_csv(ctx.phase_dir / "roofline.csv", index=False)
    ranked.to_csv(ctx.phase_dir / "kernels_ranked.csv", index=False)
    top.to_csv(ctx.phase_dir / "top_kernels.csv", index=False)
    return res


def derived_view(derived: pd.DataFrame) -> pd.DataFrame:
    """The §11 table as a reader wants it: one row per kernel launch, rounded, units in the headers."""
    if derived.empty:
        return derived
    cols = {"function": "kernel", "duration_ns": "duration_us", "sm_throughput_pct": "SM %", "tensor_pipe_pct": "tensor pipe %",
            "dram_throughput_pct": "DRAM %", "l2_hit_rate_pct": "L2 hit %", "achieved_occupancy_pct": "achieved occ. %",
            "theoretical_occupancy_pct": "theoretical occ. %", "registers_per_thread": "regs/thread",
            "shared_mem_bytes": "smem/block (B)", "block_threads": "block", "grid_blocks": "grid", "top_stalls": "top stalls"}
    df = derived[[c for c in ("file", "id", *cols) if c in derived.columns]].rename(columns=cols).copy()
    df["kernel"] = df["kernel"].map(lambda k: k if len(k) <= 48 else k[:47] + "…")
    df["duration_us"] = df["duration_us"] / 1e3
    return df.round(2)


def source_banner(ctx: Any, res: Phase6Result):
    """Where this page's kernels and counters come from: a sample banner when from ``data/samples``."""
    from servelab.report.banner import banner, sample_banner
    files = ", ".join(Path(f).name for f in res.ncu_files) or "none"
    text = f"Kernel table: {res.source}. ncu CSVs: {files}."
    if ctx.from_samples:
        return sample_banner(text + " Recorded on a 2 × H200 machine (2026-11-29) with random-weight toy models "
                                    "(data/samples/h200x2-pp2, data/samples/ncu; see capture.sh there) — not this "
                                    "run's engine.")
    return banner(text, "info", "Sources")


def ncu_view(res: Phase6Result, what: str = "derived"):
    """``derived`` (the §11 table), ``stalls``, ``rules`` or ``roofline`` — or a banner when no ncu CSV was imported."""
    from servelab.report.banner import banner
    if not res.ncu_files:
        return banner("No ncu CSV was imported: run the planned commands above on the GPU node (or pass ncu_csv) "
                      "and re-run this phase.", "warning", "No Nsight Compute data yet")
    stalls = res.stalls.groupby(["file", "id"], sort=False).head(3) if not res.stalls.empty else res.stalls
    roof = res.roof.assign(function=res.roof["function"].map(lambda k: k if len(k) <= 48 else k[:47] + "…")).round(3) \
        if not res.roof.empty else res.roof
    table = {"derived": derived_view(res.derived), "stalls": stalls, "rules": res.rules, "roofline": roof}[what]
    return table
