"""Kernel deep-dive: the top kernels of a Phase 3 capture, ``ncu`` commands, ``ncu`` CSV import, roofline.

``docs/method.md#kernels`` (and ``#workflow``): pick from the timeline the 1–3 kernels that contribute most to the
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

Modules: ranking (suspect labels, kernels ranked per window, the kernel table from a trace), ncu_command (the
``ncu`` argv for a small reproduction), ncu_csv (the CSV import, derived metrics, stall reasons), roofline
(ceilings with sources, kernels placed on the roofline), figures. Phase 6 (``phase6_kernels``) composes them.
"""
from servelab.analyse.kernels.figures import roofline_figure, top_kernels_figure
from servelab.analyse.kernels.ncu_command import (ROOFLINE_METRICS, SECTIONS, NcuSpec, default_repro_argv, ncu_command,
                                                  ncu_import_command, planned_ncu_commands)
from servelab.analyse.kernels.ncu_csv import (NcuFormatError, NcuReport, derived_metrics, parse_number, read_ncu_csv,
                                              stall_reasons, to_base_unit)
from servelab.analyse.kernels.ranking import (SUSPECTS, KernelTableError, function_base, kernel_table_from_trace,
                                              load_kernel_table, rank_kernels, suspect_of, top_kernels)
from servelab.analyse.kernels.roofline import GPU_PEAKS, Peak, peaks_table, roofline

__all__ = ["roofline_figure", "top_kernels_figure", "ROOFLINE_METRICS", "SECTIONS", "NcuSpec", "default_repro_argv",
           "ncu_command", "ncu_import_command", "planned_ncu_commands", "NcuFormatError", "NcuReport",
           "derived_metrics", "parse_number", "read_ncu_csv", "stall_reasons", "to_base_unit", "SUSPECTS",
           "KernelTableError", "function_base", "kernel_table_from_trace", "load_kernel_table", "rank_kernels",
           "suspect_of", "top_kernels", "GPU_PEAKS", "Peak", "peaks_table", "roofline"]
