"""Nsight Systems, acquired: the ``nsys profile`` / ``nsys stats`` / ``nsys recipe`` command lines of
``docs/method.md#capture-scenarios``, and a capture per node bound to its case id — its ``nsys profile`` command
wrapping that node's engine launch, recorded in the run's ``commands.jsonl`` as planned and, once run, as executed.
Reading what they write is :mod:`servelab.analyse.trace.nsys`."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from servelab.core.run import CommandRecord, record_command
from servelab.deploy.server import plan_launch
from servelab.deploy.spec import Target

CAPTURE_RANGES = ("cudaProfilerApi", "nvtx", "hotkey", "none")
RANGE_END_MODES = ("defer", "sync", "async")



RECIPE_NAMES = ("nccl_sum", "nccl_gpu_proj_sum", "cuda_gpu_time_util_map", "nccl_gpu_time_util_map",
                "gpu_time_util", "nccl_gpu_overlap_trace")


def nsys_profile_argv(app_argv: Sequence[str], output: str, *, trace: Sequence[str] = ("cuda", "nvtx", "nccl"),
                      trace_fork_before_exec: bool = True, cuda_graph_trace: str | None = "node",
                      capture_range: str | None = "cudaProfilerApi", capture_range_end: str | None = "repeat",
                      repeat: int | None = None, repeat_mode: str | None = None, sample: str | None = None,
                      force_overwrite: bool = True, nsys: str = "nsys", extra: Sequence[str] = ()) -> list[str]:
    """``nsys profile`` argv wrapping ``app_argv`` (``docs/method.md#capture-scenarios``).

    ``capture_range_end="repeat"`` with ``repeat=3`` and ``repeat_mode="defer"`` gives
    ``--capture-range-end=repeat:3:defer`` (three capture ranges in one model load; results written at
    exit). ``output`` may contain nsys placeholders such as ``%n`` (range number) or ``%h`` (host).
    """
    if not app_argv:
        raise ValueError("nsys_profile_argv: app_argv is empty — the command to profile is required")
    if capture_range is not None and capture_range not in CAPTURE_RANGES:
        raise ValueError(f"capture_range {capture_range!r}: expected one of {', '.join(CAPTURE_RANGES)}")
    argv = [nsys, "profile", f"--trace={','.join(trace)}"]
    if trace_fork_before_exec:
        argv.append("--trace-fork-before-exec=true")
    if cuda_graph_trace:
        if cuda_graph_trace not in ("node", "graph"):
            raise ValueError(f"cuda_graph_trace {cuda_graph_trace!r}: expected 'node' or 'graph'")
        argv.append(f"--cuda-graph-trace={cuda_graph_trace}")
    if sample is not None:
        argv.append(f"--sample={sample}")
    if capture_range:
        argv.append(f"--capture-range={capture_range}")
    if capture_range_end:
        end = capture_range_end
        if end.startswith("repeat"):
            if repeat is not None:
                if int(repeat) < 1:
                    raise ValueError(f"repeat={repeat}: must be ≥ 1")
                end = f"{end}:{int(repeat)}"
            if repeat_mode is not None:
                if repeat_mode not in RANGE_END_MODES:
                    raise ValueError(f"repeat_mode {repeat_mode!r}: expected one of {', '.join(RANGE_END_MODES)}")
                if repeat is None and end == "repeat":
                    raise ValueError("repeat_mode needs repeat=N (nsys syntax repeat[:N][:mode])")
                end = f"{end}:{repeat_mode}"
        elif capture_range_end not in ("none", "stop", "stop-shutdown"):
            raise ValueError(f"capture_range_end {capture_range_end!r}: expected none | stop | stop-shutdown | "
                             "repeat | repeat-shutdown:N")
        argv.append(f"--capture-range-end={end}")
    if force_overwrite:
        argv.append("--force-overwrite=true")
    argv += ["-o", output, *extra, *app_argv]
    return argv


def nsys_stats_argv(report: str, reports: Sequence[str] = ("cuda_gpu_kern_sum", "cuda_api_sum", "nvtx_sum"),
                    output_base: str | None = None, nsys: str = "nsys") -> list[str]:
    """``nsys stats --report a,b --format csv --output <base>`` → files ``<base>_<report>.csv``."""
    base = output_base or re.sub(r"\.(nsys-rep|qdrep|sqlite)$", "", report)
    return [nsys, "stats", "--report", ",".join(reports), "--format", "csv", "--output", base, "--force-export=true",
            report]


def display(argv: Sequence[str]) -> str:
    """Shell-quoted rendering for humans (commands are run as argv lists)."""
    return shlex.join(list(argv))


def nsys_recipe_argv(recipe: str, report: str, output: str, csv: bool = True, nsys: str = "nsys",
                     extra: Sequence[str] = ()) -> list[str]:
    """``nsys recipe <recipe> --input <report> --output <dir>`` (``--csv`` only for the stats recipes, which
    take it)."""
    if recipe not in RECIPE_NAMES:
        raise ValueError(f"recipe {recipe!r}: expected one of {', '.join(RECIPE_NAMES)}")
    argv = [nsys, "recipe", recipe, "--input", report, "--output", output, "--force-overwrite"]
    if csv and recipe in ("nccl_sum", "nccl_gpu_proj_sum"):
        argv.append("--csv")
    return [*argv, *extra]


# ------------------------------------------------------------------------------------------------ capture

@dataclass
class NsysCapture:
    """One node's ``nsys profile`` of a case: the report is named after the case id (and the node), so every file
    it leads to (``.nsys-rep``, ``nsys stats`` CSVs, recipe folders) says which case it profiled."""
    case_id: str
    node: str
    argv: list[str]
    report: str                          # the -o base: <out_dir>/<case_id>.<node>
    status: str = "planned"              # planned | executed | failed
    exit_code: int | None = None
    start: str | None = None
    end: str | None = None

    @property
    def report_file(self) -> str:
        return self.report + ".nsys-rep"


def plan_nsys_captures(case_id: str, nodes: Sequence[str], app_argv: Sequence[str], out_dir: str,
                       **profile_kw) -> list[NsysCapture]:
    """The ``nsys profile`` command of each node for one case (``nsys_profile_argv`` with ``profile_kw``), its report
    ``<out_dir>/<case_id>.<node>``. Raises ValueError for a case id or node name that cannot name a file."""
    bad = [x for x in (case_id, *nodes) if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,95}", x or "")]
    if bad:
        raise ValueError(f"case id / node {bad[0]!r}: 1-96 letters, digits and . _ = + - (it names the report file)")
    out = []
    for node in nodes:
        report = f"{out_dir.rstrip('/')}/{case_id}.{node}"
        out.append(NsysCapture(case_id, node, nsys_profile_argv(app_argv, report, **profile_kw), report))
    return out


def record_nsys_captures(run_dir: Path, phase: str, captures: Sequence[NsysCapture]) -> None:
    """Each capture's ``nsys profile`` command into the run's ``commands.jsonl``: label ``planned`` while it has not
    run, ``executed`` (with its exit code and times) once it has."""
    for c in captures:
        done = c.status != "planned"
        record_command(run_dir, CommandRecord(
            label="executed" if done else "planned", argv=list(c.argv), phase=phase, host=c.node,
            title=f"nsys profile of case {c.case_id} on {c.node}", start=c.start, end=c.end, exit_code=c.exit_code,
            note=f"report {c.report_file}" + (f"; {c.status}" if done else "; run it on the node, then "
                                                                            "nsys stats / nsys recipe")),
                       unique=not done)


NSYS_OUT = "/data/nsys"       # where the planned reports go on each node (a placeholder folder the user picks)


def plan_target_captures(run_dir: Path, phase: str, case_ids: Sequence[str], target: Target,
                         out_dir: str = NSYS_OUT) -> list[NsysCapture]:
    """For each case, every node's ``nsys profile`` wrapping that node's own engine launch (the argv
    ``deploy.server.plan_launch`` gives the target, key-free: secrets are redacted when recorded), recorded as
    planned: what to run on a GPU host to get the Nsight Systems view of the same case the torch profiler captured."""
    plans, _ = plan_launch(target)
    caps = [c for cid in case_ids for p in plans for c in plan_nsys_captures(cid, [p.node], p.argv, out_dir)]
    record_nsys_captures(run_dir, phase, caps)
    return caps
