#!/usr/bin/env bash
# How the ncu CSVs in this folder were captured (one H200, Nsight Compute from the CUDA image, clocks left alone).
# The ncu argv is the one servelab.analyse.kernels.ncu_command builds for NcuSpec(profile_from_start=False,
# launch_count=40, export=...); metrics the installed ncu does not know are dropped first (ncu refuses the
# whole run on an unknown metric). Usage: OUT=/some/dir bash data/samples/ncu/capture.sh
set -euo pipefail
OUT=${OUT:?set OUT to the output folder}
HERE=$(cd "$(dirname "$0")" && pwd)
{ ncu --version; nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/ncu_version.txt" 2>&1
ncu --query-metrics > /tmp/ncu_query_metrics.txt 2>&1 || true
grep -E "tensor|issue_stalled|ops_path|dram__bytes|sass_thread_inst_executed_op_[fhd](add|mul|fma)" \
    /tmp/ncu_query_metrics.txt > "$OUT/query_metrics_selected.txt" || true
WANT="gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,smsp__sass_thread_inst_executed_op_fadd_pred_on.sum,smsp__sass_thread_inst_executed_op_fmul_pred_on.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum,smsp__sass_thread_inst_executed_op_hadd_pred_on.sum,smsp__sass_thread_inst_executed_op_hmul_pred_on.sum,smsp__sass_thread_inst_executed_op_hfma_pred_on.sum,smsp__sass_thread_inst_executed_op_dadd_pred_on.sum,smsp__sass_thread_inst_executed_op_dmul_pred_on.sum,smsp__sass_thread_inst_executed_op_dfma_pred_on.sum,sm__ops_path_tensor_src_bf16_dst_fp32.sum,sm__ops_path_tensor_src_fp16_dst_fp32.sum,sm__ops_path_tensor_src_fp8.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__inst_executed_pipe_tensor_op_hmma.sum"
METRICS=$(python3 - "$WANT" /tmp/ncu_query_metrics.txt <<'EOF'
import re, sys
known = set(re.findall(r"^\s*([a-z0-9_]+__[a-z0-9_]+)", open(sys.argv[2]).read(), re.M))
keep = [m for m in sys.argv[1].split(",") if m.split(".")[0] in known]
print(",".join(keep))
print("dropped (unknown to this ncu):", [m for m in sys.argv[1].split(",") if m not in keep], file=sys.stderr)
EOF
)
echo "metrics: $METRICS"
cd "$HERE/../../.."
ncu --target-processes all --launch-skip 0 --launch-count 40 --profile-from-start off \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --metrics "$METRICS" --clock-control none --export "$OUT/toy_layer" --force-overwrite \
    python3 data/samples/ncu/ncu_toy_layer.py
ncu --import "$OUT/toy_layer.ncu-rep" --csv --page raw --print-units base > "$OUT/toy_layer_raw.csv"
ncu --import "$OUT/toy_layer.ncu-rep" --csv --page details --print-units base > "$OUT/toy_layer_details.csv"
ncu --import "$OUT/toy_layer.ncu-rep" --csv > "$OUT/toy_layer_details_autounits.csv"
# the same counters printed straight from a profiling run (==PROF== lines and program output around the table)
ncu --target-processes all --launch-count 4 --profile-from-start off --metrics "$METRICS" --clock-control none \
    --csv --page raw python3 data/samples/ncu/ncu_toy_layer.py > "$OUT/toy_direct_raw.csv" 2>&1
ls -la "$OUT"
