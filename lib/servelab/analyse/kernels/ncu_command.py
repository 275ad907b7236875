"""The ``ncu`` argv that profiles a small reproduction of the service (never the service itself), one per top
kernel, and the reproduction each engine offers (asked of its adapter)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd

from servelab.analyse.kernels.ranking import function_base
from servelab.deploy.engines import engine_for


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
    """What one ``ncu`` run collects. Defaults follow ``docs/method.md#kernels``: few launches of one kernel, the
    sections its questions need, the roofline counters, and clocks left alone (``--clock-control none``: the GPU
    keeps the clocks the service would see)."""
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
    """A small single-batch reproduction for the target's engine (what ``ncu`` wraps), from its adapter.

    SGLang: ``sglang.bench_one_batch`` (no server, one static batch); vLLM: ``vllm bench latency``; llama.cpp:
    ``llama-bench``. The TP/PP degree of the target is kept so the kernels see the service's shapes.
    """
    return engine_for(target.engine).one_batch_bench_argv(target, batch_size, input_len, output_len)


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
